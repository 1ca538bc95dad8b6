"""What the model-based proposers share: reading published head checkpoints, draft batches over the
target's block tables, and picking draft tokens (greedy, or sampled with their q).

Checkpoints are data: `config.json` is read as JSON, weights through `research_lm.models.loader`
(safetensors, or pickles through `torch.load(..., weights_only=True)` only). Every problem raises
`CheckpointError` with a sentence naming the file, tensor or size that is wrong.

Draft batches. A drafter with its own paged KV (draft model, EAGLE head) writes at the same slots
as the target: request i of a draft batch is row `batch_rows[i]` of the step's block table, and its
tokens sit at positions `starts[i] .. starts[i] + lens[i] - 1`. The scheduler allocated those
slots (`num_lookahead_tokens` past the verified tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from attention_zoo import CacheLayer, CommonAttentionMetadata
from research_lm.engine.request import Request
from research_lm.models.base import CheckpointError
from research_lm.models.loader import checkpoint_files, iter_checkpoint, resolve_model_path
from research_lm.worker import rng
from research_lm.worker.sampler import (
    SamplingBatch,
    SamplingRow,
    plain_greedy,
    probs_from_processed,
    process_logits,
    random_sample,
)
from research_lm.worker.spec import Drafts, StepOutcome
from spec_decode.draft_graphs import DraftGraphs, DraftSampling

# ---------------------------------------------------------------------------------------------------
# Checkpoint reading


def head_dir(speculative_config: dict[str, Any], method: str) -> Path:
    """The directory `speculative_config["model"]` names (an existing path or a built-in name)."""
    name = speculative_config.get("model")
    if not name:
        raise ValueError(f"speculative_config for {method!r} needs 'model': the directory of the {method} checkpoint")
    path = resolve_model_path(name)
    if not path.is_dir():
        raise CheckpointError(f"{method} checkpoint {path} is not a directory")
    return path


def read_tensors(files: Sequence[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files (heads are small), on CPU. Pickles: weights-only."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in iter_checkpoint(list(files)):
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"{files[0].parent}: entry {name!r} is a {type(tensor).__name__}, not a tensor: "
                "expected a flat name -> tensor state dict"
            )
        out[name] = tensor
    return out


def read_head_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A head directory's weights: safetensors (single or indexed), else pytorch_model*.bin."""
    return read_tensors(checkpoint_files(path))


def llama_like_config(cfg: dict[str, Any], where: Path) -> SimpleNamespace:
    """The attributes our Llama layers read, from a head's raw config.json, with transformers' defaults."""
    required = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise CheckpointError(f"{where / 'config.json'} lacks {missing}")
    ns = SimpleNamespace(**cfg)
    ns.num_key_value_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    ns.head_dim = cfg.get("head_dim")
    ns.num_hidden_layers = cfg.get("num_hidden_layers", 1)
    ns.rms_norm_eps = cfg.get("rms_norm_eps", 1e-6)
    ns.hidden_act = cfg.get("hidden_act", "silu")
    ns.max_position_embeddings = cfg.get("max_position_embeddings", 2048)
    ns.rope_theta = cfg.get("rope_theta", 10000.0)
    if cfg.get("rope_parameters") is None:
        ns.rope_parameters = None  # rope_parameters() then reads rope_theta + rope_scaling
        ns.rope_scaling = cfg.get("rope_scaling")
    return ns


def expected_checkpoint_names(module: nn.Module, stacked: Iterable[tuple[str, str, Any]] = ()) -> set[str]:
    """The checkpoint tensor names `module` takes: its parameter names with stacked projections
    (qkv_proj, gate_up_proj) split back into their checkpoint parts (q_proj, k_proj, ...)."""
    names = set()
    for name, _ in module.named_parameters():
        parts = [(param, ckpt) for param, ckpt, _ in stacked if f".{param}." in name]
        names.update(name.replace(f".{param}.", f".{ckpt}.", 1) for param, ckpt in parts)
        if not parts:
            names.add(name)
    return names


def check_names(
    what: str, tensors: dict[str, torch.Tensor], expected: set[str], ignorable: Iterable[str] = ()
) -> None:
    """Refuse a checkpoint that lacks a tensor the head needs, or holds one no part of it takes."""
    names = set(tensors) - set(ignorable)
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing:
        raise CheckpointError(f"{what} lacks {len(missing)} tensors it needs, e.g. {missing[:5]}")
    if unexpected:
        raise CheckpointError(
            f"{what} holds {len(unexpected)} tensors this layout does not have, e.g. {unexpected[:5]}: "
            "is it a checkpoint of another method or layout?"
        )


