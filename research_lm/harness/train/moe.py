"""`train_moe`: a small Qwen3-MoE, Qwen2-MoE (a shared expert) or DeepSeek-V2 trained from scratch on the corpus.

    result = train_moe(TrainConfig(output_dir="outputs/train/moe", steps=300), architecture="Qwen3MoeForCausalLM",
                       init_dir="outputs/train/moe_init")
    LLM(str(result.output_dir), eplb_config={"record_trace": "code.npz"})

The loss is the next-token cross-entropy plus the architecture's own load-balancing auxiliary loss
(transformers' Switch-style `load_balancing_loss_func` over every MoE layer, times `router_aux_loss_coef`,
0.001 by default: the coefficient Qwen ships, and DeepSeek-V2-Lite's `aux_loss_alpha`). transformers' DeepSeek-V2
forward returns neither that term nor a coefficient, so the objective computes the same loss from its routers' logits.
DeepSeek-V2 (multi-head latent attention) sizes its MLA from `head_dim` as the released models do (DEEPSEEK_SHAPE);
with `first_k_dense_replace` above num_hidden_layers every layer, and an MTP layer added later, is a dense MLP:
a DeepSeek target for `experiment=train_mtp` that trains as fast as a Llama. A stronger coefficient flattens the routing
skew this model exists to show, so the recipe keeps the default unless `model.router_aux_loss_coef` says
otherwise, and records the value used. The output is a Hugging Face checkpoint plus recipe.json (corpus hash,
seed, steps, losses, the full MoE shape); `init_dir` gets the same model before its first step (the
random-init baseline of a routing comparison).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from research_lm.harness.train.artifacts import TrainResult, summarize, write_json, write_recipe
from research_lm.harness.train.config import TrainConfig
from research_lm.harness.train.data import PackedData, load_corpus
from research_lm.harness.train.loop import fit
from research_lm.harness.train.target import save_hf_checkpoint
from research_lm.models.loader import resolve_model_path

# architecture -> its transformers config class; the Qwen ones are served by research_lm.models.qwen_moe, DeepSeek-V2
# by research_lm.models.deepseek.
ARCHITECTURES = {"Qwen3MoeForCausalLM": "Qwen3MoeConfig", "Qwen2MoeForCausalLM": "Qwen2MoeConfig",
                 "DeepseekV2ForCausalLM": "DeepseekV2Config"}
DEEPSEEK = "DeepseekV2ForCausalLM"
# Keys `train.model` may set. The defaults: tiny-llama's attention, 16 experts of 96, top-2, Qwen3's
# renormalised top-k weights; Qwen2-MoE adds a shared expert of 4 x moe_intermediate_size (Qwen1.5-MoE's ratio).
DEFAULT_SHAPE: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": None,
    "shared_expert_intermediate_size": None,
}  # fmt: skip
SHARED_EXPERT_RATIO = 4  # Qwen2-MoE default shared expert: this x moe_intermediate_size
# DeepSeek-V2's own keys (None: derived from head_dim in DeepSeek-V2's ratios: qk_nope_head_dim = v_head_dim =
# head_dim (128), qk_rope_head_dim = head_dim / 2 (64), kv_lora_rank = 4 x head_dim (512); no q_lora, as V2-Lite).
# For DeepSeek, num_key_value_heads is num_attention_heads (MLA has no KV heads; DeepSeek's configs set them equal),
# norm_topk_prob is false (transformers' V2 router never renormalises, so true would serve other weights than it
# trained), greedy top-k routing, and the Qwen-only keys below are refused.
DEEPSEEK_SHAPE: dict[str, Any] = {
    "q_lora_rank": None, "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None,
    "v_head_dim": None, "first_k_dense_replace": 0, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
}  # fmt: skip
QWEN_ONLY = ("decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size")
DEFAULT_AUX_LOSS_COEF = 0.001  # Qwen's router_aux_loss_coef default; DeepSeek-V2-Lite's aux_loss_alpha


def moe_config(tokenizer: Any, architecture: str, shape: dict[str, Any] | None = None):
    """The transformers config of `architecture`: `shape` over DEFAULT_SHAPE (and DEEPSEEK_SHAPE for DeepSeek-V2;
    None values keep the architecture's own default), vocabulary and special tokens from `tokenizer`."""
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"train.architecture {architecture!r} is not a MoE we train; choose one of "
                         f"{sorted(ARCHITECTURES)}")
    shape = dict(shape or {})
    unknown = sorted(set(shape) - set(DEFAULT_SHAPE) - set(DEEPSEEK_SHAPE))
    if unknown:
        raise ValueError(f"unknown train.model key(s) {unknown}; valid ones: "
                         f"{sorted(DEFAULT_SHAPE)} and DeepSeek-V2's {sorted(DEEPSEEK_SHAPE)}")
    kwargs = deepseek_shape(shape) if architecture == DEEPSEEK else qwen_shape(architecture, shape)
    if kwargs["num_experts_per_tok"] > kwargs["num_experts"]:
        raise ValueError(f"train.model.num_experts_per_tok ({kwargs['num_experts_per_tok']}) exceeds "
                         f"num_experts ({kwargs['num_experts']})")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config_class = getattr(transformers, ARCHITECTURES[architecture])
    config = config_class(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, **kwargs)
    config.architectures = [architecture]
    return config


