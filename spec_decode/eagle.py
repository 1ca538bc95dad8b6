"""EAGLE-1 and EAGLE-3 draft heads in their published checkpoint layouts, and their proposer.

Both heads predict the token after next from (token, feature) pairs shifted by one: the row at
position t reads embed(x[t+1]) and the target's feature at t, writes its KV at t's slot, and its
output at the last row gives the logits of x[t+2]. Chained drafting feeds each draft back with the
head's own output as the next feature (Li et al. 2024, arXiv 2401.15077 and 2503.01840).

EAGLE-1 (`yuhuili/EAGLE-*`: config.json + pytorch_model.bin; SafeAILab/EAGLE `eagle/model/cnets1.py`):
    fc.weight [H, 2H] (+ fc.bias, present unless config.json says "bias": false),
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
    layers.{i}.post_attention_layernorm.weight, layers.{i}.input_layernorm.weight for i >= 1 only,
    embed_tokens.weight optional (else the target's). No lm_head: the target's.
    f = fc([embed(x[t+1]); h_t]) -> decoder layers (layer 0 without input norm) -> f + residual
    (no final norm: it regresses the target's normed feature); logits = target lm_head(f).
    The feature h_t is the target's final (normed) hidden state.

EAGLE-3 (`yuhuili/EAGLE3-*`; SafeAILab/EAGLE `eagle/traineagle3/cnets.py`, vLLM `llama_eagle3.py`):
    fc.weight [H, 3 H_target], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], midlayer.self_attn.o_proj.weight,
    midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight [draft_vocab, H],
    d2t [draft_vocab] int64 (target id = draft id + d2t[draft id]), t2d [vocab] bool; embed_tokens
    optional. config.json: `draft_vocab_size`, optionally `eagle_aux_hidden_state_layer_ids`,
    `target_hidden_size`, `norm_before_residual`. As in vLLM, a head without lm_head / d2t drafts over
    the full vocabulary with the target's lm_head.
    g_t = fc([a_t; b_t; c_t]) from three target residual streams (vLLM indexing: id i = the stream
    entering layer i; default (2, L // 2, L - 3)); the midlayer attends over
    [input_layernorm(embed(x[t+1])); hidden_norm(g_t)], keeps g_t as its residual, and returns the
    pre-norm stream, which is both the next step's feature and, through norm + lm_head + d2t, the
    draft logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from research_lm.models.base import CheckpointError, ModelBuildContext, build_scope, is_rotary_buffer, load_params
from research_lm.models.layers import (
    GatedMLP,
    Linear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    VocabParallelEmbedding,
    compute_logits,
    rope_parameters,
)
from research_lm.models.llama import STACKED_PARAMS, LlamaAttention, LlamaDecoderLayer, LlamaVariant, head_size
from research_lm.models.loader import read_json_config
from research_lm.ops import use_fused
from research_lm.worker.cuda_graphs import Capture, GraphPool, uncapturable_reason
from research_lm.worker.rng import to_device
from research_lm.worker.spec import Drafts, DraftTarget, Proposer, StepOutcome, TokenTable, register_proposer
from research_lm.worker.token_tree import DynamicTree, TokenTree, TreeShape
from spec_decode.draft_graphs import DraftGraphs
from spec_decode.eagle_tree import DynamicEagleTree, EagleTree
from spec_decode.heads import (
    cache_layers_of,
    check_names,
    check_shape,
    draft_before_verification,
    draft_metadata,
    expected_checkpoint_names,
    head_dir,
    llama_like_config,
    read_head_tensors,
    start_drafting,
    token_span,
)
from spec_decode.tree_graphs import TreeGraphs


def _variant(tensors: dict[str, torch.Tensor], prefix: str) -> LlamaVariant:
    """Biases are whatever the checkpoint holds (Qwen-style heads carry q/k/v biases)."""
    return LlamaVariant(
        qkv_bias=f"{prefix}.self_attn.q_proj.bias" in tensors,
        o_bias=f"{prefix}.self_attn.o_proj.bias" in tensors,
        mlp_bias=f"{prefix}.mlp.gate_proj.bias" in tensors,
    )


def _rotary(cfg: SimpleNamespace) -> RotaryEmbedding:
    return RotaryEmbedding(head_size(cfg), rope_parameters(cfg), cfg.max_position_embeddings)


class EagleHead(nn.Module):
    """EAGLE-1: fc over [embedding; target feature], Llama decoder layers, the target's lm_head."""

    def __init__(self, cfg: SimpleNamespace, build: ModelBuildContext, tensors: dict[str, torch.Tensor]):
        super().__init__()
        hidden = cfg.hidden_size
        with build_scope(build):
            self.fc = Linear(2 * hidden, hidden, bias="fc.bias" in tensors)
            self.layers = nn.ModuleList(
                LlamaDecoderLayer(cfg, _variant(tensors, f"layers.{i}"), None, build)
                for i in range(cfg.num_hidden_layers)
            )
            self.embed_tokens = (
                VocabParallelEmbedding(cfg.vocab_size, hidden) if "embed_tokens.weight" in tensors else None
            )
            self.rotary_emb = _rotary(cfg)
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1 skips the first layer's input norm

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] embedding of x[t+1]
        features: torch.Tensor,  # [T, H] target (or previous draft) feature at t
        positions: torch.Tensor,  # [T] int64
        attn_metadata: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (feature for the lm_head, feature for the next step), [T, H]
        hidden = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        rope = self.rotary_emb(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, attn_metadata)
        out = hidden if residual is None else hidden + residual  # None: the layers fused their residual adds
        return out, out


