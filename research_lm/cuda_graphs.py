"""CUDA graphs for pure-decode steps: one graph per padded batch size, replayed over the step buffers.

A decode step of n requests runs the graph captured for the smallest size B >= n; prefill, mixed and
verification steps, and batches larger than the largest size, run eagerly. A graph holds the model
forward and, given `compute_logits`, the logits of every row and their argmax:

    hidden = model(input_ids[:B], positions[:B])        # [B, hidden]
    logits[:B] = compute_logits(hidden)                 # [B, vocab] fp32, a persistent buffer
    greedy_ids[:B] = logits[:B].argmax(-1)              # [B] int64, a persistent buffer

In a pure-decode step each request samples exactly its one row (logits_indices = arange(n)), so the
runner hands logits[:n] to the sampler, or, when the sampler would return argmax(raw logits) anyway
(`SamplingBatch.argmax_only`: all greedy, no penalty, min_tokens ban or logprobs), takes greedy_ids[:n]
directly: such a step is one replay and one device -> host copy of n token ids.

Memory: the two buffers are sized by the largest captured size, max(sizes) x vocab x 4 bytes of
logits (256 MB for 512 x 128k) plus max(sizes) x 8 bytes of ids; the capture pool also keeps the
largest size's transient lm_head output (for a bf16 model another 1.5x the logits buffer), since
pool memory is not handed back while the graphs live. Smaller `cuda_graph_sizes` shrink both.

NOTE: a graph replays the device addresses it saw at capture: the weights, the KV cache, and the
runner's persistent step buffers. Every input of the forward is a prefix view (rows 0 .. B) of a
buffer allocated once (`StepBuffers`), so the record a step builds points where the capture's did;
`buffer_addresses` lists those addresses and the tests compare them step after step. The launch plan
(tile shape, split-KV count) is fixed at capture from host integers: B and max_model_len.

Padded rows n .. B have query length 0 (query_start_loc repeats its last value), seq_len 0, slot -1
(no KV write), request row -1, and token 0 at position 0: attention skips them, and every other op
of the forward, the lm_head and the argmax are row-wise, so nothing computed for them reaches a real row.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attention_zoo import CommonAttentionMetadata
from research_lm.buffers import StepBuffers

Outputs = Any  # the model's forward result: a tensor, or (tensor, [tensors]) with aux hidden states
# fn -> replay: runs fn once to warm up, records it, and returns a callable that re-runs the recording.
Capture = Callable[[Callable[[], Outputs], Any], Callable[[], Outputs]]


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 (vLLM's default), up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    return sorted({*sizes, max_num_seqs})


def unsupported_reason(model: torch.nn.Module, backends: Sequence[Any], device: torch.device) -> str | None:
    """Why decode graphs cannot serve this model with these attention backends on this device (None: they can).

    Backends declare support in their capabilities; a module class that syncs with the host in forward
    declares `cuda_graphs = False` (MoE routing does)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    eager = sorted(b.name for b in backends if not b.capabilities.cuda_graphs)
    if eager:
        return f"attention backend(s) {eager} do not support CUDA graphs"
    layers = sorted({type(m).__name__ for m in model.modules() if getattr(type(m), "cuda_graphs", True) is False})
    if layers:
        return f"layers {layers} do not support CUDA graphs"
    return None


def pad_decode_inputs(buf: StepBuffers, num_reqs: int, padded: int) -> None:
    """Write padding rows num_reqs .. padded into the host side of the step buffers (numpy, no copies).

    Rows < num_reqs (one token per request, written by the runner) are left as they are.
    """
    n, b = num_reqs, padded
    buf.input_ids.np[n:b] = 0
    buf.positions.np[n:b] = 0
    buf.slot_mapping.np[n:b] = -1
    buf.query_start_loc.np[n + 1 : b + 1] = buf.query_start_loc.np[n]
    buf.seq_lens.np[n:b] = 0
    buf.num_computed.np[n:b] = 0
    buf.request_rows.np[n:b] = -1


def decode_metadata(buf: StepBuffers, padded: int, block_size: int, max_seq_len: int) -> CommonAttentionMetadata:
    """The record of a padded decode batch: views over the device buffers, made once at capture.

    max_seq_len is the largest the graph must serve (max_model_len), so the launch plan it fixes fits
    every step it replays for."""
    b = padded
    return CommonAttentionMetadata(
        query_start_loc=buf.query_start_loc.gpu[: b + 1],
        query_start_loc_cpu=buf.query_start_loc.cpu[: b + 1],
        seq_lens=buf.seq_lens.gpu[:b],
        seq_lens_cpu=buf.seq_lens.cpu[:b],
        num_computed_tokens_cpu=buf.num_computed.cpu[:b],
        block_table=buf.block_table.gpu[:b],
        slot_mapping=buf.slot_mapping.gpu[:b],
        request_rows=buf.request_rows.gpu[:b],
        num_reqs=b,
        num_tokens=b,
        max_query_len=1,
        max_seq_len=max_seq_len,
        block_size=block_size,
    )


def buffer_addresses(buf: StepBuffers, common: CommonAttentionMetadata | None = None) -> dict[str, int]:
    """data_ptr of every device tensor a decode forward reads, from `common` or else the buffers."""
    if common is None:
        common = decode_metadata(buf, 1, 1, 1)
    return {
        "input_ids": buf.input_ids.gpu.data_ptr(),
        "positions": buf.positions.gpu.data_ptr(),
        "query_start_loc": common.query_start_loc.data_ptr(),
        "seq_lens": common.seq_lens.data_ptr(),
        "block_table": common.block_table.data_ptr(),
        "slot_mapping": common.slot_mapping.data_ptr(),
        "request_rows": common.request_rows.data_ptr(),
    }


