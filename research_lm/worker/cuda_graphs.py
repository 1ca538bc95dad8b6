"""CUDA graphs for decode and spec-verify steps: one graph per (padded batch size, query length),
replayed over the step buffers.

A decode step of n requests runs the graph captured for the smallest size B >= n with query length 1.
With a proposer of k drafts, graphs of query length q = k + 1 are captured too (where every attention
backend declares `cuda_graphs_multi_token`): a step whose longest query is 2 .. q tokens (a verify step,
requests with fewer drafts, short prompt chunks riding along) runs the graph of the smallest B >= n,
its B * q token rows holding the step's T <= n * q tokens. Batches larger than the largest size run
eagerly, and so do longer prefills, except one request's prompt (or chunk) of at most max(prefill_sizes)
tokens: it replays a prefill graph of B = 1 and q = Q, the smallest of `prefill_sizes` that holds it (16,
32, 64, ... 512 by default). Eager, a prefill step of an 8-layer Llama is ~80 launches whose host cost
(4-6 ms on the H200's host) is ~10x its kernels' at batch 1. A graph holds the model forward and, given
`compute_logits`, the logits of every token row and their argmax:

    hidden = model(input_ids[:B*q], positions[:B*q])    # [B*q, hidden]
    logits[:B*q] = compute_logits(hidden)               # [B*q, vocab] fp32, a persistent buffer
    greedy_ids[:B*q] = logits[:B*q].argmax(-1)          # [B*q] int64, a persistent buffer

Prefill graphs hold the forward alone: such a step samples one row of Q, whose logits the runner
computes from the graph's hidden states. When every token of the step is sampled (a decode, or a verify
step: the k + 1 rows of each request), the runner hands logits[:T] to the sampler or the rejection
sampler, or, when the sampler would return argmax(raw logits) anyway (`SamplingBatch.argmax_only`: all
greedy, no penalty, min_tokens ban or logprobs), takes greedy_ids[:T] directly: such a decode step is one
replay and one device -> host copy of n token ids. Otherwise it gathers the sampled rows from the graph's
logits.

Memory: the two buffers are sized by the largest captured B * q, max(B * q) x vocab x 4 bytes of
logits (256 MB for 512 x 128k) plus max(B * q) x 8 bytes of ids; the capture pool also keeps the
largest graph's transient lm_head output (for a bf16 model another 1.5x the logits buffer), since
pool memory is not handed back while the graphs live. Smaller `cuda_graph_sizes` shrink both.

NOTE: a graph replays the device addresses it saw at capture: the weights, the KV cache, and the
runner's persistent step buffers. Every input of the forward is a prefix view (rows 0 .. B, tokens
0 .. B*q) of a buffer allocated once (`StepBuffers`), so the record a step builds points where the
capture's did; `buffer_addresses` lists those addresses and the tests compare them step after step.
The launch plan (tile shape, split-KV count, grid) is fixed at capture from host integers: B, B*q, q
and max_model_len; the Triton kernel's grid is an upper bound that reads each request's extent from
query_start_loc, so any T <= B*q tokens of n <= B requests with queries of 2 .. q tokens fit.

Padding: token rows T .. B*q get token 0 at position 0 and slot -1 (no KV write); request rows n .. B
have query length 0 (query_start_loc repeats T), seq_len 0 and request row -1: attention skips them,
and every other op of the forward, the lm_head and the argmax are row-wise, so nothing computed for
them reaches a real row.
"""

from __future__ import annotations

import bisect
import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from attention_zoo import CommonAttentionMetadata
from research_lm.worker.buffers import StepBuffers
from research_lm.worker.verification import accept_greedily

