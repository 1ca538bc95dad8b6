"""DeepSeek-V2 / V3: multi-head latent attention (attention_zoo.mla) with a dense or MoE MLP per layer.

The decoder loop, embeddings and LM head are the Llama family's (`DeepseekModel` subclasses
`LlamaModel`); what differs is the attention:
- q: `q_proj`, or the low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` when `q_lora_rank` is set
  (then `q_a_proj` and `kv_a_proj_with_mqa` run as one GEMM, `fused_qkv_a_proj`).
- kv: `kv_a_proj_with_mqa` gives the latent c [kv_lora_rank] and one shared rope key k_pe
  [qk_rope_head_dim]; the cache keeps norm(c) and rope(k_pe); `kv_b_proj` up-projects c to per-head
  k_nope and v (or, at decode, is absorbed into q and the output; see attention_zoo/mla.py).
- RoPE on the rope dims only, in DeepSeek's interleaved pair layout (V2 always; V3 when
  `rope_interleave`, the default): we de-interleave q_pe and k_pe and rotate halves, which permutes
  the rope dims of q and k alike and leaves every dot product unchanged.
- softmax scale (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as transformers).

Each layer's MLP comes from `make_mlp(hf_config, layer_idx, build)`: a dense gated MLP of `intermediate_size`
for the first `first_k_dense_replace` layers and for layers off the `moe_layer_freq` stride (every layer when
`n_routed_experts` is 0 or null); the others a `research_lm.moe.MoeBlock`:
- `n_routed_experts` experts of `moe_intermediate_size`, top `num_experts_per_tok`, router GEMM in fp32;
- V2: softmax scores; `topk_method` "greedy" (plain top-k) or "group_limited_greedy" (the best `topk_group`
  of `n_group` groups, scored by their max member); V3: sigmoid scores and "noaux_tc" (choice on scores +
  `e_score_correction_bias`, groups scored by their top-2 sum; the weights are the unbiased scores). The bias
  stays fp32 whatever the model dtype (as transformers' _keep_in_fp32_modules_strict and the reference).
  Other (scoring_func, topk_method) pairs are refused: neither the reference code nor transformers runs them;
- weights renormalised when `norm_topk_prob`, then times `routed_scaling_factor`. NOTE: transformers' V2
  router ignores norm_topk_prob, and DeepSeek's V2 reference skips the scaling when it renormalises; we
  follow vLLM (both). Every released V2 checkpoint has norm_topk_prob false, where all of them agree;
- `n_shared_experts` shared experts as one dense gated MLP of n_shared * moe_intermediate_size (biased when
  V2's `mlp_bias`), added to every token, ungated.
EPLB (`build.extra["eplb"]`): the block's `FusedMoE` holds experts + num_redundant_experts slots and reports
`num_groups` = n_group (1 without group-limited routing), which the EPLB controller hands the placement
policy (DeepSeek's hierarchical policy packs those groups onto nodes).
Checkpoints store experts per expert (`mlp.experts.E.{gate,up,down}_proj.weight`, as transformers 5.17 and
5.23 write them) or stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias` (V3) and `mlp.shared_experts.*` (read into `mlp.shared_expert.*`).
Tensors of layers beyond num_hidden_layers (V3's multi-token-prediction layer) are skipped.
Tensor parallelism (`build.tp`): the heads split (q_proj / q_b_proj and kv_b_proj by head, o_proj by its input);
the latent projections, their norms and the latent cache are replicated, as in vLLM: the cache holds one latent
"head" that every query head reads, so there is nothing per head to split, and each rank keeps the whole of it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attention_zoo.mla import MLAAttention, MLASpec
from research_lm.models.base import (
    ModelBuildContext,
    StackedParams,
    default_weight_loader,
    is_rotary_buffer,
    set_weight_loader,
)
from research_lm.models.layers import (
    ColumnParallelLinear,
    GatedMLP,
    Linear,
    MergedColumnParallelLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    _yarn_mscale,
    apply_rope,
    rope_parameters,
)
from research_lm.models.llama import LlamaForCausalLM, LlamaModel, PreNormDecoderLayer
from research_lm.models.registry import register_model
from research_lm.moe.config import MoeOptions
from research_lm.moe.layer import MoeBlock
from research_lm.moe.router import RouterConfig
from research_lm.moe.weights import load_moe_params
from research_lm.worker.parallel import split_size

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_MLA_BACKEND = "auto"
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps

MLP_STACKED: StackedParams = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
SHARED_EXPERT_RENAMES = ((".shared_experts.", ".shared_expert."),)  # checkpoint name part -> ours
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# architecture -> (its scoring_func, default topk_method, {topk_method: (group-limited, correction bias)}).
# Keyed by architecture, not model_type: V3-architecture checkpoints of other makers name their own model_type.
ROUTING: dict[str, tuple[str, str, dict[str, tuple[bool, bool]]]] = {
    "DeepseekV2ForCausalLM": ("softmax", "greedy", {"greedy": (False, False), "group_limited_greedy": (True, False)}),
    "DeepseekV3ForCausalLM": ("sigmoid", "noaux_tc", {"noaux_tc": (True, True)}),
}
Q_LORA_STACKED: StackedParams = (
    ("fused_qkv_a_proj", "q_a_proj", "q_a"),
    ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "kv_a"),
)


def mla_softmax_scale(hf_config: PretrainedConfig) -> float:
    """(nope + rope)^-0.5, times mscale^2 for scaled RoPE with `mscale_all_dim` (transformers' yarn_apply_mscale)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = params.get("factor") or hf_config.max_position_embeddings / params["original_max_position_embeddings"]
        mscale = _yarn_mscale(factor, mscale_all_dim)
        scale *= mscale * mscale
    return scale


def is_moe_layer(hf_config: PretrainedConfig, layer_idx: int) -> bool:
    """DeepSeek's rule: routed experts from layer `first_k_dense_replace` on, every `moe_layer_freq`-th."""
    if not getattr(hf_config, "n_routed_experts", None):
        return False
    first_dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
    return layer_idx >= first_dense and layer_idx % (getattr(hf_config, "moe_layer_freq", 1) or 1) == 0


def router_config(hf_config: PretrainedConfig) -> RouterConfig:
    """DeepSeek's routing rule for this config (module docstring); raises for what V2/V3 do not define."""
    archs = [a for a in getattr(hf_config, "architectures", None) or () if a in ROUTING]
    v3 = getattr(hf_config, "model_type", None) == "deepseek_v3"  # a config that names no architecture
    arch = archs[0] if archs else ("DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM")
    family_scoring, default_method, methods = ROUTING[arch]
    scoring = getattr(hf_config, "scoring_func", None) or family_scoring
    method = getattr(hf_config, "topk_method", None) or default_method
    if scoring != family_scoring or method not in methods:
        raise ValueError(
            f"{arch} routes with scoring_func {family_scoring!r} and topk_method in {sorted(methods)}; "
            f"this config asks for scoring_func {scoring!r}, topk_method {method!r}"
        )
    grouped, bias = methods[method]
    n_group = getattr(hf_config, "n_group", None) or 1
    return RouterConfig(
        top_k=hf_config.num_experts_per_tok,
        scoring_func=scoring,
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        num_expert_group=n_group if grouped and n_group > 1 else None,
        topk_group=getattr(hf_config, "topk_group", None) if grouped and n_group > 1 else None,
        routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),
        has_correction_bias=bias,
        logits_fp32=True,
    )