class Eagle3Layer(nn.Module):
    """The EAGLE-3 midlayer: attention over [norm(embedding); norm(fused feature)] (2H wide)."""

    def __init__(self, cfg: SimpleNamespace, variant: LlamaVariant, build: ModelBuildContext):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(cfg, variant, None, build)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(
            2 * hidden, attn.head_size, attn.num_heads, attn.num_kv_heads, variant.qkv_bias
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act, variant.mlp_bias)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H]
        features: torch.Tensor,  # [T, H]
        rope: Rope,
        attn_metadata: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (mlp output, residual); the stream is their sum
        if self.norm_before_residual:
            features = self.hidden_norm(features)
            residual = features
        else:
            residual = features
            features = self.hidden_norm(features)
        return self.attend(torch.cat([self.input_layernorm(embeds), features], dim=-1), residual, rope, attn_metadata)

    def attend(
        self,
        hidden: torch.Tensor,  # [T, 2H]: [input_layernorm(embeds); hidden_norm(features)]
        residual: torch.Tensor,  # [T, H]
        rope: Rope,
        attn_metadata: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (mlp output, residual)
        hidden = self.self_attn(hidden, rope, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Eagle3Head(nn.Module):
    """EAGLE-3: fuse target aux streams with fc, one midlayer, own norm + lm_head over a draft vocab."""

    def __init__(
        self, cfg: SimpleNamespace, build: ModelBuildContext, tensors: dict[str, torch.Tensor],
        fc_input_size: int, draft_vocab_size: int, target_vocab_size: int,
    ):
        super().__init__()
        hidden = cfg.hidden_size
        self.target_vocab_size = target_vocab_size
        with build_scope(build):
            self.fc = Linear(fc_input_size, hidden, bias="fc.bias" in tensors)
            self.midlayer = Eagle3Layer(cfg, _variant(tensors, "midlayer"), build)
            self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
            # None: the head shares the target's lm_head (full vocabulary, no d2t)
            self.lm_head = ParallelLMHead(draft_vocab_size, hidden) if "lm_head.weight" in tensors else None
            self.embed_tokens = (
                VocabParallelEmbedding(cfg.vocab_size, hidden) if "embed_tokens.weight" in tensors else None
            )
            self.rotary_emb = _rotary(cfg)
        # draft id -> target id; filled from the checkpoint's d2t offsets
        self.register_buffer("draft_to_target", torch.arange(draft_vocab_size, device=build.device))
        self.fused_ops = True  # `forward_tokens` and `argmax` take their kernels on CUDA (research_lm.ops)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H]
        features: torch.Tensor,  # [T, H] fused target feature, or the previous step's pre-norm output
        positions: torch.Tensor,  # [T] int64
        attn_metadata: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed output for the lm_head, pre-norm output), [T, H]
        hidden, residual = self.midlayer(embeds, features.to(embeds.dtype), self.rotary_emb(positions), attn_metadata)
        normed, prenorm = self.norm(hidden, residual)
        return normed, prenorm

    def forward_tokens(
        self,
        ids: torch.Tensor,  # [T] int64: x[t+1]
        embed: nn.Module,  # the embedding they are looked up in (the head's own, or the target's)
        features: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T] int64
        attn_metadata: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(embed(ids), ...)`. On the fused path (`use_fused`, a plain embedding table, one dtype) the lookup,
        both input norms and their concatenation run as one kernel (spec_decode/eagle3_kernels.py)."""
        mid, table = self.midlayer, getattr(embed, "weight", None)
        if (type(embed) is not VocabParallelEmbedding or not use_fused(self, features)
                or not table.dtype == mid.input_layernorm.weight.dtype == mid.hidden_norm.weight.dtype):
            return self(embed(ids), features, positions, attn_metadata)
        from spec_decode.eagle3_kernels import eagle3_input  # Triton, imported when it runs

        features = features.to(table.dtype)
        hidden = eagle3_input(ids, table, features, mid.input_layernorm.weight, mid.hidden_norm.weight,
                              mid.input_layernorm.eps)
        residual = hidden[:, features.shape[1] :] if mid.norm_before_residual else features
        hidden, residual = mid.attend(hidden, residual, self.rotary_emb(positions), attn_metadata)
        return self.norm(hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, target vocab] fp32
        """Draft-vocab logits scattered to their target ids; tokens outside the draft vocab get -inf."""
        draft_logits = compute_logits(self.lm_head, hidden)  # [n, draft_vocab]
        out = draft_logits.new_full((hidden.shape[0], self.target_vocab_size), float("-inf"))
        out[:, self.draft_to_target] = draft_logits
        return out

    def argmax(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # [n, H] -> [n] int64
        """`compute_logits(hidden).argmax(-1)` as target ids, without the scatter or the fp32 copy (exact, so the same
        order), into `out` if given. Equal on ties only when draft ids ascend with their target ids
        (`draft_vocab_ascends`), as they do in the published heads."""
        logits = torch.nn.functional.linear(hidden, self.lm_head.weight)
        if use_fused(self, logits):  # the argmax and the lookup in one kernel
            from spec_decode.eagle3_kernels import argmax_gather  # Triton, imported when it runs

            return argmax_gather(logits, self.draft_to_target, out=out)
        return torch.index_select(self.draft_to_target, 0, logits.argmax(dim=-1), out=out)

    @property
    def draft_vocab_ascends(self) -> bool:
        return bool((self.draft_to_target[1:] > self.draft_to_target[:-1]).all())


# ---------------------------------------------------------------------------------------------------
# The proposer


class EagleProposer(Proposer):
    """`research_lm.worker.spec.Proposer` over an EAGLE / EAGLE-3 head with its own paged KV cache.

    Each step the head first recomputes its rows for every position the target verified this step
    (c .. n-1, where c = the target's computed tokens before the step and x[n] the newest token),
    overwriting whatever drafting wrote there last step; so after partial acceptance, preemption
    (the target restarts at c = 0 or a prefix hit) or a prefill chunk, the head's KV below the
    target's computed tokens is exactly what the target's features give. Then up to k - 1 chained
    single-token steps at positions n, n+1, ... (the scheduler's lookahead slots); or, with a token tree
    (static, or EAGLE-2's dynamic one), its levels (spec_decode/eagle_tree.py, at collect). Where graphs were
    captured a step replays one, entry and chain (spec_decode/draft_graphs.py) or entry and levels
    (spec_decode/tree_graphs.py).
    """

    def __init__(
        self, head: EagleHead | Eagle3Head, target: DraftTarget, *, num_speculative_tokens: int,
        vocab_size: int, max_model_len: int, aux_hidden_state_layers: tuple[int, ...] = (),
        token_tree: TreeShape | None = None,
    ):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.head = head
        self.target_embed, self.target_logits = target.embed_tokens, target.compute_logits
        self.num_speculative_tokens = num_speculative_tokens if token_tree is None else token_tree.num_drafts
        self.num_lookahead_tokens = num_speculative_tokens - 1  # chained rows at n .. n+k-2
        # The head's row at p reads the token at p + 1: a prefix-cache hit must leave its last block
        # to be recomputed, or that row keeps the token of whichever request cached it.
        self.needs_last_hit_block_recomputed = True
        self.aux_hidden_state_layers = aux_hidden_state_layers
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.cache_layers = cache_layers_of(head)
        self.graphs: DraftGraphs | None = None  # set by capture_cuda_graphs
        self.tree_graphs: TreeGraphs | None = None  # a token tree's levels, set by capture_cuda_graphs
        self.token_tree = token_tree
        self.tree_drafter: EagleTree | DynamicEagleTree | None = None
        if isinstance(token_tree, TokenTree):
            self.tree_drafter = EagleTree(token_tree, self._forward, self._logits, self.cache_layers, vocab_size,
                                          head.fc.weight.device)
        elif token_tree is not None:
            self.tree_drafter = DynamicEagleTree(token_tree, self._forward, self._logits, self.cache_layers,
                                                 vocab_size, head.fc.weight.device)
        if self.tree_drafter is not None:
            self.num_lookahead_tokens = self.tree_drafter.num_lookahead_tokens

    def _embedding(self) -> nn.Module:
        return self.head.embed_tokens if self.head.embed_tokens is not None else self.target_embed

    def _target_features(self, outcome: StepOutcome, rows: torch.Tensor | slice,
                         out: torch.Tensor | None = None) -> torch.Tensor:  # rows [T] -> [T, F], into out if given
        """What the head reads of the target at these rows: EAGLE-3 its aux streams side by side (F = 3 H_target)."""
        if isinstance(self.head, Eagle3Head):
            return torch.cat([aux[rows] for aux in outcome.aux_hidden_states], dim=-1, out=out)
        return outcome.hidden_states[rows] if out is None else out.copy_(outcome.hidden_states[rows])

    def _head_features(self, target_features: torch.Tensor) -> torch.Tensor:  # [T, F] -> [T, H]
        return self.head.fc(target_features) if isinstance(self.head, Eagle3Head) else target_features

    def _logits(self, out: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, vocab] fp32
        if isinstance(self.head, Eagle3Head) and self.head.lm_head is not None:
            return self.head.compute_logits(out)
        return self.target_logits(out)

    def _greedy_argmax(self) -> Callable[..., torch.Tensor] | None:
        """EAGLE-3's argmax over its draft vocabulary, mapped to target ids (no scatter to the target's)."""
        head = self.head
        if isinstance(head, Eagle3Head) and head.lm_head is not None and head.draft_vocab_ascends:
            return head.argmax
        return None

    def _forward(self, ids, positions, md, features):  # `DraftForward` over the head's own features
        if isinstance(self.head, Eagle3Head):
            return self.head.forward_tokens(ids, self._embedding(), features, positions, md)
        return self.head(self._embedding()(ids), features, positions, md)

    def _entry(self, outcome: StepOutcome, batch_rows: list[int], starts: list[int], lens: list[int],
               tokens: list[int], feature_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager entry forward over rows (x[t+1], feature_t), `lens` per request from `starts`: (out, hidden)."""
        device = outcome.common.block_table.device
        positions, md = draft_metadata(outcome.common, batch_rows, starts, lens, self.cache_layers)
        ids, rows = to_device([*tokens, *feature_rows], torch.int64, device).split([len(tokens), len(feature_rows)])
        return self._forward(ids, positions, md, self._head_features(self._target_features(outcome, rows)))

    def propose_on_device(self, outcome: StepOutcome) -> Drafts | None:
        """Draft this step from the "verified" graph, right behind the verify forward, from device values alone
        (`spec_decode.heads.draft_before_verification`). For request r the entry is then its emitted tokens (the
        verify's argmax at rows 0 .. n_acc) at positions c .. c + n_acc, exactly the rows `propose` would enter, and
        its drafts are the same. None where it cannot (then `propose` drafts at collect), as with a token tree."""
        if self.tree_drafter is not None:
            return None
        return draft_before_verification(
            self.graphs, outcome, lambda out: self._target_features(outcome, slice(0, len(out)), out))

    def _entry_span(self, outcome: StepOutcome) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """The entry rows (x[t+1], feature_t) for the verified positions t = c .. end-1 of every request:
        (batch_rows, starts, lens, tokens, feature_rows), as `_entry` takes them."""
        reqs, emitted = outcome.requests, outcome.emitted
        qsl = outcome.query_start_loc_cpu.tolist()
        computed = outcome.common.num_computed_tokens_cpu.tolist()
        batch_rows, starts, lens, tokens, feature_rows = [], [], [], [], []
        for i, (req, e) in enumerate(zip(reqs, emitted, strict=True)):
            c = computed[i]
            count = req.num_known_tokens + len(e) - 1 - c if e else qsl[i + 1] - qsl[i]
            batch_rows.append(i)
            starts.append(c)
            lens.append(count)
            tokens += token_span(req, e, c + 1, c + 1 + count)
            feature_rows += range(qsl[i], qsl[i] + count)
        return batch_rows, starts, lens, tokens, feature_rows

    def propose(self, outcome: StepOutcome) -> Drafts:
        if self.tree_drafter is not None:
            return self._propose_tree(outcome)
        drafting = start_drafting(outcome.requests, outcome.emitted, self.num_speculative_tokens, self.max_model_len)
        batch_rows, starts, lens, tokens, feature_rows = self._entry_span(outcome)
        graphs_fit = self.graphs is not None and self.graphs.serves(len(lens))
        rule = drafting.pick_rule(self.vocab_size) if graphs_fit else None
        if rule is not None:
            drafting.replay(self.graphs, rule, outcome.common.block_table, batch_rows, starts, lens, tokens,
                            lambda *span: self._entry(outcome, *span), feature_rows=feature_rows,
                            features=lambda rows, out: self._target_features(outcome, rows, out))
            return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)
        out, hidden = self._entry(outcome, batch_rows, starts, lens, tokens, feature_rows)
        if not drafting.index:
            return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)

        last = to_device(last_rows(lens, drafting.index), torch.int64, out.device)  # each request's last row

        def step(batch_rows, positions, ids, features):
            positions, md = draft_metadata(outcome.common, batch_rows, positions, [1] * len(ids), self.cache_layers)
            out, features = self._forward(ids, positions, md, features)
            return self._logits(out), features

        last_pos = [starts[i] + lens[i] - 1 for i in drafting.index]  # n - 1
        drafting.chain(self._logits(out[last]), last_pos, self.vocab_size, step, carry=hidden[last])
        return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)

    def _propose_tree(self, outcome: StepOutcome) -> Drafts:
        """The entry forward as for a chain, then the tree's levels from each drafting request's last row, both from
        one graph where they were captured (spec_decode/tree_graphs.py), else eagerly. Every
        request drafts a deterministic top-k tree, whatever it samples; its chain budget (as many drafts as a chain of
        the tree's depth) says which nodes are real."""
        drafting = start_drafting(outcome.requests, outcome.emitted, self.token_tree.depth, self.max_model_len)
        span = self._entry_span(outcome)
        if self.tree_graphs is not None and self.tree_graphs.serves(len(span[0])):  # the entry and the levels
            tokens, parents = self.tree_graphs.run(
                outcome.common.block_table, *span, drafting.budgets_of(span[0]), drafting.index,
                catch_up=lambda *rows: self._entry(outcome, *rows),
                features=lambda rows, out: self._target_features(outcome, rows, out))
            if not drafting.index:
                return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)
            return Drafts(drafting.index, tokens, self.tree_drafter.real_counts(drafting.budget), tree_parents=parents)
        out, hidden = self._entry(outcome, *span)
        if not drafting.index:
            return drafting.proposal(self.num_speculative_tokens, outcome.input_ids.device)
        starts, lens = span[1], span[2]
        last = to_device(last_rows(lens, drafting.index), torch.int64, out.device)  # each request's last row
        roots = [starts[i] + lens[i] - 1 for i in drafting.index]  # n - 1
        return self.tree_drafter.draft(outcome.common, drafting.index, drafting.budget, roots, out[last], hidden[last])

    def capture_cuda_graphs(self, *, sizes: list[int], capture: Capture | GraphPool, block_size: int,
                            max_blocks_per_req: int,
                            verified_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                            tokens: TokenTable | None = None, prefill_sizes: Sequence[int] = ()) -> None:
        """Graphs of whole greedy drafting steps (spec_decode/draft_graphs.py), over the allocated KV cache; the
        "verified" ones (where the runner hands over its token table) read the target's argmax and input ids in
        place where the runner hands their buffers over, and write the drafts into the table. A token tree's levels
        (static or dynamic) get graphs of their own, of the entry and the levels (spec_decode/tree_graphs.py)."""
        backends = [layer.backend for layer in self.cache_layers]
        if uncapturable_reason(self.head, backends, lengths_on_device=True) is not None:
            return
        multi_token = all(b.capabilities.cuda_graphs_multi_token for b in backends)
        fc = self.head.fc.weight  # [H, fc input]
        # The entry reads the target's features: EAGLE-3 its aux streams (fc's input), EAGLE-1 its hidden state.
        width = fc.shape[1] if isinstance(self.head, Eagle3Head) else fc.shape[0]

        def entry(ids, pos, md, feats):
            return self._forward(ids, pos, md, self._head_features(feats))

        if self.tree_drafter is not None:
            if multi_token:  # a request's entry after a tree step: the accepted path and the bonus, <= depth + 1 rows
                self.tree_graphs = TreeGraphs(
                    self.tree_drafter, entry=entry, layers=self.cache_layers, sizes=sizes,
                    query_len=self.token_tree.depth + 1, block_size=block_size, max_blocks_per_req=max_blocks_per_req,
                    max_seq_len=self.max_model_len + self.num_lookahead_tokens, features=(width, fc.dtype),
                    device=fc.device, capture=capture, prefill_sizes=prefill_sizes)
            return
        self.graphs = DraftGraphs(
            entry=entry,
            step=self._forward, logits=self._logits, argmax=self._greedy_argmax(), layers=self.cache_layers,
            num_speculative_tokens=self.num_speculative_tokens, vocab_size=self.vocab_size, sizes=sizes,
            query_len=self.num_speculative_tokens + 1 if multi_token else 1, block_size=block_size,
            max_blocks_per_req=max_blocks_per_req, max_seq_len=self.max_model_len + self.num_lookahead_tokens,
            features=(width, fc.dtype), device=fc.device, capture=capture, verified_inputs=verified_inputs,
            tokens=tokens, max_model_len=self.max_model_len, prefill_sizes=prefill_sizes,
        )

    def on_requests_removed(self, req_ids: set[str]) -> None:
        pass  # no per-request state: each step recomputes from the target's computed tokens


# ---------------------------------------------------------------------------------------------------
# Loading


def last_rows(lens: Sequence[int], index: Sequence[int]) -> list[int]:
    """The last row of each indexed request among rows laid out `lens` per request."""
    ends = list(itertools.accumulate(lens))
    return [ends[i] - 1 for i in index]


def _speculation(speculative_config: dict[str, Any], method: str) -> tuple[int, TreeShape | None]:
    """(num_speculative_tokens, the token tree or None). A static tree (speculative_token_tree): the config may leave
    num_speculative_tokens out or give the node count (vLLM's meaning) or the depth. A dynamic one (topk,
    num_draft_tokens): num_speculative_tokens is its depth. The number returned is the tree's node count."""
    k = speculative_config.get("num_speculative_tokens")
    if (tree := DynamicTree.of_config(speculative_config) or TokenTree.of_config(speculative_config)) is not None:
        return tree.num_drafts, tree
    if k is None:
        raise ValueError(f"speculative_config for {method!r} needs num_speculative_tokens")
    return int(k), None


def _build_context(target: DraftTarget) -> ModelBuildContext:
    return ModelBuildContext(target.device, target.dtype, target.attention_backend)


def _load(head: nn.Module, tensors: dict[str, torch.Tensor], what: str, ignorable: set[str]) -> None:
    check_names(what, tensors, expected_checkpoint_names(head, STACKED_PARAMS), ignorable)
    weights = ((n, t) for n, t in tensors.items() if n not in ignorable)
    with torch.no_grad():
        load_params(head, weights, STACKED_PARAMS)
    head.requires_grad_(False)
    head.eval()


def _check_common(what: str, cfg: SimpleNamespace, tensors: dict[str, torch.Tensor], target: DraftTarget) -> None:
    target_vocab = target.vocab_size
    if cfg.vocab_size != target_vocab:
        raise CheckpointError(
            f"{what} was made for a vocabulary of {cfg.vocab_size} tokens (config.json vocab_size), "
            f"but the target has {target_vocab}"
        )
    if "embed_tokens.weight" in tensors:
        check_shape(what, "embed_tokens.weight", tensors["embed_tokens.weight"], (target_vocab, cfg.hidden_size),
                    "vocab x hidden size")
    elif cfg.hidden_size != target.hidden_size:
        raise CheckpointError(
            f"{what} has hidden_size {cfg.hidden_size} but no embed_tokens of its own, and the target's "
            f"embeddings are {target.hidden_size} wide"
        )


@register_proposer("eagle", speculative_token_tree="tree?", topk="posint?", num_draft_tokens="posint?")
def build_eagle_proposer(speculative_config: dict[str, Any], target: DraftTarget) -> EagleProposer:
    path = head_dir(speculative_config, "eagle")
    what = f"EAGLE head {path}"
    k, tree = _speculation(speculative_config, "eagle")
    cfg = llama_like_config(read_json_config(path), path)
    tensors = read_head_tensors(path)
    if "midlayer.self_attn.q_proj.weight" in tensors or "d2t" in tensors:
        raise CheckpointError(f"{what} is in the EAGLE-3 layout (midlayer.*, d2t): use method 'eagle3'")
    target_hidden = target.hidden_size
    if cfg.hidden_size != target_hidden:
        raise CheckpointError(
            f"{what} has hidden_size {cfg.hidden_size} (config.json), but the target's hidden size is {target_hidden}"
        )
    _check_common(what, cfg, tensors, target)
    if "fc.weight" in tensors:
        check_shape(what, "fc.weight", tensors["fc.weight"], (cfg.hidden_size, 2 * target_hidden),
                    "hidden x [embedding; target feature]")
    head = EagleHead(cfg, _build_context(target), tensors)
    _load(head, tensors, what, {n for n in tensors if is_rotary_buffer(n)})
    return EagleProposer(head, target, num_speculative_tokens=k, vocab_size=target.vocab_size,
                         max_model_len=target.max_model_len, token_tree=tree)


def eagle3_aux_layers(
    speculative_config: dict[str, Any], head_config: dict[str, Any], num_layers: int
) -> tuple[int, ...]:
    """Target layers whose input streams EAGLE-3 fuses: the speculative_config's or head config's
    `eagle_aux_hidden_state_layer_ids`, else vLLM's default (2, L // 2, L - 3)."""
    ids = speculative_config.get("eagle_aux_hidden_state_layer_ids") or head_config.get(
        "eagle_aux_hidden_state_layer_ids"
    ) or (head_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    source = "eagle_aux_hidden_state_layer_ids"
    if not ids:
        ids, source = (2, num_layers // 2, num_layers - 3), f"the default (2, L // 2, L - 3) for L = {num_layers}"
    ids = tuple(int(i) for i in ids)
    if len(set(ids)) != len(ids) or not all(0 <= i <= num_layers for i in ids):
        raise ValueError(
            f"EAGLE-3 aux layers {ids} from {source} must be distinct and in [0, {num_layers}] for a target of "
            f"{num_layers} layers; set eagle_aux_hidden_state_layer_ids in speculative_config or the head's config.json"
        )
    return ids


def _draft_vocab_map(
    what: str, tensors: dict[str, torch.Tensor], draft_vocab: int, target_vocab: int
) -> torch.Tensor:  # [draft_vocab] int64: the target id of each draft id
    """d2t as target ids, checked: in range, one-to-one, and marked by t2d when the head ships it."""
    if "d2t" not in tensors:
        if draft_vocab != target_vocab:
            raise CheckpointError(f"{what} has draft_vocab_size {draft_vocab} != vocab_size {target_vocab} but no d2t")
        return torch.arange(draft_vocab)
    d2t = tensors["d2t"]
    check_shape(what, "d2t", d2t, (draft_vocab,), "one target-id offset per draft token")
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise CheckpointError(f"{what}: d2t has dtype {d2t.dtype}, expected integer offsets")
    mapped = torch.arange(draft_vocab) + d2t.long()
    if mapped.min() < 0 or mapped.max() >= target_vocab or mapped.unique().numel() != draft_vocab:
        raise CheckpointError(
            f"{what}: d2t maps draft ids outside the target vocabulary [0, {target_vocab}) or onto one id twice"
        )
    if "t2d" in tensors:
        check_shape(what, "t2d", tensors["t2d"], (target_vocab,), "one flag per target token")
        expect = torch.zeros(target_vocab, dtype=torch.bool)
        expect[mapped] = True
        if not torch.equal(tensors["t2d"].bool(), expect):
            raise CheckpointError(f"{what}: t2d does not mark exactly the target ids that d2t maps to")
    return mapped


@register_proposer("eagle3", eagle_aux_hidden_state_layer_ids="ints?", speculative_token_tree="tree?", topk="posint?",
                   num_draft_tokens="posint?")
def build_eagle3_proposer(speculative_config: dict[str, Any], target: DraftTarget) -> EagleProposer:
    path = head_dir(speculative_config, "eagle3")
    what = f"EAGLE-3 head {path}"
    k, tree = _speculation(speculative_config, "eagle3")
    raw = read_json_config(path)
    cfg = llama_like_config(raw, path)
    tensors = read_head_tensors(path)
    if "fc.weight" not in tensors or not any(n.startswith("midlayer.") for n in tensors):
        raise CheckpointError(f"{what} has no fc.weight / midlayer.*: not an EAGLE-3 checkpoint "
                              "(EAGLE-1 heads use method 'eagle')")
    if cfg.num_hidden_layers != 1:
        raise CheckpointError(
            f"{what}: num_hidden_layers is {cfg.num_hidden_layers}; the published layout has one midlayer"
        )
    _check_common(what, cfg, tensors, target)
    target_vocab, target_hidden = target.vocab_size, target.hidden_size
    head_target_hidden = raw.get("target_hidden_size") or cfg.hidden_size
    if head_target_hidden != target_hidden:
        raise CheckpointError(
            f"{what} fuses target features of size {head_target_hidden} (config.json "
            f"{'target_hidden_size' if raw.get('target_hidden_size') else 'hidden_size'}), "
            f"but the target's hidden size is {target_hidden}"
        )
    aux = eagle3_aux_layers(speculative_config, raw, target.num_hidden_layers)
    check_shape(what, "fc.weight", tensors["fc.weight"], (cfg.hidden_size, len(aux) * target_hidden),
                f"hidden x {len(aux)} fused target layers of size {target_hidden}")
    draft_vocab = int(raw.get("draft_vocab_size") or target_vocab)
    own_lm_head = "lm_head.weight" in tensors
    if own_lm_head:
        check_shape(what, "lm_head.weight", tensors["lm_head.weight"], (draft_vocab, cfg.hidden_size),
                    "draft_vocab_size x hidden size")
    elif draft_vocab != target_vocab or cfg.hidden_size != target_hidden:
        raise CheckpointError(f"{what} has no lm_head.weight, and the target's lm_head does not fit its "
                              f"draft vocabulary ({draft_vocab}) or hidden size ({cfg.hidden_size})")
    mapped = _draft_vocab_map(what, tensors, draft_vocab, target_vocab)
    head = Eagle3Head(cfg, _build_context(target), tensors, len(aux) * target_hidden, draft_vocab, target_vocab)
    _load(head, tensors, what, {"d2t", "t2d"} | {n for n in tensors if is_rotary_buffer(n)})
    head.draft_to_target.copy_(mapped)
    return EagleProposer(head, target, num_speculative_tokens=k, vocab_size=target_vocab,
                         max_model_len=target.max_model_len, aux_hidden_state_layers=aux, token_tree=tree)