Outputs = Any  # what a captured function returns: the model's hidden states [T, hidden], or nothing
# fn -> replay: runs fn once to warm up, records it, and returns a callable that re-runs the recording.
Capture = Callable[[Callable[[], Outputs], Any], Callable[[], Outputs]]


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 (vLLM's default), up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    return sorted({*sizes, max_num_seqs})


def default_prefill_sizes(max_num_tokens: int) -> list[int]:
    """Prompt lengths of the batch-1 prefill graphs: 16, 32, 64, 128, 256, 512, up to max_num_tokens (padding
    a prompt at most doubles its tokens; longer prompts, and chunks past 512, run eagerly)."""
    return [s for s in (16, 32, 64, 128, 256, 512) if s <= max_num_tokens]


def unsupported_reason(model: torch.nn.Module, backends: Sequence[Any], device: torch.device) -> str | None:
    """Why decode graphs cannot serve this model with these attention backends on this device (None: they can).

    Backends declare support in their capabilities; a module class that syncs with the host in forward
    declares `cuda_graphs = False` (MoE routing does)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    return uncapturable_reason(model, backends)


def uncapturable_reason(model: torch.nn.Module, backends: Sequence[Any], lengths_on_device: bool = False) -> str | None:
    """Why this model's forward with these attention backends cannot be captured, whatever the device
    (None: it can). A drafter checks itself with this: it may be another architecture than the target, and its
    chain's lengths exist only on the device (`lengths_on_device`), which backends that plan a replay on the host
    (`graphs_plan_on_host`) cannot serve."""
    eager = sorted(b.name for b in backends if not b.capabilities.cuda_graphs)
    if eager:
        return f"attention backend(s) {eager} do not support CUDA graphs"
    host = sorted(b.name for b in backends if b.capabilities.graphs_plan_on_host)
    if lengths_on_device and host:
        return f"attention backend(s) {host} plan each replay from lengths on the host, which only the device knows"
    layers = sorted({type(m).__name__ for m in model.modules() if getattr(type(m), "cuda_graphs", True) is False})
    if layers:
        return f"layers {layers} do not support CUDA graphs"
    return None


def pad_step_inputs(buf: StepBuffers, num_reqs: int, num_tokens: int, padded_reqs: int, padded_tokens: int) -> None:
    """Write padding token rows num_tokens .. padded_tokens and request rows num_reqs .. padded_reqs
    into the host side of the step buffers (numpy, no copies); the step's own rows are left as they are."""
    t, tp, n, b = num_tokens, padded_tokens, num_reqs, padded_reqs
    buf.input_ids.np[t:tp] = 0
    buf.positions.np[t:tp] = 0
    buf.slot_mapping.np[t:tp] = -1
    buf.query_start_loc.np[n + 1 : b + 1] = buf.query_start_loc.np[n]
    buf.seq_lens.np[n:b] = 0
    buf.num_computed.np[n:b] = 0
    buf.request_rows.np[n:b] = -1


def graph_metadata(
    buf: StepBuffers, padded: int, block_size: int, max_seq_len: int, query_len: int = 1
) -> CommonAttentionMetadata:
    """The record of a padded batch of `padded` requests x `query_len` tokens: views over the device
    buffers, made once at capture.

    max_seq_len is the largest the graph must serve (max_model_len), so the launch plan it fixes fits
    every step it replays for."""
    b, t = padded, padded * query_len
    return CommonAttentionMetadata(
        query_start_loc=buf.query_start_loc.gpu[: b + 1],
        query_start_loc_cpu=buf.query_start_loc.cpu[: b + 1],
        seq_lens=buf.seq_lens.gpu[:b],
        seq_lens_cpu=buf.seq_lens.cpu[:b],
        num_computed_tokens_cpu=buf.num_computed.cpu[:b],
        block_table=buf.block_table.gpu[:b],
        slot_mapping=buf.slot_mapping.gpu[:t],
        request_rows=buf.request_rows.gpu[:b],
        num_reqs=b,
        num_tokens=t,
        max_query_len=query_len,
        max_seq_len=max_seq_len,
        block_size=block_size,
    )


def buffer_addresses(buf: StepBuffers, common: CommonAttentionMetadata | None = None) -> dict[str, int]:
    """data_ptr of every device tensor a decode forward reads, from `common` or else the buffers."""
    if common is None:
        common = graph_metadata(buf, 1, 1, 1)
    return {
        "input_ids": buf.input_ids.gpu.data_ptr(),
        "positions": buf.positions.gpu.data_ptr(),
        "query_start_loc": common.query_start_loc.data_ptr(),
        "seq_lens": common.seq_lens.data_ptr(),
        "block_table": common.block_table.data_ptr(),
        "slot_mapping": common.slot_mapping.data_ptr(),
        "request_rows": common.request_rows.data_ptr(),
    }


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Python's garbage collector off, and every object alive on entry out of its reach, while graphs are captured.

    Why: `torch.cuda.graph` collects garbage on entering each capture, which took 0.22 s in a sweep job (a process
    holding transformers, Hydra and earlier jobs' objects) and there are 20-70 captures per LLM: half of every
    spec_ablation job (PERFORMANCE.md, eighteenth pass). Frozen objects are not traversed, so those collections
    become cheap. Off also as vLLM captures: processes that had made LLMs before now and then failed a capture
    (CUBLAS_STATUS_EXECUTION_FAILED, "operation failed due to a previous error during capture"), and a collection
    inside a capture would free those LLMs' pinned buffers and events, whose CUDA calls invalidate it."""
    was_enabled = gc.isenabled()
    gc.collect()  # once: what is garbage now goes before the freeze
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def cuda_graph_capture(fn: Callable[[], Outputs], pool: Any) -> Callable[[], Outputs]:
    """Warm fn up (compiles kernels, fills plan caches), capture it into a graph; replay returns its
    static outputs, overwritten by each replay. The collector is off meanwhile (`gc_frozen` says why); call it inside
    `gc_frozen`, as the runner does, or each capture's own collection traverses every object of the process."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
    finally:
        if was_enabled:
            gc.enable()

    def replay() -> Outputs:
        graph.replay()
        return out

    return replay


def eager_capture(fn: Callable[[], Outputs], pool: Any) -> Callable[[], Outputs]:
    """A stand-in for `cuda_graph_capture` that re-runs fn: tests the padding and buffer plumbing on CPU."""
    return fn


class GraphPool:
    """The one CUDA-graph mechanism: every graph a runner replays (the target's decode / verify / prefill graphs and
    each drafter's, each owner keying its own by shape) is captured through one pool, into one memory pool. Graphs
    replay one at a time on one stream, so a capture may reuse the memory an earlier capture freed; what a graph
    returns stays allocated for its replays. `capture` (`cuda_graph_capture`, or `eager_capture` on CPU) records."""

    def __init__(self, capture: Capture = cuda_graph_capture):
        self._capture = capture
        self._memory = torch.cuda.graph_pool_handle() if capture is cuda_graph_capture else None
        self.num_graphs = 0

    def __call__(self, fn: Callable[[], Outputs]) -> Callable[[], Outputs]:
        """fn captured; its replay."""
        self.num_graphs += 1
        return self._capture(fn, self._memory)

    @classmethod
    def of(cls, capture: Capture | GraphPool) -> GraphPool:
        """The pool a graph owner captures through: the runner's, or its own around a bare capture (tests)."""
        return capture if isinstance(capture, GraphPool) else cls(capture)


@dataclass
class GraphStep:
    """What a replay leaves for the runner: views of token rows 0 .. num_tokens, valid until the next replay."""

    out: torch.Tensor  # the forward's hidden states [num_tokens, hidden] (taps: the runner's HiddenStateTaps)
    logits: torch.Tensor | None  # [num_tokens, vocab] fp32, one row per token; None: not captured
    greedy_ids: torch.Tensor | None  # [num_tokens] int64, logits.argmax(-1); None: not captured
    # A verify graph's greedy acceptance of every request's drafts (`DecodeGraphs` num_drafts), packed for the host
    # copy over the graph's B requests: [B * q emitted (-1 after each request's) | B counts | B real drafts]; None:
    # not captured. What plain-greedy verification would emit; the runner uses it only for such steps.
    accepted: torch.Tensor | None = None


class DecodeGraphs:
    """Captured steps keyed by (padded batch size, query length); `key_for` says which one a step replays, if any.

    query_lens: 1 (decode) and, for spec decoding, k + 1 (verification). compute_logits ([n, hidden] ->
    [n, vocab] fp32) and vocab_size, both or neither: with them the graphs also fill `logits` and
    `greedy_ids`; without, they hold the forward only. prefill_sizes: query lengths captured at B = 1 for
    one request's prompt or chunk, always forward only (`prefill` lists the captured ones). max_seq_len:
    max_model_len. num_drafts ([R] int32, the device table of real drafts per request row): verify graphs also
    accept each request's drafts greedily (`GraphStep.accepted`), or under acceptance replay let replay_accept
    write it (`AcceptanceReplay.accept_greedily`, bound to the token counts). tree_bits: verify graphs of a token
    tree attend through these masks (`CommonAttentionMetadata.tree_bits`), written before each replay."""

    def __init__(
        self,
        model: torch.nn.Module,
        buffers: StepBuffers,
        backends: Sequence[Any],
        *,
        sizes: Sequence[int],
        block_size: int,
        max_seq_len: int,
        query_lens: Sequence[int] = (1,),
        compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
        vocab_size: int | None = None,
        prefill_sizes: Sequence[int] = (),
        num_drafts: torch.Tensor | None = None,
        replay_accept: Callable[..., None] | None = None,
        tree_bits: torch.Tensor | None = None,
        capture: Capture | GraphPool = cuda_graph_capture,
    ):
        assert (compute_logits is None) == (vocab_size is None), "compute_logits needs vocab_size"
        self.buffers = buffers
        self.num_drafts = num_drafts
        self.replay_accept = replay_accept  # (rows, num_drafts, ids, argmax, logits, packed, b, q): writes packed
        self.tree_bits = tree_bits  # [max tokens] int64: a token tree's masks, which verify graphs read in place
        # At most max_num_seqs requests and max_num_batched_tokens tokens per step.
        self.sizes: dict[int, list[int]] = {}  # query length -> captured batch sizes, ascending
        for q in sorted(set(query_lens)):
            fit = sorted(s for s in set(sizes) if 1 <= s <= buffers.max_num_reqs and s * q <= buffers.max_num_tokens)
            if fit:
                self.sizes[q] = fit
        # Longer than every uniform graph's q, within the token budget, and (a capture runs positions 0 .. q-1)
        # within the model's positions.
        longest, limit = max(self.sizes, default=1), min(buffers.max_num_tokens, max_seq_len)
        self.prefill = sorted(q for q in set(prefill_sizes) if longest < q <= limit)
        self.addresses: dict[tuple[int, int], dict[str, int]] = {}  # (B, q) -> buffer addresses at capture
        self._replay: dict[tuple[int, int], Callable[[], Outputs]] = {}
        self._metadata: dict[tuple[int, int], list[tuple[Any, Any]]] = {}  # (B, q) -> (backend, its graph metadata)
        self.compute_logits = compute_logits
        self.logits: torch.Tensor | None = None  # [max(B * q), vocab] fp32
        self.greedy_ids: torch.Tensor | None = None  # [max(B * q)] int64
        self.accepted: torch.Tensor | None = None  # [max(B * q) + 2 max B] int64: `GraphStep.accepted`'s buffer
        keys = sorted(((b, q) for q, bs in self.sizes.items() for b in bs), key=lambda k: k[0] * k[1])
        if compute_logits is not None and keys:
            device = buffers.input_ids.gpu.device
            rows = keys[-1][0] * keys[-1][1]
            self.logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
            self.greedy_ids = torch.zeros(rows, dtype=torch.int64, device=device)
            if num_drafts is not None and any(q > 1 for q in self.sizes):
                self.accepted = torch.zeros(rows + 2 * buffers.max_num_reqs, dtype=torch.int64, device=device)
        self.pool = pool = GraphPool.of(capture)
        keys = sorted(keys + [(1, q) for q in self.prefill], key=lambda k: k[0] * k[1])
        for b, q in reversed(keys):  # largest first: the smaller ones reuse its pool memory
            self._replay[b, q] = self._capture_one(model, backends, b, q, block_size, max_seq_len, pool)

    @torch.inference_mode()
    def _capture_one(self, model, backends, b, q, block_size, max_seq_len, pool: GraphPool):
        buf, t = self.buffers, b * q
        # b requests of q tokens at positions 0 .. q-1 of the null block 0, writing no KV.
        pad_step_inputs(buf, 0, 0, b, t)
        buf.query_start_loc.np[: b + 1] = range(0, t + 1, q)
        buf.positions.np[:t] = list(range(q)) * b
        buf.seq_lens.np[:b] = q
        buf.block_table.np[:b] = 0
        for x, rows in ((buf.input_ids, t), (buf.positions, t), (buf.slot_mapping, t), (buf.seq_lens, b),
                        (buf.num_computed, b), (buf.request_rows, b), (buf.block_table, b),
                        (buf.query_start_loc, b + 1)):
            x.copy_to_gpu(rows)
        common = graph_metadata(buf, b, block_size, max_seq_len, q)
        if self.tree_bits is not None and q > 1 and q not in self.prefill:
            common.tree_bits = self.tree_bits[:t]  # refreshed before each replay (token_tree.TreeSteps.prepare)
        metadata = {backend.name: backend.build_graph_metadata(common) for backend in backends}
        self._metadata[b, q] = [(backend, metadata[backend.name]) for backend in backends]
        input_ids, positions = buf.input_ids.gpu[:t], buf.positions.gpu[:t]

        logits_too = self.compute_logits is not None and q not in self.prefill
        accept = logits_too and q > 1 and self.accepted is not None

        def step() -> Outputs:
            out = model(input_ids, positions, metadata)
            if logits_too:
                logits = self.logits[:t]
                logits.copy_(self.compute_logits(out))  # out [t, hidden]; the buffer: every graph writes it
                torch.argmax(logits, dim=-1, out=self.greedy_ids[:t])
                if accept:
                    self._accept(b, q)
            return out

        replay = pool(step)
        self.addresses[b, q] = buffer_addresses(buf, common)
        if logits_too:
            self.addresses[b, q] |= {"logits": self.logits.data_ptr(), "greedy_ids": self.greedy_ids.data_ptr()}
        return replay

    def _accept(self, b: int, q: int) -> None:
        """`accept_greedily` over the graph's b requests of q tokens (the newest token, then q - 1 draft slots, the
        first num_drafts[row] of them real), packed as `GraphStep.accepted`. Padding requests (row -1) emit garbage
        that nothing reads."""
        if self.replay_accept is not None:  # acceptance replay: the profile's counts, as an eager step computes them
            self.replay_accept(self.buffers.request_rows.gpu, self.num_drafts, self.buffers.input_ids.gpu,
                               self.greedy_ids, self.logits, self.accepted, b, q)
            return
        t = b * q
        rows = self.buffers.request_rows.gpu[:b].long()
        real = self.num_drafts[rows.clamp(min=0)].long()
        drafts, greedy = self.buffers.input_ids.gpu[:t].view(b, q)[:, 1:], self.greedy_ids[:t].view(b, q)
        emitted, n_acc = accept_greedily(drafts, greedy, real)
        packed = self.accepted
        packed[:t].view(b, q).copy_(emitted)
        packed[t : t + b].copy_(n_acc + 1)
        packed[t + b : t + 2 * b].copy_(real)

    def key_for(self, num_reqs: int, max_query_len: int) -> tuple[int, int] | None:
        """The captured (batch size, query length) a step of num_reqs requests replays, or None when it
        runs eagerly.

        Query length 1 serves pure decode only (its launch plan is the decode one); a longer one
        serves any step whose queries are at most that long, and a prefill graph one request's."""
        need = max_query_len
        for q, sizes in self.sizes.items():
            if q == need or (need > 1 and q > need):
                i = bisect.bisect_left(sizes, num_reqs)
                if i < len(sizes):
                    return sizes[i], q
        i = bisect.bisect_left(self.prefill, need)
        return (1, self.prefill[i]) if num_reqs == 1 and i < len(self.prefill) else None

    def padded_size(self, common: CommonAttentionMetadata) -> tuple[int, int] | None:
        return self.key_for(common.num_reqs, common.max_query_len)

    def run(self, common: CommonAttentionMetadata) -> GraphStep:
        """Pad the step buffers (rows < num_reqs and tokens < num_tokens hold this step's inputs) and
        replay: token rows 0 .. num_tokens of the forward's outputs (and of logits, greedy_ids), views
        valid until the next replay."""
        key = self.padded_size(common)
        assert key is not None, "run() on a step the graphs do not cover"
        (b, q), n, t = key, common.num_reqs, common.num_tokens
        buf = self.buffers
        pad_step_inputs(buf, n, t, b, b * q)
        for x in (buf.input_ids, buf.positions, buf.slot_mapping):
            x.copy_to_gpu(b * q)
        for x in (buf.seq_lens, buf.request_rows):
            x.copy_to_gpu(b)
        buf.query_start_loc.copy_to_gpu(b + 1)
        return self.replay(key, common)

    @torch.inference_mode()  # as at capture: the graph metadata's tensors are inference tensors
    def replay(self, key: tuple[int, int], common: CommonAttentionMetadata) -> GraphStep:
        """Replay the graph of `key` for the step of record `common`, over step buffers already written and padded to
        its size (research_lm/worker/step_inputs.py's gather); each backend first refreshes its graph metadata
        (`AttentionBackend.prepare_replay`). Token rows 0 .. num_tokens of the outputs, valid until the next replay."""
        for backend, metadata in self._metadata[key]:
            backend.prepare_replay(metadata, common)
        t = common.num_tokens
        out = self._replay[key]()[:t]
        if self.logits is None or key[1] in self.prefill:
            return GraphStep(out, None, None)
        b, q = key
        accepted = self.accepted[: b * q + 2 * b] if self.accepted is not None and q > 1 else None
        return GraphStep(out, self.logits[:t], self.greedy_ids[:t], accepted)