def qwen_shape(architecture: str, shape: dict[str, Any]) -> dict[str, Any]:
    """The config keywords of a Qwen MoE: DEFAULT_SHAPE under `shape`'s non-None values (None: the config's default)."""
    given = {k: v for k, v in shape.items() if v is not None}
    deepseek = sorted(set(given) & set(DEEPSEEK_SHAPE))
    if deepseek:
        raise ValueError(f"train.model {deepseek}: DeepSeek-V2 key(s); use train.architecture={DEEPSEEK}")
    merged = {**DEFAULT_SHAPE, **given}
    if architecture == "Qwen2MoeForCausalLM" and merged["shared_expert_intermediate_size"] is None:
        merged["shared_expert_intermediate_size"] = SHARED_EXPERT_RATIO * merged["moe_intermediate_size"]
    if architecture == "Qwen3MoeForCausalLM" and merged.pop("shared_expert_intermediate_size") is not None:
        raise ValueError("train.model.shared_expert_intermediate_size: Qwen3-MoE has no shared expert; "
                         "use train.architecture=Qwen2MoeForCausalLM")
    return {k: v for k, v in merged.items() if v is not None}


def deepseek_shape(shape: dict[str, Any]) -> dict[str, Any]:
    """The DeepseekV2Config keywords: DEFAULT_SHAPE (less QWEN_ONLY) and DEEPSEEK_SHAPE under `shape`'s non-None
    values, the MLA sizes derived from head_dim where unset (DEEPSEEK_SHAPE's comment)."""
    given = {k: v for k, v in shape.items() if v is not None}
    qwen = sorted(k for k in QWEN_ONLY if k in given)
    if qwen:
        raise ValueError(f"train.model {qwen}: Qwen MoE key(s); DeepSeek-V2 keeps its first first_k_dense_replace "
                         "layers dense and sizes its shared experts with n_shared_experts")
    if given.get("norm_topk_prob"):
        raise ValueError("train.model.norm_topk_prob: transformers' DeepSeek-V2 router never renormalises the top-k "
                         "weights, so the trained model would not be the one served; set it false or null")
    merged = {**{k: v for k, v in DEFAULT_SHAPE.items() if k not in QWEN_ONLY}, **DEEPSEEK_SHAPE,
              "norm_topk_prob": False, "router_aux_loss_coef": DEFAULT_AUX_LOSS_COEF, **given}
    head_dim = merged.pop("head_dim")
    derived = {"qk_nope_head_dim": head_dim, "v_head_dim": head_dim, "qk_rope_head_dim": head_dim // 2,
               "kv_lora_rank": 4 * head_dim}
    merged.update({k: v for k, v in derived.items() if merged[k] is None})
    merged["num_key_value_heads"] = merged["num_attention_heads"]
    return {**merged, "topk_method": "greedy"}  # q_lora_rank stays None: DeepseekV2Config's default is 1536


def build_moe(config, seed: int) -> torch.nn.Module:
    """transformers' model for `config`, initialised under `torch.manual_seed(seed)`."""
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, config.architectures[0])(config)