def make_mlp(hf_config: PretrainedConfig, layer_idx: int, build: ModelBuildContext) -> nn.Module:
    """The MLP of decoder layer `layer_idx`: [num_tokens, hidden] -> [num_tokens, hidden]."""
    act = getattr(hf_config, "hidden_act", "silu")
    bias = bool(getattr(hf_config, "mlp_bias", False))  # V2 only; V3 configs do not have it
    if not is_moe_layer(hf_config, layer_idx):
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, act, bias, build.tp)
    num_shared = getattr(hf_config, "n_shared_experts", None) or 0
    block = MoeBlock(
        hf_config.hidden_size, hf_config.moe_intermediate_size, hf_config.n_routed_experts,
        router_config(hf_config), MoeOptions.from_extra(build.extra, build.device),
        shared_intermediate_size=num_shared * hf_config.moe_intermediate_size, shared_expert_bias=bias,
        hidden_act=act,
    )
    gate = block.gate
    if gate.e_score_correction_bias is not None:  # fp32 in every model dtype: it decides the routing
        gate.e_score_correction_bias = nn.Parameter(
            torch.zeros(hf_config.n_routed_experts, dtype=torch.float32), requires_grad=False
        )
        set_weight_loader(gate.e_score_correction_bias, default_weight_loader)
    return block