def cuda_graph_capture(fn: Callable[[], Outputs], pool: Any) -> Callable[[], Outputs]:
    """Warm fn up (compiles kernels, fills plan caches), capture it into a graph; replay returns its
    static outputs, overwritten by each replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> Outputs:
        graph.replay()
        return out

    return replay


def eager_capture(fn: Callable[[], Outputs], pool: Any) -> Callable[[], Outputs]:
    """A stand-in for `cuda_graph_capture` that re-runs fn: tests the padding and buffer plumbing on CPU."""
    return fn


@dataclass
class GraphStep:
    """What a replay leaves for the runner: views of rows 0 .. num_reqs, valid until the next replay."""

    out: Outputs  # the forward's result: hidden [num_reqs, hidden] (and aux hidden states)
    logits: torch.Tensor | None  # [num_reqs, vocab] fp32, one row per request; None: not captured
    greedy_ids: torch.Tensor | None  # [num_reqs] int64, logits.argmax(-1); None: not captured


def _head(out: Outputs, n: int) -> Outputs:
    if isinstance(out, torch.Tensor):
        return out[:n]
    return type(out)(_head(x, n) for x in out)


class DecodeGraphs:
    """Captured decode steps keyed by padded batch size; `covers` says whether a step can replay one.

    compute_logits ([n, hidden] -> [n, vocab] fp32) and vocab_size, both or neither: with them the
    graphs also fill `logits` and `greedy_ids`; without, they hold the forward only."""

    def __init__(
        self,
        model: torch.nn.Module,
        buffers: StepBuffers,
        backends: Sequence[Any],
        *,
        sizes: Sequence[int],
        block_size: int,
        max_seq_len: int,
        compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
        vocab_size: int | None = None,
        capture: Capture = cuda_graph_capture,
    ):
        assert (compute_logits is None) == (vocab_size is None), "compute_logits needs vocab_size"
        self.buffers = buffers
        # A decode batch has at most max_num_seqs requests and max_num_batched_tokens tokens.
        largest = min(buffers.max_num_reqs, buffers.max_num_tokens)
        self.sizes = sorted(s for s in set(sizes) if 1 <= s <= largest)
        self.addresses: dict[int, dict[str, int]] = {}
        self._replay: dict[int, Callable[[], Outputs]] = {}
        self.compute_logits = compute_logits
        self.logits: torch.Tensor | None = None  # [max(sizes), vocab] fp32
        self.greedy_ids: torch.Tensor | None = None  # [max(sizes)] int64
        if compute_logits is not None and self.sizes:
            device = buffers.input_ids.gpu.device
            self.logits = torch.empty(self.sizes[-1], vocab_size, dtype=torch.float32, device=device)
            self.greedy_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        pool = torch.cuda.graph_pool_handle() if capture is cuda_graph_capture else None
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            self._replay[b] = self._capture_one(model, backends, b, block_size, max_seq_len, capture, pool)

    @torch.inference_mode()
    def _capture_one(self, model, backends, b, block_size, max_seq_len, capture, pool):
        buf = self.buffers
        # b requests, each one token at position 0 of the null block 0, writing no KV.
        pad_decode_inputs(buf, 0, b)
        buf.query_start_loc.np[: b + 1] = range(b + 1)
        buf.seq_lens.np[:b] = 1
        buf.block_table.np[:b] = 0
        for x in (buf.input_ids, buf.positions, buf.slot_mapping, buf.seq_lens, buf.num_computed,
                  buf.request_rows, buf.block_table):
            x.copy_to_gpu(b)
        buf.query_start_loc.copy_to_gpu(b + 1)
        common = decode_metadata(buf, b, block_size, max_seq_len)
        metadata = {backend.name: backend.build_metadata(common) for backend in backends}
        input_ids, positions = buf.input_ids.gpu[:b], buf.positions.gpu[:b]

        def step() -> Outputs:
            out = model(input_ids, positions, metadata)
            if self.compute_logits is not None:
                hidden = out[0] if isinstance(out, tuple) else out  # [b, hidden]
                logits = self.logits[:b]
                logits.copy_(self.compute_logits(hidden))  # the buffer: every size's graph writes it
                torch.argmax(logits, dim=-1, out=self.greedy_ids[:b])
            return out

        replay = capture(step, pool)
        self.addresses[b] = buffer_addresses(buf, common)
        if self.logits is not None:
            self.addresses[b] |= {"logits": self.logits.data_ptr(), "greedy_ids": self.greedy_ids.data_ptr()}
        return replay

    def padded_size(self, common: CommonAttentionMetadata) -> int | None:
        """The captured size this step replays, or None when it runs eagerly."""
        if not common.is_pure_decode or common.num_tokens != common.num_reqs:
            return None
        i = bisect.bisect_left(self.sizes, common.num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def covers(self, common: CommonAttentionMetadata) -> bool:
        return self.padded_size(common) is not None

    def run(self, common: CommonAttentionMetadata) -> GraphStep:
        """Pad the step buffers (rows < num_reqs hold this step's inputs) and replay: rows 0 .. num_reqs of
        the forward's outputs (and of logits, greedy_ids), views valid until the next replay."""
        b, n = self.padded_size(common), common.num_reqs
        assert b is not None, "run() on a step the graphs do not cover"
        buf = self.buffers
        pad_decode_inputs(buf, n, b)
        for x in (buf.input_ids, buf.positions, buf.slot_mapping, buf.seq_lens):
            x.copy_to_gpu(b)
        buf.query_start_loc.copy_to_gpu(b + 1)
        out = _head(self._replay[b](), n)
        if self.logits is None:
            return GraphStep(out, None, None)
        return GraphStep(out, self.logits[:n], self.greedy_ids[:n])