def expert_load_ratio(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Mean over MoE layers of max / mean tokens per expert in this batch (1 = balanced; 0-d, no grad).
    router_logits: per layer [tokens, num_experts]."""
    ratios = []
    for logits in router_logits:
        ids = logits.detach().topk(top_k, dim=-1).indices.flatten()  # softmax is monotone: same top-k
        counts = torch.bincount(ids, minlength=logits.shape[-1]).float()
        ratios.append(counts.max() / counts.mean())
    return torch.stack(ratios).mean()


class MoeLMObjective:
    """Cross-entropy + router_aux_loss_coef x the load-balancing loss (the architecture's own forward)."""

    reports_ppl = False  # "loss" includes the aux term; lm_loss is the cross-entropy

    def __init__(self, model: torch.nn.Module):
        self.module = model
        self.coef = float(model.config.router_aux_loss_coef)
        self.top_k = int(model.config.num_experts_per_tok)
        self.num_experts = int(model.config.num_experts)

    def loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = self.module(input_ids=input_ids, labels=input_ids, use_cache=False, output_router_logits=True)
        lm_loss, aux = self.cross_entropy_and_aux(out)
        metrics = {"lm_loss": lm_loss.detach(), "aux_loss": aux.detach()}
        router_logits = getattr(out, "router_logits", None)  # (a dense DeepSeek-V2 in transformers 5.17 has none)
        if router_logits:
            metrics["expert_load_max_over_mean"] = expert_load_ratio(router_logits, self.top_k)
        return lm_loss + self.coef * aux, metrics

    def cross_entropy_and_aux(self, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(next-token cross-entropy, load-balancing loss), 0-d. Qwen's forward adds coef x aux into out.loss;
        DeepSeek-V2's returns the cross-entropy alone, so the same Switch loss comes from its routers' logits
        (0 when every layer is dense). transformers 5.17's DeepSeek-V2 output has neither field."""
        aux_loss = getattr(out, "aux_loss", None)
        if aux_loss is not None:
            return out.loss - self.coef * aux_loss, aux_loss
        if not getattr(out, "router_logits", None):
            return out.loss, out.loss.new_zeros(())
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        return out.loss, load_balancing_loss_func(out.router_logits, self.num_experts, self.top_k)


def train_moe(cfg: TrainConfig, *, architecture: str = "Qwen3MoeForCausalLM", tokenizer: str = "tiny-llama",
              model: dict[str, Any] | None = None, init_dir: str | None = None, logger: Any = None) -> TrainResult:
    """Train a MoE of `architecture` and shape `model` (DEFAULT_SHAPE) with `tokenizer`'s vocabulary;
    write the untrained weights to `init_dir` too when given."""
    from transformers import AutoTokenizer

    tok_dir = resolve_model_path(tokenizer)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    corpus = load_corpus(tok_dir, corpus_bytes=cfg.corpus_bytes, pydoc=cfg.pydoc, cache_dir=cfg.cache_dir)
    data = PackedData(corpus, cfg.seq_len, cfg.val_percent)
    config = moe_config(tok, architecture, model)
    if cfg.seq_len > config.max_position_embeddings:
        raise ValueError(f"train.seq_len ({cfg.seq_len}) exceeds max_position_embeddings "
                         f"({config.max_position_embeddings})")
    lm = build_moe(config, cfg.seed)
    if init_dir is not None:
        save_hf_checkpoint(lm, tok, Path(init_dir), cfg.torch_save_dtype)
        write_json(Path(init_dir) / "recipe.json", {
            "weights": f"random: transformers' init under torch.manual_seed({cfg.seed}), the step-0 state of "
                       f"{cfg.output_dir}", "architecture": architecture, "seed": cfg.seed, "tokenizer": str(tok_dir)})
    lm = lm.to(cfg.resolve_device())
    result = fit(MoeLMObjective(lm), data, cfg, logger)
    out = Path(cfg.output_dir)
    save_hf_checkpoint(lm, tok, out, cfg.torch_save_dtype)
    val_lm = result.val.get("lm_loss")
    summary = summarize("train_moe", cfg, result, corpus, out, sum(p.numel() for p in lm.parameters()), {
        "architecture": architecture, "router_aux_loss_coef": float(config.router_aux_loss_coef),
        "final_val_ppl": math.exp(min(val_lm, 50.0)) if val_lm is not None else None,
        "val_docs": data.num_val_docs, "init_dir": init_dir})
    write_recipe(out, summary, cfg, {"tokenizer": str(tok_dir), "model": {
        k: getattr(config, k) for k in {**DEFAULT_SHAPE, **DEEPSEEK_SHAPE} if hasattr(config, k)}})
    return TrainResult(out, summary, result)
