"""`train_head("mtp", ...)` / experiment=train_mtp: an MTP layer trained for a DeepSeek target, written into a copy of
the target's checkpoint in DeepSeek-V3's layout, which `speculative_config={"method": "mtp"}` drafts with.

Invariants:
- The copy holds the target's tensors unchanged plus model.layers.{L}.* (enorm, hnorm, eh_proj, shared_head.norm/head,
  embed_tokens and a decoder layer with exactly the tensors of the target's own layers of that MLP kind: experts one
  tensor per expert and projection), all named by the index; config.json counts one MTP layer.
- The drafter's forward (spec_decode.mtp, our MLA and MoE layers over a paged cache) equals the training forward
  (transformers' decoder layer) on the same rows, dense and routed: the layout round-trips.
- A briefly trained layer drafts losslessly and is accepted more often than the untrained one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from research_lm import LLM, SamplingParams
from research_lm.harness.experiment import AcceptanceMetrics
from research_lm.harness.train import TrainConfig, train_head
from research_lm.harness.train.heads import build_objective
from research_lm.harness.train.mtp import MTP_WEIGHTS, SAFETENSORS_INDEX, MtpObjective
from research_lm.harness.train.target import save_hf_checkpoint
from research_lm.harness.train.teacher import FrozenTarget
from research_lm.models.loader import resolve_model_path
from tests.conftest import TINY_MODELS, TINY_SHAPE

REPO = Path(__file__).resolve().parents[2]
# The tiny DeepSeek-V2 of tests/conftest.py (MLA with q_lora, biases), over the built-in tokenizer's vocabulary; the
# MTP layer (index 2) is dense. The MoE one: DeepSeek-V3 routing, layer 1 and the MTP layer routed.
TARGETS = {
    "dense": ("DeepseekV2Config", {**TINY_MODELS["deepseek-v2"].overrides, "first_k_dense_replace": 3}),
    "moe": ("DeepseekV3Config", {**TINY_MODELS["deepseek-v3-moe"].overrides, "num_hidden_layers": 2}),
}


def build_target(kind: str, out: Path, seed: int = 0) -> Path:
    """A random DeepSeek checkpoint with the tiny-llama tokenizer; weights N(0, 0.1^2), norms 1 + N(0, 0.1^2), so its
    greedy continuations depend on every layer."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(resolve_model_path("tiny-llama"))
    config_class, overrides = TARGETS[kind]
    eos = tok.eos_token_id
    config = getattr(transformers, config_class)(**{**TINY_SHAPE, **overrides, "vocab_size": len(tok),
                                                    "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise)
    save_hf_checkpoint(model, tok, out, torch.float32)
    return out


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {kind: build_target(kind, root / kind) for kind in TARGETS}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt", device="cpu") as reader:
        return {name: reader.get_tensor(name) for name in reader.keys()}


def _layer(tensors: dict[str, torch.Tensor], i: int) -> dict[str, tuple[int, ...]]:
    prefix = f"model.layers.{i}."
    return {n.removeprefix(prefix): tuple(t.shape) for n, t in tensors.items() if n.startswith(prefix)}


@pytest.mark.parametrize("kind", list(TARGETS))
@torch.no_grad()
def test_layout_round_trips_into_the_drafter(kind, targets, train_kwargs, tmp_path):
    from research_lm.harness.train.data import PackedData, load_corpus
    from research_lm.worker.spec import DraftTarget
    from spec_decode.mtp import load_mtp_head
    from tests.utils import PagedBatch

    teacher = FrozenTarget(targets[kind], torch.device("cpu"))
    cfg = TrainConfig(output_dir=str(tmp_path / "mtp"), steps=1, **train_kwargs)
    corpus = load_corpus(teacher.path, corpus_bytes=cfg.corpus_bytes, pydoc=False, cache_dir=cfg.cache_dir)
    objective = build_objective("mtp", teacher, PackedData(corpus, cfg.seq_len, cfg.val_percent), {})
    gen = torch.Generator().manual_seed(1)
    for name, p in objective.module.named_parameters():  # every weight matters: no near-identity init
        noise = torch.randn(p.shape, generator=gen) * 0.1
        p.copy_(1.0 + noise if "norm" in name else noise)
    out = tmp_path / "mtp"
    objective.save(out, torch.float32)

    target, written = _tensors(targets[kind] / "model.safetensors"), _tensors(out / MTP_WEIGHTS)
    mtp = _layer(written, 2)
    own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
           "embed_tokens.weight"}
    assert {n: s for n, s in mtp.items() if n not in own} == _layer(target, 1)  # the last layer: same MLP kind
    h, v = teacher.hidden_size, teacher.vocab_size
    assert {n: mtp[n] for n in own} == {**dict.fromkeys(own - {"eh_proj.weight"}, (h,)), "eh_proj.weight": (h, 2 * h),
                                        "shared_head.head.weight": (v, h), "embed_tokens.weight": (v, h)}
    assert ("mlp.experts.7.up_proj.weight" in mtp) == (kind == "moe")
    weight_map = json.loads((out / SAFETENSORS_INDEX).read_text())["weight_map"]
    assert weight_map == dict.fromkeys(target, "model.safetensors") | dict.fromkeys(written, MTP_WEIGHTS)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert (out / "tokenizer.json").is_file()

    draft_target = DraftTarget(device=torch.device("cpu"), dtype=torch.float32, vocab_size=v, hidden_size=h,
                               num_hidden_layers=2, max_model_len=64, attention_backend="auto",
                               model_extra={"eplb": None}, trust_remote_code=False,
                               embed_tokens=teacher.model.get_input_embeddings(), compute_logits=None)
    head, num_mtp = load_mtp_head(out, draft_target)
    ids = torch.tensor([[5, 6, 7, 300, 8, 9, 10, 40, 41, 300, 12, 13]])
    t = ids.shape[1]
    feats = teacher.features(ids).hidden[0]
    embeds = F.embedding(torch.cat([ids[0, 1:], ids[0, :1]]), teacher.embed_weight)
    batch = PagedBatch(head, [t], block_size=4)
    for layer, cache in zip(batch.layers, batch.kv_caches, strict=True):
        layer.kv_cache = cache
    _, positions, md = batch.prepare([list(range(t))])
    normed, _ = head(embeds, feats, positions, md)
    masked = embeds.clone()
    masked[0] = 0.0
    want = objective.module.eval()(masked[None], feats[None], teacher.model.model.rotary_emb)[0]
    assert num_mtp == 1 and torch.allclose(normed, want, atol=1e-4), (normed - want).abs().max()


def _tau(path: Path, prompts: list[list[int]], want: list[list[int]]) -> float:
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(str(path), device="cpu", dtype="float32", speculative_config=spec)
    llm.engine.metrics = AcceptanceMetrics()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    return llm.engine.metrics.summary()["mean_acceptance_length"]


def test_brief_training_drafts_losslessly_and_raises_tau(targets, train_kwargs, tmp_path):
    target = targets["dense"]
    untrained = tmp_path / "untrained"
    torch.manual_seed(0)
    MtpObjective(FrozenTarget(target, torch.device("cpu"))).save(untrained, torch.float32)
    kwargs = {**train_kwargs, "batch_size": 4, "seq_len": 64, "save_every": 0}
    result = train_head("mtp", TrainConfig(output_dir=str(tmp_path / "mtp"), steps=40, **kwargs), target=str(target))
    assert result.summary["task"] == "train_mtp" and result.summary["final_val_acc_0"] > 0.05

    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 300, 40, 41, 300, 77, 12], [100, 3, 250, 17, 900]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(target), device="cpu", dtype="float32").generate(
        prompts, params, use_tqdm=False)]
    before, after = _tau(untrained, prompts, want), _tau(result.output_dir, prompts, want)
    assert after > before + 0.05, (before, after)


def test_a_target_of_another_family_is_refused(train_kwargs, tmp_path):
    with pytest.raises(ValueError, match="DeepSeek-V2/V3 target.*train.target"):
        train_head("mtp", TrainConfig(output_dir=str(tmp_path / "x"), steps=1, **train_kwargs), target="tiny-llama")


def test_train_mtp_preset_runs_from_the_cli(targets, tmp_path):
    args = ["experiment=train_mtp", "logger=none", "train.steps=2", "train.batch_size=2", "train.seq_len=32",
            "train.corpus_bytes=20000", "train.pydoc=false", "train.progress=false", "train.save_every=0",
            f"train.target={targets['dense']}", f"train.output_dir={tmp_path / 'mtp'}",
            f"train.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "research_lm", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["summary"]["task"] == "train_mtp" and results["summary"]["steps"] == 2
    assert json.loads((tmp_path / "mtp" / "config.json").read_text())["num_nextn_predict_layers"] == 1