def check_shape(what: str, name: str, tensor: torch.Tensor, shape: tuple[int, ...], meaning: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{what}: {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} ({meaning})")


# ---------------------------------------------------------------------------------------------------
# Requests and tokens


def token_span(req: Request, emitted: Sequence[int], start: int, end: int) -> list[int]:
    """Tokens at positions [start, end) of prompt + outputs + `emitted`, without concatenating them all."""
    n_prompt = len(req.prompt_token_ids)
    n_known = n_prompt + len(req.output_token_ids)
    out: list[int] = []
    if start < n_prompt:
        out += req.prompt_token_ids[start : min(end, n_prompt)]
    if end > n_prompt and start < n_known:
        out += req.output_token_ids[max(start - n_prompt, 0) : end - n_prompt]
    if end > n_known:
        out += list(emitted[max(start - n_known, 0) : end - n_known])
    return out


def draft_budget(req: Request, emitted: Sequence[int], k: int, max_model_len: int) -> int:
    """Drafts worth proposing: the scheduler keeps at most room - 1 (k drafts emit up to k + 1 tokens); max_tokens
    does not cut them (drafts past it are verified and their tokens dropped, as the scheduler does, so that near its
    end a request drafts k like the others and the step stays uniform). A request that emitted nothing (a prompt
    chunk that did not reach its end) or that this step's tokens bring to max_tokens drafts nothing. At collect its
    outputs in flight are this step's, whose values are `emitted`: they count besides its known tokens."""
    max_tokens = req.sampling_params.max_tokens
    if not emitted or (max_tokens is not None and len(req.output_token_ids) + len(emitted) >= max_tokens):
        return 0
    return max(0, min(k, max_model_len - (req.num_known_tokens + len(emitted)) - 1))


def device_budgets(outcome: StepOutcome, k: int, max_model_len: int) -> torch.Tensor:  # [n] int32 on the device
    """`draft_budget` at launch, before the host knows what each request emitted: from each row's token count and
    stop_at in the device table (this step's tokens appended), exact even where the host's counts are guesses (async
    scheduling). Nothing is copied from the host."""
    rows = outcome.tokens.rows.long()
    num_tokens = outcome.tokens.num_tokens[rows].long()
    stops = (outcome.num_emitted == 0) | (num_tokens >= outcome.tokens.stop_at[rows])
    return torch.where(stops, 0, (max_model_len - num_tokens - 1).clamp(0, k)).to(torch.int32)


def draft_before_verification(
    graphs: DraftGraphs | None,
    outcome: StepOutcome,
    features: Callable[[torch.Tensor], Any] | None = None,  # out [T, F] -> the step's target features into out
) -> Drafts | None:
    """At launch, the drafts of a step from its "verified" graph (spec_decode/draft_graphs.py), which writes them into
    the token table itself: where every request is a plain-greedy decode verifying k draft slots (q = k + 1 rows
    each), the verify graph computed the argmax and a graph fits the batch. None where it cannot."""
    reqs, common = outcome.requests, outcome.common
    if (graphs is None or not graphs.drafts_verified or outcome.greedy_ids is None or not graphs.serves(len(reqs))
            or common.max_query_len != graphs.query_len or common.num_tokens != graphs.query_len * len(reqs)):
        return None
    computed = common.num_computed_tokens_cpu.tolist()
    if not all(c + 1 == r.num_tokens and plain_greedy(r) for c, r in zip(computed, reqs, strict=True)):
        return None
    assert outcome.tokens.rows.data_ptr() == graphs.table.rows.data_ptr(), "not the token table of the capture"
    graphs.run_verified(common.block_table, (outcome.greedy_ids, outcome.input_ids, outcome.positions), features)
    n = len(reqs)
    return Drafts(list(range(n)), graphs.drafts_view(n), in_table=True)


@dataclass
class Drafting:
    """Requests that draft this step (`index`: row in the step's batch) and what they drafted so far."""

    index: list[int]
    requests: list[Request]
    emitted: list[list[int]]  # this step's emitted tokens, after the request's output_token_ids
    budget: list[int]  # drafts each request wants
    need_probs: bool  # some request samples: keep q for every drafted token
    tokens: list[list[int]] = field(default_factory=list)
    probs: list[list[torch.Tensor] | torch.Tensor] = field(default_factory=list)
    on_device: torch.Tensor | None = None  # [len(index), k] int64: a graph replay's drafts (then `tokens` is unused)

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in self.index]
        self.probs = [[] for _ in self.index]

    def _row(self, a: int) -> SamplingRow:
        """The sampling row of request a's next draft: its outputs, this step's emitted tokens, its drafts so far
        (referenced, not concatenated: only a penalty builds the list)."""
        req = self.requests[a]  # its outputs in flight are this step's, `emitted`: counted once, from the known list
        return SamplingRow(req, req.output_token_ids, then=[*self.emitted[a], *self.tokens[a]])

    def active(self, j: int) -> list[int]:
        """Positions (into this object's lists) of the requests that want a (j+1)-th draft."""
        return [a for a, b in enumerate(self.budget) if b > j]

    def add(self, active: Sequence[int], logits: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [A] int64
        """Pick the next draft of each active request from its draft logits [A, >= vocab_size]."""
        rows = [self._row(a) for a in active]
        tokens, probs = pick_tokens(logits[:, :vocab_size], rows, vocab_size, self.need_probs)
        for r, (a, t) in enumerate(zip(active, tokens.tolist(), strict=True)):
            self.tokens[a].append(t)
            if probs is not None:
                self.probs[a].append(probs[r])
        return tokens

    def add_independent(self, logits: torch.Tensor, vocab_size: int) -> None:
        """Every draft at once from logits [A, >= max budget, >= vocab_size] whose draft j does not depend on drafts
        before it (Medusa's heads all read one hidden state), where `pick_rule` is not None: then no pick reads an
        earlier draft's value (no penalty), only its count (the output position). The same tokens and q as `add` draft
        by draft, in one `pick_tokens` batch and one host copy instead of one per draft."""
        at = [(a, j) for a, b in enumerate(self.budget) for j in range(b)]
        rows = [SamplingRow(self.requests[a], self.requests[a].output_token_ids, then=[*self.emitted[a], *[0] * j])
                for a, j in at]  # (the drafts' values are unread: no penalty here)
        index = torch.tensor(at, dtype=torch.int64, device=logits.device).T
        tokens, probs = pick_tokens(logits[index[0], index[1], :vocab_size], rows, vocab_size, self.need_probs)
        for r, ((a, _), t) in enumerate(zip(at, tokens.tolist(), strict=True)):
            self.tokens[a].append(t)
            if probs is not None:
                self.probs[a].append(probs[r])

    def chain(
        self,
        logits: torch.Tensor,  # [len(index), >= vocab] the drafter's logits at each request's last row
        last_positions: Sequence[int],  # position of that row, per request
        vocab_size: int,
        step: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
        carry: torch.Tensor | None = None,  # [len(index), ...] per-request state the step feeds on
    ) -> None:
        """Draft 1 from `logits`, then draft j + 1 from `step(batch_rows, positions, ids, carry)`, which
        feeds draft j at position last + j and returns (logits, carry) for the requests still drafting.
        The eager path: `spec_decode.draft_graphs` replays all of it where it serves the step."""
        active = list(range(len(self.index)))
        drafted = self.add(active, logits, vocab_size)
        for j in range(1, max(self.budget, default=0)):
            nxt = self.active(j)
            keep = torch.tensor([active.index(a) for a in nxt], dtype=torch.int64, device=drafted.device)
            ids, active = drafted[keep], nxt
            carry = None if carry is None else carry[keep]
            logits, carry = step(
                [self.index[a] for a in active], [last_positions[a] + j for a in active], ids, carry
            )
            drafted = self.add(active, logits, vocab_size)

    def pick_rule(self, vocab_size: int) -> str | None:
        """How `pick_tokens` picks every draft of this step, where one rule that a draft graph replays serves
        all drafting requests: "argmax" (all greedy, no penalty, min_tokens ban, logit_bias or allowed ids),
        "sample" (some request samples, with a temperature and nothing else: no penalty, ban, bias, top-k, top-p
        or min-p), else None.
        A ban only shrinks as the position grows, so what holds at draft 1 holds for the rest of the chain.
        Logprobs do not matter: drafts never return them (`pick_tokens` ignores them too)."""
        if all(plain_greedy(r) for r in self.requests):  # the common case, without a batch's per-row Python
            return "argmax"
        rows = [self._row(a) for a in range(len(self.index))]
        batch = SamplingBatch.build(rows, vocab_size)
        if not batch.no_penalties or batch.banned_rows is not None or batch.biased:
            return None
        if batch.all_greedy:
            return "argmax"
        return "sample" if batch.no_top_k and batch.no_top_p and batch.no_min_p else None

    def sampling(self, rows: Sequence[int]) -> DraftSampling:
        """What a "sample" draft graph needs of the requests at these step rows (neutral where one does not draft)."""
        at = {i: a for a, i in enumerate(self.index)}
        out = DraftSampling([], [], [], [])
        for i in rows:
            a = at.get(i)
            sp = None if a is None else self.requests[a].sampling_params
            greedy = sp is None or sp.greedy
            out.temperature.append(1.0 if greedy else sp.temperature)
            out.greedy.append(greedy)
            out.seeds.append(0 if a is None else self.requests[a].seed)
            out.positions.append(0 if a is None else len(self.requests[a].output_token_ids) + len(self.emitted[a]))
        return out

    def budgets_of(self, batch_rows: Sequence[int]) -> list[int]:
        """Each of these step rows' draft budget (0: it drafts nothing this step)."""
        budget = dict(zip(self.index, self.budget, strict=True))
        return [budget.get(i, 0) for i in batch_rows]

    def replay(
        self,
        graphs: DraftGraphs,
        rule: str,  # `pick_rule`'s answer: "argmax" or "sample"
        block_table: torch.Tensor,  # the target step's
        batch_rows: list[int],  # [n] each entry request's row in the step
        starts: list[int],  # [n] position of its first entry row
        lens: list[int],  # [n] its entry rows
        tokens: list[int],  # the entry rows' tokens, request after request
        catch_up: Callable[..., Any],  # (rows, starts, lens, tokens[, feature_rows]): an eager entry forward
        feature_rows: list[int] | None = None,  # EAGLE: each entry row's row in the target step
        features: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,  # EAGLE: `DraftGraphs.run`'s
    ) -> None:
        """Draft the whole step from `graphs`. Entries longer than the graphs serve (prompts past the prompt
        graphs, chunks beside other requests) first write the drafter's KV for all but their last rows through
        `catch_up`, eagerly (`DraftGraphs.split`)."""
        probs = graphs.enter(block_table, batch_rows, starts, lens, tokens, self.budgets_of(batch_rows), catch_up,
                             features=features, feature_rows=feature_rows,
                             sampling=self.sampling(batch_rows) if rule == "sample" else None)
        by_row = {i: r for r, i in enumerate(batch_rows)}
        self.left_on_device(graphs, by_row)
        if probs is not None:
            self.probs = [probs[by_row[i], :b] for i, b in zip(self.index, self.budget, strict=True)]

    def left_on_device(self, graphs: DraftGraphs, by_row: dict[int, int]) -> None:
        """The last replay drafted for these requests (graph row by_row[i] holds the request at step row i): their
        drafts stay on the device, where the runner writes them into its token table."""
        if self.index:
            self.on_device = graphs.drafts([by_row[i] for i in self.index])

    def proposal(self, k: int, device: torch.device) -> Drafts:
        """The drafts (up to k per drafting request) for the runner."""
        probs = {}
        for req, ps in zip(self.requests, self.probs, strict=True):
            if len(ps):  # a list of [vocab] rows (eager), or [num_drafts, vocab] from a graph
                probs[req.request_id] = ps if isinstance(ps, torch.Tensor) else torch.stack(ps)
        if self.on_device is not None:
            return Drafts(self.index, self.on_device, list(self.budget), probs)
        return Drafts.from_lists(self.index, self.tokens, k, device, probs)


def start_drafting(
    requests: Sequence[Request], emitted: Sequence[Sequence[int]], k: int, max_model_len: int
) -> Drafting:
    idx, reqs, outs, budget = [], [], [], []
    for i, (req, e) in enumerate(zip(requests, emitted, strict=True)):
        b = draft_budget(req, e, k, max_model_len)
        if b > 0:
            idx.append(i)
            reqs.append(req)
            outs.append(list(e))
            budget.append(b)
    need_probs = any(not r.sampling_params.greedy for r in reqs)
    return Drafting(idx, reqs, outs, budget, need_probs)


def pick_tokens(
    logits: torch.Tensor,  # [R, V] draft logits over the target vocabulary (-inf where it cannot draft)
    rows: Sequence[SamplingRow],
    vocab_size: int,
    need_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [R] int64, q [R, V] float32 or None
    """The request's own logit processing (penalties, temperature, top-k/p) turns draft logits into q;
    greedy rows take the argmax (q one-hot), random rows sample q on the `DRAFT` stream, so a draft
    depends only on (seed, output position), never on the batch."""
    batch = SamplingBatch.build(rows, vocab_size, logits.device)
    processed = process_logits(logits, batch)  # [R, V] float32
    if batch.all_greedy and not need_probs:
        return processed.argmax(dim=-1), None
    probs = probs_from_processed(processed, batch)  # greedy rows one-hot
    tokens = processed.argmax(dim=-1)
    if batch.random_rows:
        idx = rng.to_device(batch.random_rows, torch.int64, logits.device)
        drawn = random_sample(
            probs[idx], [batch.seeds[i] for i in batch.random_rows],
            [batch.positions[i] for i in batch.random_rows], rng.DRAFT,
        )
        tokens = tokens.index_copy(0, idx, drawn)
    return tokens, probs


# ---------------------------------------------------------------------------------------------------
# Draft batches over the target's block tables


def cache_layers_of(module: nn.Module) -> list[CacheLayer]:
    return [m for m in module.modules() if isinstance(m, CacheLayer)]


def draft_metadata(
    step: CommonAttentionMetadata,  # the target step's batch: block tables, block size
    batch_rows: Sequence[int],  # [R] row of each draft request in the step's batch
    starts: Sequence[int],  # [R] first position each draft request computes
    lens: Sequence[int],  # [R] tokens each computes (>= 1)
    layers: Sequence[CacheLayer],
    tree_bits: torch.Tensor | None = None,  # [T] int64: token-tree masks over each request's query tokens
) -> tuple[torch.Tensor, dict[str, Any]]:  # positions [T] int64 (device), backend name -> metadata
    """A draft forward's positions and attention metadata; KV goes to the slots of those positions."""
    device = step.block_table.device
    num_reqs = len(batch_rows)
    lens_np = np.asarray(lens, dtype=np.int64)
    starts_np = np.asarray(starts, dtype=np.int64)
    seq_lens_np = starts_np + lens_np
    qsl_np = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(lens_np, out=qsl_np[1:])
    num_tokens = int(qsl_np[-1])
    req_of_token = np.repeat(np.arange(num_reqs), lens_np)  # [T]
    positions_np = np.arange(num_tokens) - qsl_np[req_of_token] + starts_np[req_of_token]  # [T]

    # One pinned, asynchronous copy: a copy from pageable memory waits for the stream (the forward still queued on
    # it), and a tree drafts several levels of these a step.
    host = np.concatenate([np.asarray(batch_rows, dtype=np.int64), positions_np, req_of_token, qsl_np, seq_lens_np])
    rows, positions, req_idx, qsl, seq_lens = rng.to_device(torch.from_numpy(host), torch.int64, device).split(
        [num_reqs, num_tokens, num_tokens, num_reqs + 1, num_reqs])
    block_table = step.block_table.index_select(0, rows)  # [R, max_blocks]
    bs = step.block_size
    slot_mapping = block_table[req_idx, positions // bs].long() * bs + positions % bs  # [T]

    qsl_cpu = torch.from_numpy(qsl_np.astype(np.int32))
    seq_lens_cpu = torch.from_numpy(seq_lens_np.astype(np.int32))
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(torch.int32),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_lens.to(torch.int32),
        seq_lens_cpu=seq_lens_cpu,
        num_computed_tokens_cpu=torch.from_numpy(starts_np.astype(np.int32)),
        block_table=block_table,
        slot_mapping=slot_mapping,
        request_rows=step.request_rows.index_select(0, rows),
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        max_query_len=int(lens_np.max()),
        max_seq_len=int(seq_lens_np.max()),
        block_size=bs,
        tree_bits=tree_bits,
    )
    backends = {layer.backend.name: layer.backend for layer in layers}
    return positions, {name: b.build_metadata(common) for name, b in backends.items()}
