"""DeepSeek multi-token-prediction (MTP) layers as a speculative proposer: `"method": "mtp"` (or `"deepseek_mtp"`).

Layout (DeepSeek-V3's published checkpoint; vLLM's `deepseek_mtp.py` reads the same names). The target's own
checkpoint holds `num_nextn_predict_layers` (config.json) decoder layers after its last, at L = num_hidden_layers:
    model.layers.{L}.enorm.weight              [H]      RMSNorm of the next token's embedding
    model.layers.{L}.hnorm.weight              [H]      RMSNorm of the hidden state it reads
    model.layers.{L}.eh_proj.weight            [H, 2H]  over [enorm(embedding); hnorm(hidden)]
    model.layers.{L}.shared_head.norm.weight   [H]
    model.layers.{L}.shared_head.head.weight   [V, H]   optional: else the target's lm_head
    model.layers.{L}.embed_tokens.weight       [V, H]   optional: else the target's embedding
    model.layers.{L}.input_layernorm.weight, post_attention_layernorm.weight, self_attn.* (MLA), mlp.*: a DeepSeek
        decoder layer whose MLP is dense or routed experts by the target's own rule for layer index L.
transformers drops these layers when it loads or saves a model, so they are read from the safetensors files.

The step (as vLLM runs it): row t reads x[t+1] (its embedding zeroed at position 0, as vLLM does) and a hidden
state h_t, first the target's final normed one: h' = eh_proj([enorm(embed(x[t+1])); hnorm(h_t)]); the decoder
layer at position t (its own paged MLA cache) gives the stream s_t = output + residual; shared_head.head(
shared_head.norm(s_t)) are the logits of x[t+2]. Chained drafting feeds s_t back as the next row's h. That is
EAGLE-1's protocol, so the proposer is `spec_decode.eagle.EagleProposer` over this head: the entry over each step's
verified rows, the chain, the CUDA graphs of whole drafting steps and `propose_on_device` apply unchanged.

Every draft comes from the first MTP layer, as in vLLM's v1 proposer (it never passes the model a step index): the
cache of layer i > 0 over the prefix would need layer i - 1's outputs there, which a chain does not compute.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from research_lm.models.base import CheckpointError, ModelBuildContext, build_scope, is_rotary_buffer
from research_lm.models.deepseek import (
    MLP_STACKED,
    Q_LORA_STACKED,
    SHARED_EXPERT_RENAMES,
    DeepseekDecoderLayer,
    DeepseekV2ForCausalLM,
)
from research_lm.models.layers import (
    Linear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    compute_logits,
    rope_parameters,
)
from research_lm.models.loader import checkpoint_files, iter_checkpoint, load_config, resolve_model_path
from research_lm.models.registry import resolve_architecture
from research_lm.moe.weights import load_moe_params
from research_lm.worker.spec import DraftTarget, register_proposer
from spec_decode.eagle import EagleProposer

# Checkpoint names of an MTP layer's own modules; every other tensor of the layer belongs to its decoder layer.
_OWN_MODULES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
_SAFETENSORS_INDEX = "model.safetensors.index.json"


class SharedHead(nn.Module):
    """shared_head.norm, and shared_head.head where the checkpoint has one (else the target's lm_head serves)."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = ParallelLMHead(vocab_size, hidden_size) if own_head else None


class MtpHead(nn.Module):
    """One DeepSeek MTP layer: enorm, hnorm, eh_proj, the decoder layer (`mtp_block`, vLLM's name), shared_head."""

    def __init__(self, hf_config: Any, layer_idx: int, rope_interleave: bool, build: ModelBuildContext,
                 own_embed: bool, own_head: bool):
        super().__init__()
        hidden, vocab, eps = hf_config.hidden_size, hf_config.vocab_size, hf_config.rms_norm_eps
        with build_scope(build):
            self.enorm = RMSNorm(hidden, eps)
            self.hnorm = RMSNorm(hidden, eps)
            self.eh_proj = Linear(2 * hidden, hidden)
            self.mtp_block = DeepseekDecoderLayer(hf_config, layer_idx, rope_interleave, build)
            self.shared_head = SharedHead(hidden, vocab, eps, own_head)
            self.embed_tokens = VocabParallelEmbedding(vocab, hidden) if own_embed else None
            self.rotary_emb = RotaryEmbedding(hf_config.qk_rope_head_dim, rope_parameters(hf_config),
                                              hf_config.max_position_embeddings)

    @property
    def fc(self) -> Linear:
        """The input projection under EAGLE's name: EagleProposer sizes its graphs' feature buffers from it."""
        return self.eh_proj

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] embedding of x[t+1]
        features: torch.Tensor,  # [T, H] the target's normed hidden state at t, or the previous draft's stream
        positions: torch.Tensor,  # [T] int64
        attn_metadata: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (shared_head.norm of the stream, the stream), [T, H] each
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)  # vLLM's mask (a select: graph-capturable)
        hidden = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(features.to(embeds.dtype))], dim=-1))
        hidden, residual = self.mtp_block(hidden, None, self.rotary_emb(positions), attn_metadata)
        return self.shared_head.norm(hidden, residual)


class MtpProposer(EagleProposer):
    """EagleProposer whose logits come from the MTP layer's shared_head.head where the checkpoint has one."""

    def _logits(self, out: torch.Tensor) -> torch.Tensor:  # [n, H] after shared_head.norm -> [n, vocab] fp32
        head = self.head.shared_head.head
        return self.target_logits(out) if head is None else compute_logits(head, out)


# ---------------------------------------------------------------------------------------------------
# Loading