class DeepseekAttention(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, rope_interleave: bool, build: ModelBuildContext):
        super().__init__()
        hidden, bias = hf_config.hidden_size, getattr(hf_config, "attention_bias", False)
        tp, num_heads = build.tp, hf_config.num_attention_heads
        self.num_heads = split_size(num_heads, tp, "num_attention_heads")  # this rank's heads
        self.q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        self.kv_lora_rank = hf_config.kv_lora_rank
        self.nope_dim, self.rope_dim = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        self.v_dim = hf_config.v_head_dim
        self.rope_interleave = rope_interleave
        q_out = num_heads * (self.nope_dim + self.rope_dim)  # per head [nope + rope]: column splits are by head
        latent = self.kv_lora_rank + self.rope_dim
        # The latent (and q_lora's q_c) feed every head: replicated on every rank, like the latent cache
        if self.q_lora_rank:
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                hidden, [self.q_lora_rank, latent], bias, shard_ids=("q_a", "kv_a")
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_out, tp=tp)
        else:
            self.q_proj = ColumnParallelLinear(hidden, q_out, tp=tp)
            self.kv_a_proj_with_mqa = Linear(hidden, latent, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, num_heads * (self.nope_dim + self.v_dim), tp=tp)
        self.o_proj = RowParallelLinear(num_heads * self.v_dim, hidden, bias, tp)
        spec = MLASpec.from_dims(
            num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.nope_dim,
            qk_rope_head_dim=self.rope_dim, v_head_dim=self.v_dim, scale=mla_softmax_scale(hf_config),
        )
        backend = build.extra.get("mla_backend") or DEFAULT_MLA_BACKEND
        self.attn = MLAAttention(spec, backend, build.device, build.dtype)

    def _rope(
        self,
        rope: Rope,
        q_pe: torch.Tensor,  # [num_tokens, num_heads, rope_dim]
        k_pe: torch.Tensor,  # [num_tokens, 1, rope_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...), (x1, x3, ...)
            q_pe, k_pe = (torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) for x in (q_pe, k_pe))
        return apply_rope(rope, q_pe, k_pe)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rope: Rope,
        attn_metadata: dict[str, Any],
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        if self.q_lora_rank:
            q_c, latent = self.fused_qkv_a_proj(hidden).split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim], -1)
            q = self.q_b_proj(self.q_a_layernorm(q_c))
        else:
            q, latent = self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self._rope(rope, q_pe, k_pe[:, None, :])
        q = torch.cat((q_nope, q_pe), dim=-1)  # [num_tokens, H, nope + rope]
        k_pe = k_pe[:, 0]  # [num_tokens, rope]
        out = self.attn(q, self.kv_a_layernorm(kv_c), k_pe, self.kv_b_proj.weight, attn_metadata)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, hf_config: PretrainedConfig, layer_idx: int, rope_interleave: bool, build: ModelBuildContext):
        attn = DeepseekAttention(hf_config, rope_interleave, build)
        super().__init__(hf_config.hidden_size, hf_config.rms_norm_eps, attn, make_mlp(hf_config, layer_idx, build))


class DeepseekModel(LlamaModel):
    """Llama's forward (embed, layers, final norm) over DeepSeek decoder layers."""

    def __init__(self, hf_config: PretrainedConfig, rope_interleave: bool, build: ModelBuildContext):
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, build.tp)
        self.rotary_emb = RotaryEmbedding(
            hf_config.qk_rope_head_dim, rope_parameters(hf_config), hf_config.max_position_embeddings
        )
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(hf_config, i, rope_interleave, build) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """`forward`, `compute_logits` and the embedding accessors are LlamaForCausalLM's."""

    @classmethod
    def rope_interleave(cls, hf_config: PretrainedConfig) -> bool:
        return True  # V2 rotates interleaved pairs (as complex numbers)

    def make_backbone(self, hf_config: PretrainedConfig, build: ModelBuildContext) -> nn.Module:
        return DeepseekModel(hf_config, self.rope_interleave(hf_config), build)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked = MLP_STACKED + (Q_LORA_STACKED if getattr(self.config, "q_lora_rank", None) else ())

        num_layers = self.config.num_hidden_layers

        def skip(name: str) -> bool:
            layer = _LAYER_INDEX.match(name)
            return (is_rotary_buffer(name) or (self.tie_word_embeddings and name == "lm_head.weight")
                    or (layer is not None and int(layer[1]) >= num_layers))  # V3's MTP layer(s)

        return load_moe_params(self, weights, stacked, skip, renames=SHARED_EXPERT_RENAMES)


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @classmethod
    def rope_interleave(cls, hf_config: PretrainedConfig) -> bool:
        return bool(getattr(hf_config, "rope_interleave", True))
