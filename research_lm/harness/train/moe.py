"""`train_moe`: a small Qwen3-MoE (or Qwen2-MoE, with a shared expert) trained from scratch on the corpus.

    result = train_moe(TrainConfig(output_dir="outputs/train/moe", steps=300), architecture="Qwen3MoeForCausalLM",
                       init_dir="outputs/train/moe_init")
    LLM(str(result.output_dir), eplb_config={"record_trace": "code.npz"})

The loss is the next-token cross-entropy plus the architecture's own load-balancing auxiliary loss
(transformers' Switch-style `load_balancing_loss_func` over every MoE layer, times `router_aux_loss_coef`,
0.001 by default for both families: the coefficient Qwen ships). A stronger coefficient flattens the routing
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

# architecture -> its transformers config class; both are served by research_lm.models.qwen_moe.
ARCHITECTURES = {"Qwen3MoeForCausalLM": "Qwen3MoeConfig", "Qwen2MoeForCausalLM": "Qwen2MoeConfig"}
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


def moe_config(tokenizer: Any, architecture: str, shape: dict[str, Any] | None = None):
    """The transformers config of `architecture`: `shape` over DEFAULT_SHAPE (None values keep the
    architecture's own default), vocabulary and special tokens from `tokenizer`."""
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"train.architecture {architecture!r} is not a MoE we train; choose one of "
                         f"{sorted(ARCHITECTURES)}")
    shape = dict(shape or {})
    unknown = sorted(set(shape) - set(DEFAULT_SHAPE))
    if unknown:
        raise ValueError(f"unknown train.model key(s) {unknown}; valid ones: {sorted(DEFAULT_SHAPE)}")
    merged = {**DEFAULT_SHAPE, **{k: v for k, v in shape.items() if v is not None}}
    if architecture == "Qwen2MoeForCausalLM" and merged["shared_expert_intermediate_size"] is None:
        merged["shared_expert_intermediate_size"] = SHARED_EXPERT_RATIO * merged["moe_intermediate_size"]
    if architecture == "Qwen3MoeForCausalLM" and merged.pop("shared_expert_intermediate_size") is not None:
        raise ValueError("train.model.shared_expert_intermediate_size: Qwen3-MoE has no shared expert; "
                         "use train.architecture=Qwen2MoeForCausalLM")
    if merged["num_experts_per_tok"] > merged["num_experts"]:
        raise ValueError(f"train.model.num_experts_per_tok ({merged['num_experts_per_tok']}) exceeds "
                         f"num_experts ({merged['num_experts']})")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config_class = getattr(transformers, ARCHITECTURES[architecture])
    config = config_class(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=pad,
                          **{k: v for k, v in merged.items() if v is not None})
    config.architectures = [architecture]
    return config


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

    def loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = self.module(input_ids=input_ids, labels=input_ids, use_cache=False, output_router_logits=True)
        metrics = {"lm_loss": (out.loss - self.coef * out.aux_loss).detach(), "aux_loss": out.aux_loss.detach(),
                   "expert_load_max_over_mean": expert_load_ratio(out.router_logits, self.top_k)}
        return out.loss, metrics


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
        k: getattr(config, k) for k in DEFAULT_SHAPE if hasattr(config, k)}})
    return TrainResult(out, summary, result)