def target_checkpoint(speculative_config: dict[str, Any], target: DraftTarget) -> Path:
    """The directory holding the MTP layers: `speculative_config["model"]` where given, else the target's own (vLLM's
    default for MTP)."""
    if speculative_config.get("model"):
        return resolve_model_path(speculative_config["model"])
    if target.model_path is None:
        raise ValueError("speculative_config for 'mtp' needs 'model' here: the checkpoint directory holding the MTP "
                         "layers (the target's own checkpoint is not known)")
    return Path(target.model_path)


def _rope_interleave(path: Path, hf_config: Any) -> bool:
    """DeepSeek's RoPE layout for this config; refuses targets of other families (they have no MTP layout here)."""
    try:
        arch, model_cls = resolve_architecture(hf_config)
    except ValueError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from e
    if not issubclass(model_cls, DeepseekV2ForCausalLM):
        raise ValueError(f"method 'mtp' drafts with DeepSeek-V2/V3 multi-token-prediction layers; the checkpoint "
                         f"{path} is a {arch}")
    return model_cls.rope_interleave(hf_config)


def _layer_sources(path: Path, prefix: str) -> dict[Path, list[str] | None]:
    """Weight file -> the checkpoint names under `prefix` it holds (None: find them in the file). With a safetensors
    index only the shards it maps those names to are opened (a full-size target has hundreds of gigabytes)."""
    index = path / _SAFETENSORS_INDEX
    if not index.is_file():
        return {f: None for f in checkpoint_files(path)}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot read the shard index {index}: {e}") from e
    sources: dict[Path, list[str] | None] = {}
    for name, file in weight_map.items():
        if name.startswith(prefix):
            sources.setdefault(path / file, []).append(name)
    return sources


def read_layer_tensors(path: Path, layer: int) -> dict[str, torch.Tensor]:
    """Every `model.layers.{layer}.*` tensor of the checkpoint at `path`, named without that prefix, on CPU."""
    from safetensors import SafetensorError, safe_open

    prefix = f"model.layers.{layer}."
    out: dict[str, torch.Tensor] = {}
    for file, names in _layer_sources(path, prefix).items():
        if file.suffix != ".safetensors":  # pickles load whole, weights-only
            out.update((n[len(prefix):], t) for n, t in iter_checkpoint([file]) if n.startswith(prefix))
            continue
        try:
            with safe_open(file, framework="pt", device="cpu") as reader:
                for name in names if names is not None else [n for n in reader.keys() if n.startswith(prefix)]:
                    out[name[len(prefix):]] = reader.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from e
    return out


def _checkpoint_name(name: str) -> str:
    """A layer tensor's name in `MtpHead`: the decoder layer's sit under `mtp_block.` (vLLM's rewrite)."""
    return name if name.startswith(_OWN_MODULES) else f"mtp_block.{name}"


def load_mtp_head(path: Path, target: DraftTarget) -> tuple[MtpHead, int]:
    """The first MTP layer of the checkpoint at `path`, built for `target` and loaded; and the checkpoint's
    num_nextn_predict_layers."""
    hf_config = load_config(path, target.trust_remote_code)
    rope_interleave = _rope_interleave(path, hf_config)
    num_mtp = int(getattr(hf_config, "num_nextn_predict_layers", None) or 0)
    if num_mtp < 1:
        raise CheckpointError(f"{path / 'config.json'} sets no num_nextn_predict_layers: the checkpoint has no MTP "
                              "layers (experiment=train_mtp adds one)")
    if (hf_config.hidden_size, hf_config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise CheckpointError(f"the MTP layers of {path} are for hidden size {hf_config.hidden_size} and vocabulary "
                              f"{hf_config.vocab_size}; the target has {target.hidden_size} and {target.vocab_size}")
    layer = hf_config.num_hidden_layers
    tensors = read_layer_tensors(path, layer)
    if "eh_proj.weight" not in tensors:
        raise CheckpointError(f"{path} lacks model.layers.{layer}.eh_proj.weight: config.json counts "
                              f"{num_mtp} MTP layer(s) after layer {layer - 1}, but the weight files hold none")
    build = ModelBuildContext(target.device, target.dtype, target.attention_backend, dict(target.model_extra))
    head = MtpHead(hf_config, layer, rope_interleave, build, own_embed="embed_tokens.weight" in tensors,
                   own_head="shared_head.head.weight" in tensors)
    stacked = MLP_STACKED + (Q_LORA_STACKED if getattr(hf_config, "q_lora_rank", None) else ())
    with torch.no_grad():
        loaded = load_moe_params(head, ((_checkpoint_name(n), t) for n, t in tensors.items()), stacked,
                                 is_rotary_buffer, renames=SHARED_EXPERT_RENAMES)
    missing = sorted(name for name, _ in head.named_parameters() if name not in loaded)
    if missing:
        raise CheckpointError(f"MTP layer model.layers.{layer} of {path} lacks {len(missing)} tensors it needs, "
                              f"e.g. {missing[:5]} (names under mtp_block. are the decoder layer's)")
    return head.requires_grad_(False).eval(), num_mtp


@register_proposer("deepseek_mtp")
@register_proposer("mtp")
def build_mtp_proposer(speculative_config: dict[str, Any], target: DraftTarget) -> MtpProposer:
    """k defaults to num_nextn_predict_layers, as in vLLM."""
    head, num_mtp = load_mtp_head(target_checkpoint(speculative_config, target), target)
    k = speculative_config.get("num_speculative_tokens") or num_mtp
    return MtpProposer(head, target, num_speculative_tokens=int(k), vocab_size=target.vocab_size,
                       max_model_len=target.max_model_len)
