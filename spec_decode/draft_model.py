"""A smaller model of the same vocabulary drafts k tokens autoregressively with its own paged KV cache.

The draft's attention layers are exposed as `cache_layers`: the runner allocates them beside the
target's, in the same blocks (one budget, one block table), so the draft's KV for position p lives
at the target's slot for p. Each step, per request:

1. Catch up: feed the tokens at positions [valid, n] (x[n] the newest token), where `valid` counts
   the positions whose draft KV is known right: those fed before, extended over the drafts this
   step accepted (a fed draft d at position p is right iff the token now at p is d). Positions
   past `valid` hold rejected drafts and are overwritten now. A request the runner has not seen
   (new, or preempted and re-admitted) starts at the target's computed tokens, as does one whose
   computed tokens reset to 0: prefix-cache blocks hold the draft's KV too, since every position
   the target computed, the draft computed in the same step.
2. Draft: the logits at x[n] give d1; feed d1 at n+1, ..., d(k-1) at n+k-1 (`num_lookahead_tokens`
   = k slots past the verified tokens). Greedy requests take argmaxes; sampling requests draw from
   their processed draft distribution q and return it (`Drafts.probs`).

At launch (`propose_on_device`), a plain-greedy verify step drafts before its tokens reach the host, from the
"verified" draft graph (spec_decode/draft_graphs.py): a request that verified x_c and k drafts at c .. c+k and
accepted n_acc has right draft KV below c + 1 (x_c was fed as the newest token last step), and its accepted drafts
only repeat what was fed, so the graph feeds the target's argmax g[j] at position c + j + 1 for j <= n_acc (g[n_acc]
is the new token, at the newest position), takes d1 from the row of g[n_acc] and chains as above. Every position
below the target's computed count c + n_acc + 1 then holds the right draft KV, so forgetting the request's fed
drafts (`_fed`) is exact: a later catch-up at collect starts at the target's computed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from research_lm.engine.request import Request
from research_lm.models.base import CheckpointError
from research_lm.models.loader import load_model
from research_lm.worker.cuda_graphs import Capture, GraphPool, uncapturable_reason
from research_lm.worker.spec import Drafts, DraftTarget, Proposer, StepOutcome, TokenTable, register_proposer
from spec_decode.draft_graphs import DraftGraphs
from spec_decode.heads import (
    cache_layers_of,
    draft_before_verification,
    draft_metadata,
    head_dir,
    start_drafting,
    token_span,
)

_PAGED_KINDS = ("attention", "mla")


class DraftModelProposer(Proposer):
    """`research_lm.worker.spec.Proposer` over any causal LM the engine can load."""

    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, model: nn.Module, *, num_speculative_tokens: int, vocab_size: int, max_model_len: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.model = model
        self.cache_layers = cache_layers_of(model)
        stateful = sorted({layer.spec.kind for layer in self.cache_layers} - set(_PAGED_KINDS))
        if stateful:
            raise ValueError(
                f"draft_model needs a drafter whose layers all keep paged KV; this one has {stateful} layers, "
                "whose per-request state cannot roll back rejected drafts"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.num_lookahead_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # request id -> (positions [0, valid) whose draft KV is right, drafts fed at valid, valid+1, ...)
        self._fed: dict[str, tuple[int, list[int]]] = {}
        self.graphs: DraftGraphs | None = None  # set by capture_cuda_graphs

    def _valid(self, req: Request, emitted: list[int], computed: int) -> int:
        state = self._fed.get(req.request_id)
        if state is None or computed == 0:
            return computed
        valid, fed = state
        accepted = token_span(req, emitted, valid, valid + len(fed))
        j = 0
        while j < len(accepted) and accepted[j] == fed[j]:
            j += 1
        return valid + j

    def _forward(self, ids: list[int] | torch.Tensor, positions: torch.Tensor, md: dict[str, Any]) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.int64, device=positions.device)
        return self.model(ids, positions, md)  # [T, H]

    def _entry(self, outcome: StepOutcome, batch_rows: list[int], starts: list[int], lens: list[int],
               tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager forward over `lens` tokens per request from `starts` (writing the draft KV): (positions,
        hidden)."""
        positions, md = draft_metadata(outcome.common, batch_rows, starts, lens, self.cache_layers)
        return positions, self._forward(tokens, positions, md)

    def propose_on_device(self, outcome: StepOutcome) -> Drafts | None:
        """The "verified" graph's drafts at launch (module docstring), or None (then `propose` drafts at collect)."""
        drafts = draft_before_verification(self.graphs, outcome)
        if drafts is not None:  # its KV is right below the target's computed tokens: where `_valid` then starts
            for req in outcome.requests:
                self._fed.pop(req.request_id, None)
        return drafts

    def propose(self, outcome: StepOutcome) -> Drafts:
        reqs, emitted = outcome.requests, outcome.emitted
        drafting = start_drafting(reqs, emitted, self.num_speculative_tokens, self.max_model_len)
        computed = outcome.common.num_computed_tokens_cpu.tolist()
        seq_lens = outcome.common.seq_lens_cpu.tolist()
        batch_rows, starts, lens, tokens = [], [], [], []
        newest: dict[int, int] = {}  # batch row -> n, the newest token's position
        for i, (req, e) in enumerate(zip(reqs, emitted, strict=True)):
            valid = self._valid(req, e, computed[i])
            if e:  # recompute x[n] at least: its logits give the first draft
                newest[i] = req.num_known_tokens + len(e) - 1
                valid, end = min(valid, newest[i]), newest[i] + 1
            else:  # a prompt chunk: the target computed up to seq_len
                end = seq_lens[i]
            if end > valid:
                batch_rows.append(i)
                starts.append(valid)
                lens.append(end - valid)
                tokens += token_span(req, e, valid, end)
            self._fed[req.request_id] = (max(valid, end), [])
        if not batch_rows:
            return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)
        graphs_fit = self.graphs is not None and self.graphs.serves(len(lens))
        rule = drafting.pick_rule(self.vocab_size) if graphs_fit else None
        if rule is not None:
            drafting.replay(self.graphs, rule, outcome.common.block_table, batch_rows, starts, lens, tokens,
                            lambda *span: self._entry(outcome, *span))
        else:
            positions, hidden = self._entry(outcome, batch_rows, starts, lens, tokens)
            if not drafting.index:
                return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)
            row_in_batch = {i: r for r, i in enumerate(batch_rows)}
            ends = torch.tensor(lens).cumsum(0) - 1
            last = ends[[row_in_batch[i] for i in drafting.index]].to(positions.device)

            def step(rows, positions, ids, _):
                positions, md = draft_metadata(outcome.common, rows, positions, [1] * len(ids), self.cache_layers)
                return self.model.compute_logits(self._forward(ids, positions, md)), None

            drafting.chain(self.model.compute_logits(hidden[last]), [newest[i] for i in drafting.index],
                           self.vocab_size, step)
        for i, req, toks in zip(drafting.index, drafting.requests, drafting.tokens, strict=True):
            self._fed[req.request_id] = (newest[i] + 1, toks[:-1])  # d(k) was never fed
        return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)

    def capture_cuda_graphs(self, *, sizes: list[int], capture: Capture | GraphPool, block_size: int,
                            max_blocks_per_req: int,
                            verified_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                            tokens: TokenTable | None = None, prefill_sizes: Sequence[int] = ()) -> None:
        """Graphs of whole greedy drafting steps (spec_decode/draft_graphs.py), over the allocated KV cache; the
        "verified" ones (where the runner hands over its token table) enter the verify's argmax one position later
        than EAGLE does and write the drafts into the table."""
        backends = [layer.backend for layer in self.cache_layers]
        if uncapturable_reason(self.model, backends, lengths_on_device=True) is not None:
            return
        multi_token = all(b.capabilities.cuda_graphs_multi_token for b in backends)

        def forward(ids, positions, md, _):
            return self._forward(ids, positions, md), None

        self.graphs = DraftGraphs(
            entry=forward, step=forward, logits=self.model.compute_logits, argmax=None, layers=self.cache_layers,
            num_speculative_tokens=self.num_speculative_tokens, vocab_size=self.vocab_size, sizes=sizes,
            query_len=self.num_speculative_tokens + 1 if multi_token else 1, block_size=block_size,
            max_blocks_per_req=max_blocks_per_req, max_seq_len=self.max_model_len + self.num_lookahead_tokens,
            features=None, device=next(self.model.parameters()).device, capture=capture,
            verified_inputs=verified_inputs, tokens=tokens, max_model_len=self.max_model_len, entry_shift=1,
            prefill_sizes=prefill_sizes,
        )

    def on_requests_removed(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._fed.pop(req_id, None)


@register_proposer("draft_model")
def build_proposer(speculative_config: dict[str, Any], target: DraftTarget) -> DraftModelProposer:
    path = head_dir(speculative_config, "draft_model")
    k = speculative_config.get("num_speculative_tokens")
    if k is None:
        raise ValueError("speculative_config for 'draft_model' needs num_speculative_tokens")
    model, hf_config = load_model(
        path, device=target.device, dtype=target.dtype, attention_backend=target.attention_backend,
        trust_remote_code=target.trust_remote_code, extra=target.model_extra,
    )
    if hf_config.vocab_size < target.vocab_size:
        raise CheckpointError(
            f"draft model {path} has a vocabulary of {hf_config.vocab_size} tokens, smaller than the target's "
            f"{target.vocab_size}: it must share the target's tokenizer"
        )
    return DraftModelProposer(
        model, num_speculative_tokens=int(k), vocab_size=target.vocab_size, max_model_len=target.max_model_len,
    )
