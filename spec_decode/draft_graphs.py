"""CUDA graphs for the drafting of the model-based proposers (EAGLE, EAGLE-3, draft model): a step drafts
with one replay and no copy to the host. The drafts stay on the device; the runner gathers them with
`drafts(rows)` into its device token table, which the next step's forward reads.

A drafting step is two parts, both captured in one graph per padded batch size B and pick rule:
1. The entry forward over the rows the target just verified, at most q = k + 1 per request (EAGLE: the
   positions c .. n-1, each reading x[t+1] and the target's feature at t; a draft model: its catch-up
   tokens valid .. n). The argmax at each request's last row is draft 1.
2. The chain: k - 1 single-token steps that depend only on each other. Feed draft j at position
   last + j, pick draft j + 1 (EAGLE also carries the head's own output as the next feature).
Each draft is picked as `spec_decode.heads.pick_tokens` would, by one of two rules (`Drafting.pick_rule`):
"argmax" when every drafting request is greedy, and "sample" when some sample with a temperature and
nothing else. "sample" keeps q = softmax(logits / T) (one-hot on greedy rows) in `probs` and draws from it
with the exponential race on the DRAFT stream at (seed, output position), so a draft depends on neither the
batch nor the path (graph or eager).

Persistent buffers, allocated once for the largest size A (a replay reads them where the capture did); R =
max(Aq, P), P the longest prompt graph (below):
    staging int64                  the largest 4Bq + 8B + 1 of the layouts (B, q): one host -> device copy per step;
                                   at the offsets of each layout (`_Layout`):
                                   entry token rows (ids, positions, request row or -1 on padding, feature
                                   row in the target step), then per request row query_start_loc, seq_len,
                                   last row, draft budget, its row in the target step's block table, and
                                   for "sample" its seed, the output position of draft 1 and greedy flag
    temperature [A] float32        "sample": a second copy (1 on greedy and padding rows)
    features [R, F]                EAGLE's target features of the entry rows (EAGLE-3: the three aux streams
                                   side by side; the head's fc runs inside the graph); none for a draft model
    block_table [A, blocks]        each request's row of the target step's block table (the KV is shared)
    entry record: query_start_loc [A+1], seq_lens [A], slot_mapping [R] (slots come from block_table
                                   inside the graph, -1 on padding)
    chain: positions, seq_lens, slot_mapping [k-1, A]
                                   row j - 1 for step j, all filled before the first step, and one record per
                                   step over its row. A row feeds (and writes KV) only below last position +
                                   budget: the scheduler allocated slots for the drafts the request asked for,
                                   no more. Step j reads draft j as its ids and (EAGLE) the previous step's
                                   output as its feature, in place: no copies between the steps' forwards
    verified 3 x [Aq] int64        "verified": the verify step's argmax, input ids and positions (request r at rows
                                   r*q ..): the target's own buffers when the runner hands them over (read in
                                   place), else copies
    num_reqs [1] int64             "verified": the step's requests, n (a device copy from `_counts`: nothing staged)
    table_rows [A] int64           "verified": each request's row in the token table, -1 on padding
    _drafts [k, A] int64           drafts 1 .. k of each request (chain step j reads row j - 1 in place), until
                                   the next replay; `drafts(rows)` gathers them
    probs [A, k, V] float32        "sample": q of each draft (A x k x V x 4 bytes: 82 MB for 32 x 5 x 128k)
Padding follows `research_lm.worker.cuda_graphs`: token rows past the step's get position 0 and slot -1, request
rows n .. B have query length 0. Chain rows past their limit (or padding) still compute, at position 0 and
writing no KV; their drafts are noise (a request keeps drafts 1 .. its budget).

A third rule, "verified", drafts before the host knows what the target emitted (`run_verified`): for an
all-greedy step where every request verified k draft slots (q = k + 1 rows each, request r at rows r*q ..), a
prologue inside the graph takes the verify forward's argmax g, input x and positions (in place, or copies:
`verified`), accepts while x[j + 1] == g[j] over the request's real drafts (n_acc, as the verification did), and
enters the tokens the request emits, g[0 .. n_acc], at positions c + s .. c + s + n_acc, s = `entry_shift` (EAGLE
0: its row at t reads x[t + 1]; a draft model 1: its row at t reads x[t]); rows past n_acc write no KV and feed
nothing. Draft 1 is picked at row r*q + n_acc. The graph reads the runner's token table (`tokens`, handed over at
capture; the runner has appended this step's tokens): each request's budget is `spec_decode.heads.draft_budget` of
its token count and stop_at there, and the graph writes its drafts right after its tokens and the budget into
num_drafts, so the runner writes nothing (`Drafts.in_table`). The host stages nothing: the step's size n is one
device copy. The graph reads no value of the host's that the device computed, so under async scheduling the host's
counts may be guesses.

Before the forwards, a replay computes the entry's and the chain's records (and, "verified", the acceptance):
on CUDA in one Triton kernel (spec_decode/draft_bookkeeping.py: ~40 small kernels fewer per replay), elsewhere
with the torch code in `_draft_fn`, which is the kernel's reference.

Used when a pick rule serves every drafting request (no penalties or min_tokens ban; with sampling no
top-k, top-p or min-p; logprobs do not matter, drafts never return them) and the batch fits the largest
size; otherwise the proposer drafts eagerly. One request's prompt (or chunk) of at most max(prefill_sizes)
rows replays a prompt graph of B = 1 and q = P, the smallest prefill size that holds it (the runner passes its
own: 16 .. 512): an eager entry over ~150 prompt rows cost the host ~4 ms at batch 1 on the H200's host, against
~0.1 ms of kernels. An entry longer than the graphs serve (a longer prompt, or a prompt chunk beside other
requests) is `split`: the proposer runs its first rows eagerly (they only write the drafter's KV) and the graph
the last ones.

A token tree's drafting step (`levels`, spec_decode/tree_graphs.py) replaces part 2 and the pick: its graphs, of
one rule "tree" and k = 1, run the same entry (the same staging, bookkeeping, prompt graphs and `split`), then
the tree's levels from each request's last entry row (its root: position, head output and next feature), and
return their outputs; a request's staged budget is its chain budget there (0: no tree, as on padding rows).

Not captured at all for a drafter with a layer that syncs with the host in forward
(`research_lm.worker.cuda_graphs.uncapturable_reason`; the runner checks only the target), and the entry is
captured with q = 1 only where an attention backend lacks `cuda_graphs_multi_token`. The attention launch
plans are fixed at capture with max_seq_len = max_model_len + num_lookahead_tokens, the longest any
draft row reaches.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

import research_lm.ops
from attention_zoo import CacheLayer, CommonAttentionMetadata
from research_lm.ops.reference import write_drafts_ref
from research_lm.worker import rng
from research_lm.worker.cuda_graphs import Capture, GraphPool
from research_lm.worker.sampler import apply_temperature, random_sample
from research_lm.worker.spec import TokenTable

# (ids [T], positions [T], metadata, features or carry [T, F] | None) -> (out for the logits [T, H], carry | None)
DraftForward = Callable[[torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor | None],
                        tuple[torch.Tensor, torch.Tensor | None]]


def graph_metadata(backends: dict[str, Any], qsl: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                   block_table: torch.Tensor, request_rows: torch.Tensor, num_tokens: int, max_query_len: int,
                   max_seq_len: int, block_size: int, tree_bits: torch.Tensor | None = None) -> dict[str, Any]:
    """Each backend's graph metadata (name -> its own, `build_graph_metadata`: the capture hook) over a graph's
    persistent buffers, built once at capture: a replay reads the buffers' values of then (query_start_loc [B + 1],
    seq_lens [B] int32, slot_mapping [T] int64, block table rows [B, blocks], request rows [B] int32, token-tree masks
    [T] int64 or None). (`build_metadata` here planned MLA's prefill / decode split on the host at capture, which a
    replay of other lengths then reused: MTP's second draft differed from the eager one, session 31.)"""
    num_reqs = len(seq_lens)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu(),
        num_computed_tokens_cpu=torch.zeros(num_reqs, dtype=torch.int32), block_table=block_table,
        slot_mapping=slots, request_rows=request_rows, num_reqs=num_reqs, num_tokens=num_tokens,
        max_query_len=max_query_len, max_seq_len=max_seq_len, block_size=block_size, tree_bits=tree_bits,
    )
    return {name: b.build_graph_metadata(common) for name, b in backends.items()}


@dataclass(frozen=True)
class _Layout:
    """Offsets into `staging` for B requests of at most q entry rows each."""

    b: int
    q: int

    @property
    def t(self) -> int:
        return self.b * self.q

    def token(self, i: int) -> slice:  # 0 ids, 1 positions, 2 request rows, 3 feature rows
        return slice(i * self.t, (i + 1) * self.t)

    def request(self, i: int) -> slice:
        """0 query_start_loc (B + 1), 1 seq_lens, 2 last rows, 3 budgets, 4 block-table rows, 5 seeds,
        6 output positions of draft 1, 7 greedy flags."""
        start = 4 * self.t + (i > 0) * (self.b + 1) + max(i - 1, 0) * self.b
        return slice(start, start + (self.b + 1 if i == 0 else self.b))

    @property
    def size(self) -> int:
        return 4 * self.t + 8 * self.b + 1


class Verified(NamedTuple):
    """What the "verified" rule's bookkeeping kernel reads besides the staging, and writes into the token table."""

    g: torch.Tensor  # [>= b*q] int64: the verify's argmax
    x: torch.Tensor  # [>= b*q] int64: its input ids
    num_reqs: torch.Tensor  # [1] int64: the step's requests, n
    rows: torch.Tensor  # [>= b] int32: each request's table row
    num_tokens: torch.Tensor  # [R] int32: this step's tokens included
    num_drafts: torch.Tensor  # [R] int32: read (the drafts verified), then written (the budgets)
    stop_at: torch.Tensor  # [R] int64
    table_rows: torch.Tensor  # [>= b] int64: written, each request's table row or -1 on padding
    max_model_len: int


@dataclass
class DraftSampling:
    """Per request row of a "sample" step: temperature, greedy flag, seed, output position of draft 1."""

    temperature: list[float]
    greedy: list[bool]
    seeds: list[int]
    positions: list[int]


class DraftGraphs:
    def __init__(
        self,
        *,
        entry: DraftForward,  # the entry forward: features [T, F] (or None) as the last argument
        step: DraftForward,  # one chained step: the carry [T, H] (or None) as the last argument
        logits: Callable[[torch.Tensor], torch.Tensor],  # out [n, H] -> [n, >= vocab] fp32
        argmax: Callable[..., torch.Tensor] | None,  # (out [n, H], out=[n] int64) -> the logits' argmax, cheaper
        layers: Sequence[CacheLayer],  # the drafter's attention layers (their backends build the metadata)
        num_speculative_tokens: int,
        vocab_size: int,
        sizes: Sequence[int],
        query_len: int,  # q: the longest entry a graph serves (k + 1, or 1 without multi-token attention)
        block_size: int,
        max_blocks_per_req: int,
        max_seq_len: int,
        features: tuple[int, torch.dtype] | None,  # (F, dtype) of the entry features, or None
        device: torch.device,
        capture: Capture | GraphPool,
        # The target's argmax, input-id and position buffers (1-D int64, the verify graphs' and the runner's), which
        # a "verified" graph then reads in place; None (or too short): it reads copies in its own buffers
        verified_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        # The runner's token table, its `rows` the persistent buffer of a step's request rows [>= max(sizes)]: the
        # "verified" graphs write the drafts there (None: no "verified" graphs)
        tokens: TokenTable | None = None,
        max_model_len: int = 0,  # "verified": what the budgets leave room for
        entry_shift: int = 0,  # "verified": entry row j of a request sits at position c + j + entry_shift
        # Entry lengths of one request's prompt graphs (B = 1, "argmax" and "sample"): a prompt of at most
        # max(prefill_sizes) rows replays the smallest that holds it, with no eager catch-up. Ignored without
        # multi-token attention (query_len 1).
        prefill_sizes: Sequence[int] = (),
        # A token tree's levels in place of the chain (module docstring; k must be 1): at capture levels(b,
        # block_table [b, blocks]) gives grow(root_out [b, H], root_carry [b, H], roots [b], budgets [b]) -> outputs
        levels: Callable[[int, torch.Tensor], Callable[..., Any]] | None = None,
    ):
        self.k, self.vocab_size, self.block_size = num_speculative_tokens, vocab_size, block_size
        self.query_len = query_len
        self.sizes = sorted(s for s in set(sizes) if s >= 1)
        self.prefill = sorted(p for p in set(prefill_sizes) if p > query_len) if query_len > 1 else []
        a, q = self.sizes[-1], query_len
        layouts = [_Layout(b, q) for b in self.sizes] + [_Layout(1, p) for p in self.prefill]
        staged, rows = max(lay.size for lay in layouts), max(lay.t for lay in layouts)
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.staging = torch.zeros(staged, **i64)
        pin = device.type == "cuda"  # the host side of the staging copy, without a sync
        # Two, alternating: under async scheduling a replay is staged before the previous one's copy has run.
        self._staging_host = [torch.zeros(staged, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._staged = [torch.cuda.Event() if pin else None for _ in range(2)]  # each buffer's copy has run
        self._next_staging = 0
        self.features = torch.zeros(rows, features[0], dtype=features[1], device=device) if features else None
        self.block_table = torch.zeros(a, max_blocks_per_req, **i32)
        self.entry_qsl, self.entry_seq_lens = torch.zeros(a + 1, **i32), torch.zeros(a, **i32)
        self.entry_slots = torch.full((rows,), -1, **i64)
        steps = max(self.k - 1, 1)  # chain step j = 1 .. k-1 reads row j - 1 of these
        self.positions = torch.zeros(steps, a, **i64)
        self.query_start_loc, self.seq_lens = torch.zeros(a + 1, **i32), torch.zeros(steps, a, **i32)
        self.slot_mapping = torch.full((steps, a), -1, **i64)
        self.request_rows = torch.full((a,), -1, **i32)  # stays -1: only state layers read it, drafters have none
        self._drafts = torch.zeros(self.k, a, **i64)  # draft j of request i at [j - 1, i]: step j reads row j - 1
        # Index tensors a graph reads live here: a capture keeps the graph, not the function, so a tensor made
        # in `_draft_fn` is freed (and its memory reused) once the capture returns.
        self.chain_steps = torch.arange(steps, **i64)[:, None]  # [k-1, 1]: 0 .. k-2
        self.entry_offsets = torch.arange(q, **i64)  # row j of each request's q entry rows ("verified")
        self.last_rows = torch.zeros(a, **i64)  # each request's last entry row (the bookkeeping kernel's output)
        self.temperature = torch.ones(a, dtype=torch.float32, device=device)
        self.temperature_host = torch.ones(a, dtype=torch.float32, pin_memory=pin)
        assert levels is None or (self.k == 1 and tokens is None), "a tree's graphs have no chain"
        self._levels = levels
        self.probs = torch.zeros(a, self.k, vocab_size if levels is None else 0, dtype=torch.float32, device=device)
        # "verified" needs q = k + 1 rows per request, and the token table to write the drafts into.
        self.drafts_verified = query_len == num_speculative_tokens + 1 and tokens is not None
        fits = verified_inputs is not None and min(len(v) for v in verified_inputs) >= a * q
        self.verified_in_place = fits
        self.verified = tuple(verified_inputs) if fits else tuple(torch.zeros(3, a * q, **i64).unbind(0))
        self.table, self.max_model_len, self.entry_shift = tokens, max_model_len, entry_shift
        assert tokens is None or len(tokens.rows) >= a, "the request-rows buffer must hold the largest batch"
        self.num_reqs = torch.zeros(1, **i64)
        self._counts = torch.arange(a + 1, **i64)  # n's device copy comes from here
        self.table_rows = torch.full((a,), -1, **i64)
        self.entry_positions = torch.zeros(a * q, **i64)  # "verified" with a shift: the verify's positions + shift
        self._replay: dict[tuple[_Layout, str], Callable[[], Any]] = {}  # (layout, rule) -> replay
        self._entry, self._step, self._logits, self._argmax = entry, step, logits, argmax
        self._backends = {layer.backend.name: layer.backend for layer in layers}
        self._max_seq_len = max_seq_len
        self.pool = pool = GraphPool.of(capture)  # the runner's, where it hands its pool over
        rules = ("argmax", "sample", "verified") if self.drafts_verified else ("argmax", "sample")
        if levels is not None:
            rules = ("tree",)
        for lay in sorted(layouts, key=lambda lay: -lay.t):  # largest first: the smaller ones reuse its pool memory
            for rule in rules if lay.q == q else rules[:2]:
                self._fill_for_capture(lay)
                self._replay[lay, rule] = pool(self._draft_fn(lay, rule))

    def _record(self, qsl, seq_lens, slots, num_reqs: int, num_tokens: int, max_query_len: int) -> dict[str, Any]:
        return graph_metadata(self._backends, qsl, seq_lens, slots, self.block_table[:num_reqs],
                              self.request_rows[:num_reqs], num_tokens, max_query_len, self._max_seq_len,
                              self.block_size)

    def _fill_for_capture(self, lay: _Layout) -> None:
        """B greedy requests of q rows at positions 0 .. q-1, writing no KV (request row -1), budget 0."""
        host = torch.zeros(lay.size, dtype=torch.int64)
        host[lay.token(1)] = torch.arange(lay.q).repeat(lay.b)
        host[lay.token(2)] = -1
        host[lay.request(0)] = torch.arange(0, lay.t + 1, lay.q)
        host[lay.request(1)] = lay.q
        host[lay.request(2)] = torch.arange(lay.q - 1, lay.t, lay.q)
        host[lay.request(7)] = 1
        self.staging[: lay.size].copy_(host)
        self.temperature.fill_(1.0)
        self.entry_qsl[: lay.b + 1].copy_(host[lay.request(0)])
        self.entry_seq_lens[: lay.b].copy_(host[lay.request(1)])
        self.query_start_loc[: lay.b + 1].copy_(torch.arange(lay.b + 1))
        self.seq_lens[:, : lay.b].fill_(1)
        self.num_reqs.zero_()  # "verified": all padding, so a warm-up run writes nothing into the token table
        if not self.verified_in_place:  # "verified": padding rows keep reading token 0
            for v in self.verified:
                v.zero_()

    def _draft_fn(self, lay: _Layout, rule: str) -> Callable[[], Any]:
        b, t, bs, vocab = lay.b, lay.t, self.block_size, self.vocab_size
        st = self.staging
        ids_in, pos_in, req_in = st[lay.token(0)], st[lay.token(1)], st[lay.token(2)]
        qsl_in, seq_lens_in, last, budget = (st[lay.request(i)] for i in range(4))
        seeds, out_pos, greedy_in = (st[lay.request(i)] for i in (5, 6, 7))
        sampled = rule == "sample"
        offset = self.entry_offsets
        # "verified": the argmax g, input x and positions per request
        verified = tuple(v[:t].view(b, lay.q) for v in self.verified) if rule == "verified" else None
        pos = pos_in  # the entry rows' positions
        if verified is not None:
            pos = self.entry_positions[:t] if self.entry_shift else verified[2].reshape(t)
        temperature, probs = self.temperature[:b], self.probs[:b]
        entry_qsl, entry_seq_lens, entry_slots = self.entry_qsl[: b + 1], self.entry_seq_lens[:b], self.entry_slots[:t]
        features = None if self.features is None else self.features[:t]
        entry_md = self._record(entry_qsl, entry_seq_lens, entry_slots, b, t, lay.q)
        # The chain's positions, seq lens and slots of every step are computed before its first step, and
        # each step has its own metadata over its row: no bookkeeping kernels between the steps' forwards.
        qsl, seq_lens, slots, positions = self.query_start_loc[: b + 1], self.seq_lens[:, :b], \
            self.slot_mapping[:, :b], self.positions[:, :b]
        chain_md = [self._record(qsl, seq_lens[j], slots[j], b, b, 1) for j in range(self.k - 1)]
        drafts = self._drafts[:, :b]
        block_table, last_block = self.block_table[:b], self.block_table.shape[1] - 1

        def slot_of(rows: torch.Tensor, pos: torch.Tensor, writes: torch.Tensor) -> torch.Tensor:
            block = block_table[rows, (pos // bs).clamp(max=last_block)]
            return torch.where(writes, block.long() * bs + pos % bs, -1)

        def pick(out: torch.Tensor, j: int) -> None:  # out [b, H] -> drafts[j] (and probs[:, j])
            if not sampled:
                if self._argmax is not None:
                    self._argmax(out, out=drafts[j])
                else:
                    torch.argmax(self._logits(out)[:, :vocab], dim=-1, out=drafts[j])
                return
            x = apply_temperature(self._logits(out)[:, :vocab].float(), temperature)  # as `pick_tokens`: T 1 if greedy
            one_hot = torch.zeros_like(x).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
            q = torch.where((greedy_in != 0)[:, None], one_hot, x.softmax(dim=-1))
            probs[:, j].copy_(q)
            drafts[j].copy_(random_sample(q, seeds, out_pos + j, rng.DRAFT))  # one-hot rows race to their argmax

        def verified_records() -> tuple[torch.Tensor, ...]:
            """"verified": (real, query starts, token rows' requests, KV writes, last rows, budgets) of the step's
            n requests, from the verify's tokens and the token table; the budgets go into num_drafts."""
            g, x, _ = verified
            tab, r, n = self.table, torch.arange(b, device=st.device), self.num_reqs
            real = r < n  # [b]
            row = torch.where(real, tab.rows[:b].long(), 0)  # each request's table row (0 on padding)
            num_real = tab.num_drafts[row]  # the real drafts the verify step verified
            ok = (x[:, 1:] == g[:, :-1]) & (self.entry_offsets[: self.k] < num_real[:, None])
            n_acc = torch.where(real, ok.long().cumprod(dim=1).sum(dim=1), 0)  # [b] drafts accepted
            filled = tab.num_tokens[row].long()  # this step's tokens included
            budgets = torch.where(filled >= tab.stop_at[row], 0, (self.max_model_len - filled - 1).clamp(0, self.k))
            # Padding rows add 0 to row 0's count: no race with a real row 0, and no sync.
            tab.num_drafts.index_put_((row,), torch.where(real, budgets - num_real, 0).int(), accumulate=True)
            self.table_rows[:b].copy_(torch.where(real, row, -1))
            qsl = torch.minimum(torch.arange(b + 1, device=st.device), n) * lay.q
            i = torch.arange(t, device=st.device)
            req = torch.where(i < n * lay.q, i // lay.q, -1)
            writes = (req >= 0) & (offset <= n_acc[:, None]).view(t)
            return real, qsl, req, writes, lay.q * r + n_acc, budgets

        def bookkeeping() -> torch.Tensor:  # [b] each request's last entry row
            """The entry's and the chain's records (spec_decode/draft_bookkeeping.py has the rule, and the kernel)."""
            if rule == "verified":
                real, qsl_entry, req, writes, last_row, budgets = verified_records()
                entry_seq_lens.copy_(torch.where(real, pos[lay.q - 1 :: lay.q] + 1, 0))
            else:
                real = qsl_in[1:] > qsl_in[:-1]  # [b] bool: padding rows have no entry rows
                qsl_entry, req, writes, last_row, budgets = qsl_in, req_in, req_in >= 0, last, budget
                entry_seq_lens.copy_(seq_lens_in)
            entry_qsl.copy_(qsl_entry)
            entry_slots.copy_(slot_of(req.clamp(min=0), pos, writes))
            if self.k > 1:
                qsl[1:].copy_(torch.cumsum(real, 0))
                # Step j feeds draft j at position last + j; a row feeds (and writes KV) only below last + budget.
                chain_pos = pos[last_row] + 1 + self.chain_steps  # [k-1, b]
                feeds = real & (chain_pos < pos[last_row] + budgets)
                seq_lens.copy_(torch.where(real, chain_pos + 1, 0))
                slots.copy_(slot_of(torch.arange(b, device=pos.device).expand_as(chain_pos), chain_pos, feeds))
                positions.copy_(torch.where(feeds, chain_pos, 0))
            return last_row

        def fused_bookkeeping() -> torch.Tensor:
            from spec_decode.draft_bookkeeping import draft_bookkeeping  # Triton, imported when a kernel runs

            tab = self.table
            tables = None if rule != "verified" else Verified(
                self.verified[0][:t], self.verified[1][:t], self.num_reqs, tab.rows, tab.num_tokens, tab.num_drafts,
                tab.stop_at, self.table_rows, self.max_model_len)
            draft_bookkeeping(
                st[: lay.size], offsets, pos, tables, block_table, entry_qsl, entry_seq_lens, entry_slots, last_rows,
                qsl, positions, seq_lens, slots, b=b, q=lay.q, k=self.k, block_size=bs)
            return last_rows

        offsets = {"req": lay.token(2).start, "qsl": lay.request(0).start, "seq": lay.request(1).start,
                   "last": lay.request(2).start, "budget": lay.request(3).start}
        last_rows = self.last_rows[:b]
        fused = st.device.type in research_lm.ops.FUSED_DEVICE_TYPES
        records = fused_bookkeeping if fused else bookkeeping
        entry_ids = verified[0].reshape(t) if rule == "verified" else ids_in  # "verified": the emitted tokens
        if fused:
            from research_lm.ops.step_inputs import write_drafts  # Triton, imported when a kernel runs
        else:
            write_drafts = write_drafts_ref
        grow = self._levels(b, block_table) if rule == "tree" else None

        @torch.inference_mode()
        def draft() -> Any:
            if rule == "verified" and self.entry_shift:
                torch.add(verified[2].reshape(t), self.entry_shift, out=pos)
            last_row = records()
            out, carry = self._entry(entry_ids, pos, entry_md, features)
            if grow is not None:  # a token tree: its levels from each request's last entry row
                return grow(out[last_row], carry[last_row], pos[last_row], budget)
            pick(out[last_row], 0)
            if carry is not None and self.k > 1:
                carry = carry[last_row]
            for j in range(1, self.k):
                out, carry = self._step(drafts[j - 1], positions[j - 1], chain_md[j - 1], carry)
                pick(out, j)
            if rule == "verified":  # drafts 1 .. k right after each request's tokens (the budget counts the real ones)
                write_drafts(self.table.token_ids, self.table.num_tokens, self.table_rows[:b], drafts.t().contiguous())

        return draft

    def padded_size(self, num_reqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def entry_limit(self, num_reqs: int) -> int:
        """The most entry rows a request of a step with num_reqs entry requests can have in a graph."""
        return self.prefill[-1] if num_reqs == 1 and self.prefill else self.query_len

    def _layout(self, num_reqs: int, longest: int) -> _Layout:
        if longest <= self.query_len:
            return _Layout(self.padded_size(num_reqs), self.query_len)
        return _Layout(1, self.prefill[bisect.bisect_left(self.prefill, longest)])

    def serves(self, num_reqs: int) -> bool:
        """Does a graph fit a step with this many entry requests (after `split` of the long entries)?"""
        return self.padded_size(num_reqs) is not None

    def split(self, lens: Sequence[int], *rows: Sequence[int]) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """Entries longer than the graphs' L = `entry_limit` rows (a prompt past the prefill graphs, or a prompt
        chunk beside other requests) do not fit: their first n - L rows only write the drafter's KV, so the
        proposer runs them eagerly first and the graph the last L. rows: flat per-row lists (request by request,
        `lens` rows each). Returns (rows cut from each request, n - L or 0; each list's cut rows; each list's
        rows left for the graph: the last min(n, L) per request)."""
        limit = self.entry_limit(len(lens))
        cut = [max(0, n - limit) for n in lens]
        ends = np.cumsum(lens, dtype=np.int64).tolist()
        spans = list(zip(ends, lens, cut, strict=True))
        early = [[x for e, n, c in spans for x in flat[e - n : e - n + c]] for flat in rows]
        kept = [[x for e, n, c in spans for x in flat[e - n + c : e]] for flat in rows]
        return cut, early, kept

    def enter(self, block_table: torch.Tensor, rows: Sequence[int], starts: Sequence[int], lens: Sequence[int],
              tokens: Sequence[int], budgets: Sequence[int], catch_up: Callable[..., Any], *,
              features: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
              feature_rows: Sequence[int] | None = None, sampling: DraftSampling | None = None) -> Any:
        """`run` over any entries: those longer than the graphs serve first write the drafter's KV for all but their
        last rows through `catch_up` (rows, starts, lens, tokens[, feature_rows]: an eager entry forward; `split`)."""
        cut, early, kept = self.split(lens, *([tokens] if feature_rows is None else [tokens, feature_rows]))
        if any(cut):
            long = [i for i, c in enumerate(cut) if c]
            catch_up([rows[i] for i in long], [starts[i] for i in long], [cut[i] for i in long], *early)
            starts = [s + c for s, c in zip(starts, cut, strict=True)]
            lens = [n - c for n, c in zip(lens, cut, strict=True)]
        return self.run(block_table, rows, kept[0], starts, lens, budgets, features=features,
                        feature_rows=None if feature_rows is None else kept[1], sampling=sampling)

    @torch.inference_mode()
    def run(
        self,
        block_table: torch.Tensor,  # [step's requests, >= blocks] the target step's block table
        rows: Sequence[int],  # [n] each request's row in it
        tokens: Sequence[int],  # [T] the entry rows' tokens, request after request (ignored when `verified`)
        starts: Sequence[int],  # [n] position of each request's first entry row
        lens: Sequence[int],  # [n] its entry rows (1 .. q)
        budgets: Sequence[int],  # [n] drafts it wants (0: none; its entry rows still write the drafter's KV)
        # (feature rows [T] on the device, out [T, F]) -> out: writes the entry rows' target features in place
        features: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        feature_rows: Sequence[int] | None = None,  # [T] each entry row's row in the target step
        sampling: DraftSampling | None = None,  # per request: the "sample" rule; None: "argmax" (or "tree")
    ) -> Any:  # "sample": q [n, k, V]; "tree": the levels' outputs (the graph's: until the next replay)
        """Replay the step's graph. Request r's drafts 1 .. budget stay on the device until the next replay
        (`drafts` hands them out)."""
        n, num_tokens = len(lens), sum(lens)
        assert self.serves(n) and max(lens) <= self.entry_limit(n) and (features is None) == (self.features is None)
        lay = self._layout(n, max(lens))
        size = lay.b
        lens_np = np.asarray(lens, dtype=np.int64)
        ends = np.cumsum(lens_np)
        i = self._next_staging
        self._next_staging ^= 1
        staging_host, staged_event = self._staging_host[i], self._staged[i]
        if staged_event is not None:  # the replay before last copied from this buffer: long done, as a rule
            staged_event.synchronize()
        host = staging_host[: lay.size].numpy()
        host[:] = 0
        token, request = (lambda i: host[lay.token(i)]), (lambda i: host[lay.request(i)])
        token(0)[:num_tokens] = tokens
        req_of_token = np.repeat(np.arange(n), lens_np)
        offset = np.asarray(starts) - (ends - lens_np)  # position - token index, per request
        token(1)[:num_tokens] = np.arange(num_tokens) + offset[req_of_token]
        token(2)[:] = -1
        token(2)[:num_tokens] = req_of_token
        if feature_rows is not None:
            token(3)[:num_tokens] = feature_rows
        request(0)[1 : n + 1] = ends
        request(0)[n + 1 :] = num_tokens
        request(1)[:n] = np.asarray(starts) + lens_np
        request(2)[:n] = ends - 1
        request(3)[:n] = budgets
        request(4)[:n] = rows
        request(7)[:] = 1  # padding rows are greedy
        if sampling is not None:
            request(5)[:n] = [rng.int64_bits(s) for s in sampling.seeds]
            request(6)[:n] = sampling.positions
            request(7)[:n] = sampling.greedy
            temperature = self.temperature_host[:size]
            temperature.fill_(1.0)
            temperature[:n] = torch.tensor(sampling.temperature, dtype=torch.float32)
            self.temperature[:size].copy_(temperature, non_blocking=True)
        staged = self.staging[: lay.size]
        staged.copy_(staging_host[: lay.size], non_blocking=True)
        if staged_event is not None:
            staged_event.record()
        cols = min(block_table.shape[1], self.block_table.shape[1])
        if list(rows) == list(range(n)):  # the step's first n rows, in order: no gather
            self.block_table[:n, :cols].copy_(block_table[:n, :cols])
        else:
            self.block_table[:n, :cols].copy_(block_table[:, :cols].index_select(0, staged[lay.request(4)][:n]))
        if features is not None:
            features(staged[lay.token(3)][:num_tokens], self.features[:num_tokens])
        if self._levels is not None:
            return self._replay[lay, "tree"]()
        self._replay[lay, "sample" if sampling is not None else "argmax"]()
        return None if sampling is None else self.probs[:n].clone()  # the next replay overwrites the buffer

    @torch.inference_mode()
    def run_verified(
        self,
        block_table: torch.Tensor,  # [n, <= blocks] the verify step's block table
        verified: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # its argmax, input ids and positions [n * q]
        features: Callable[[torch.Tensor], Any] | None = None,  # out [n * q, F] -> writes the rows' features there
    ) -> None:
        """Replay the "verified" graph of a step of n = len(block_table) requests, each verifying k draft slots
        (module docstring): it writes each request's drafts and their count into the token table. Per step the host
        issues only copies: n, the block table, the features and (unless read in place) the verify's outputs."""
        n = len(block_table)
        t, cols = n * self.query_len, block_table.shape[1]
        self.num_reqs.copy_(self._counts[n : n + 1])
        (self.block_table[:n] if cols == self.block_table.shape[1] else self.block_table[:n, :cols]).copy_(block_table)
        if features is not None:
            features(self.features[:t])
        for dst, src in zip(self.verified, verified, strict=True):
            if src.data_ptr() != dst.data_ptr():  # the graph reads dst: the target's own buffer, or a copy
                dst[:t].copy_(src[:t])
        self._replay[_Layout(self.padded_size(n), self.query_len), "verified"]()

    def drafts(self, rows: Sequence[int]) -> torch.Tensor:  # [len(rows), k] int64 on the device
        """The last replay's drafts of the requests at these graph rows: row i holds drafts 1 .. k of graph row rows[i]
        (those past its budget are noise). A gather into a new tensor, so the next replay leaves it alone; enqueued
        on the current stream behind the replay, with no host sync."""
        rows = list(rows)
        if not rows:
            return self._drafts.new_empty(0, self.k)
        first, a = rows[0], self._drafts.shape[1]
        assert 0 <= min(rows) and max(rows) < a, f"graph rows {rows} outside 0 .. {a - 1}"
        if rows == list(range(first, first + len(rows))):  # a run of rows (the "verified" rule's): no index to copy
            return self._drafts[:, first : first + len(rows)].t().contiguous()
        # Pinned, so the copy does not wait for the stream (a pageable one would); the host allocator keeps the
        # pinned block until the copy has run.
        index = torch.tensor(rows, dtype=torch.int64, pin_memory=self._drafts.is_cuda)
        return self._drafts.t().index_select(0, index.to(self._drafts.device, non_blocking=True))

    def drafts_view(self, n: int) -> torch.Tensor:  # [n, k] int64 on the device
        """Graph rows 0 .. n-1's drafts as a view (no copy): valid until the next replay."""
        return self._drafts[:, :n].t()
