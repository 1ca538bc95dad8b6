"""Speculative decoding on a real model shape at a published acceptance (issue 30): TPOT of a Llama-3.1-8B shape,
plain vs speculative with acceptance replay, beside vLLM's published EAGLE-3 numbers.

    python experiments/bench_spec_transfer.py                      # on a CUDA GPU: the 8B table
    python experiments/bench_spec_transfer.py --profile outputs/<run>/acceptance_profile.json  # + a recorded profile
    python experiments/bench_spec_transfer.py --tiny --device cpu --backend torch_ref --dtype float32 \\
        --batches 1 2 --tokens 8 --requests 2 --prompt-len 16 --warmup-tokens 2                # a smoke run
    python -m experiments.paper spec_transfer_8b_h200              # the registered table

Acceptance and time, measured apart. The target has a real shape (`--shape`, Llama-3.1-8B) and random weights
(`load_format="dummy"`), bf16, triton, CUDA graphs, async scheduling, through the public API (`LLM(...).generate`).
Every drafter has a real shape and random weights too, written once as a checkpoint in its published layout under
`--cache-dir` (outputs/spec_transfer/, reused):
- eagle3: an EAGLE-3 head of the target's shape (one midlayer over [embedding; fused feature], the target's MLP
  width, fc over 3 x hidden, a draft vocabulary of `--draft-vocab` (32000) with d2t / t2d, its own lm_head);
- draft_model: a `--draft-shape` model (Llama-3.2-1B, the target's vocabulary);
- ngram (with `--ngram-profile`) and medusa (with `--medusa-profile`: one ResBlock and lm_head per draft position).
Random drafts are never accepted, so every speculative engine replays an acceptance profile
(research_lm/worker/acceptance_replay.py): the draft forwards, the verify forward of k + 1 tokens per request,
sampling, KV writes, graphs and async launch run for real; each request's accepted count comes from the profile,
so the outputs mean nothing and the times are real. vLLM issue #20780 publishes EAGLE-3's acceptance length on
Llama-3.1-8B (MT-bench, batch 1) per K (2.79 / 3.08 / 3.32 at K = 3 / 4 / 5) but not per position: each k replays
one i.i.d. rate fit to its K's length (`profile_from_tau`; the K = 4 one ships as
research_lm/assets/profiles/vllm_eagle3_llama31_8b_mtbench_k4.json). `--profile` adds EAGLE-3 cells at a given
profile (e.g. our trained pair's, recorded with `record_acceptance=true`); the draft model replays vLLM's EAGLE-3
profile unless `--draft-profile` gives its own. A profile of fewer positions than k is skipped at that k.

Each cell (a method at k drafts, or plain decoding) is one engine serving each batch size of `--batches` in turn
(graphs captured at those sizes), greedy, `--tokens` output tokens per request (ignore_eos), the same prompts and
seeds in every cell: batch b serves ceil(`--requests` / b) rounds of b requests. Prompts: `--prompt-len` token ids,
a random block of `--period` ids repeated, so an n-gram drafter finds matches; its cells replay with
`acceptance_replay_echo` = `--period` (the token after the kept drafts repeats the block), so it keeps finding them
after the replay's tokens, as it finds real text's repeats in the run its profile came from. Per cell and batch size:
- TPOT: vLLM's mean time per output token over the requests, (finish - first token) / (tokens - 1);
- tok/s: output tokens / the rounds' wall time (prefill included);
- speedup: plain TPOT / this TPOT, plain decoding measured in the same repeat of this process;
- tau: 1 + accepted / verifications over the requests' verify steps (each request's last one left out: max_tokens
  cuts it short), beside the profile's expected tau at k, and the real drafts per verification (the replay keeps at
  most those: an n-gram drafter without a match drafts fewer);
- draft ms / verify ms: the engine's median host time per speculative step of each phase (drafts left on the
  device make draft the proposer's host time; the wait for them lands in the next step's verify).
vLLM's anchor (TPOT 7.07 ms plain, 4.09 / 4.05 / 4.13 ms with EAGLE-3 at K = 3 / 4 / 5: 1.73x / 1.75x / 1.71x; real
weights and prompts) is printed beside our batch-1 EAGLE-3 cells at its profile; `--anchor-ks` (default 4, the
anchor's best K) adds EAGLE-3 cells at batch 1 only. Across GPUs, compare speedups rather than milliseconds.
Prints the table last; writes experiments/results/<name>.{md,json} (`--name`; default bench_spec_transfer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_common import (
    SHAPES,
    TINY,
    add_repeat_args,
    cell,
    env_line,
    free_cuda,
    model_dir,
    repeats_line,
    run_table,
    sync,
)

from research_lm import LLM, SamplingParams
from research_lm.assets import ASSETS
from research_lm.engine.metrics import EngineMetrics, spec_phase_stats
from research_lm.worker.acceptance_replay import AcceptanceProfile, expected_tau, load_profile, profile_from_tau

NAME = "bench_spec_transfer"
CACHE = Path(__file__).resolve().parents[1] / "outputs" / "spec_transfer"
ANCHOR_PROFILE = ASSETS / "profiles" / "vllm_eagle3_llama31_8b_mtbench_k4.json"
KEY = ("batch", "method", "k", "profile")
METHODS = ("eagle3", "draft_model", "ngram", "medusa")
READS_THE_TEXT = ("ngram",)  # drafters that draft from the text: they replay with echo
VLLM = "vLLM #20780"
# vLLM issue #20780: EAGLE-3 on Llama-3.1-8B, MT-bench, batch 1: K -> (acceptance length, TPOT ms); plain 7.07 ms
VLLM_PLAIN_TPOT_MS = 7.07
VLLM_EAGLE3: dict[int, tuple[float, float]] = {2: (2.36, 4.32), 3: (2.79, 4.09), 4: (3.08, 4.05), 5: (3.32, 4.13),
                                               6: (3.46, 4.20), 7: (3.54, 4.29)}
# the tiny mode's draft model: smaller than bench_common.TINY, its vocabulary
TINY_DRAFT: dict[str, Any] = dict(TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
RECIPE = "spec_transfer_recipe.json"


def vllm_source(k: int) -> str:
    tau, tpot = VLLM_EAGLE3[k]
    return (f"vLLM issue #20780 (github.com/vllm-project/vllm/issues/20780): EAGLE-3 on Llama-3.1-8B, MT-bench, "
            f"batch 1, K = {k} drafts: acceptance length {tau}, TPOT {VLLM_PLAIN_TPOT_MS} -> {tpot} ms "
            f"({VLLM_PLAIN_TPOT_MS / tpot:.2f}x); per-position rates not published: one i.i.d. rate fit to the "
            "acceptance length (profile_from_tau)")


def vllm_profile(k: int) -> AcceptanceProfile:
    """vLLM's published EAGLE-3 acceptance length at K = k as a profile of k equal conditional rates."""
    if k not in VLLM_EAGLE3:
        raise ValueError(f"vLLM #20780 publishes K = {min(VLLM_EAGLE3)} .. {max(VLLM_EAGLE3)}, not {k}")
    return profile_from_tau(VLLM_EAGLE3[k][0], k, vllm_source(k))


# ---- drafters with real shapes and random weights, in their published checkpoint layouts ----


def _dims(shape: dict[str, Any]) -> tuple[int, int, int, int]:
    """(hidden, MLP width, query width, key/value width) of a Llama-shaped config."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    return (shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"] * head_dim,
            shape["num_key_value_heads"] * head_dim)


def attention_mlp_shapes(prefix: str, shape: dict[str, Any], qkv_in: int) -> dict[str, tuple[int, ...]]:
    """One Llama decoder layer's attention, post-attention norm and gated MLP (Hugging Face names -> shapes)."""
    hidden, inter, q, kv = _dims(shape)
    return {f"{prefix}.self_attn.q_proj.weight": (q, qkv_in), f"{prefix}.self_attn.k_proj.weight": (kv, qkv_in),
            f"{prefix}.self_attn.v_proj.weight": (kv, qkv_in), f"{prefix}.self_attn.o_proj.weight": (hidden, q),
            f"{prefix}.post_attention_layernorm.weight": (hidden,), f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden), f"{prefix}.mlp.down_proj.weight": (hidden, inter)}


def llama_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """A LlamaForCausalLM checkpoint's tensors (lm_head only when untied, transformers' default)."""
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(shape["num_hidden_layers"]):
        out |= {f"model.layers.{i}.input_layernorm.weight": (hidden,),
                **attention_mlp_shapes(f"model.layers.{i}", shape, hidden)}
    if not shape.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, hidden)
    return out


def eagle3_shapes(shape: dict[str, Any], draft_vocab: int) -> dict[str, tuple[int, ...]]:
    """The published EAGLE-3 head (yuhuili/EAGLE3-*) for a target of `shape`, d2t / t2d aside."""
    hidden = shape["hidden_size"]
    return {"fc.weight": (hidden, 3 * hidden), "midlayer.input_layernorm.weight": (hidden,),
            "midlayer.hidden_norm.weight": (hidden,), **attention_mlp_shapes("midlayer", shape, 2 * hidden),
            "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden)}


def medusa_shapes(shape: dict[str, Any], num_heads: int) -> dict[str, tuple[int, ...]]:
    """FasterDecoding/medusa heads, one ResBlock each: {h}.0.linear (hidden x hidden + bias), {h}.1 lm_head."""
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    out: dict[str, tuple[int, ...]] = {}
    for h in range(num_heads):
        out |= {f"{h}.0.linear.weight": (hidden, hidden), f"{h}.0.linear.bias": (hidden,),
                f"{h}.1.weight": (vocab, hidden)}
    return out


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...] | None:
    """None where vLLM's default aux layers (2, L // 2, L - 3) are three distinct layers (the head's config then
    leaves them out, as the published ones do); else the first, middle and last streams (a tiny target)."""
    default = (2, num_layers // 2, num_layers - 3)
    if len(set(default)) == 3 and min(default) >= 0:
        return None
    return 0, num_layers // 2, num_layers


def eagle3_config(shape: dict[str, Any], draft_vocab: int) -> dict[str, Any]:
    """config.json of an EAGLE-3 head for a target of `shape`, rope in the published heads' rope_theta / rope_scaling
    form."""
    rope = dict(shape.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", 10000.0)
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu",
                  hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                  num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
                  head_dim=_dims(shape)[2] // shape["num_attention_heads"], num_hidden_layers=1,
                  vocab_size=shape["vocab_size"], draft_vocab_size=draft_vocab, rms_norm_eps=shape["rms_norm_eps"],
                  max_position_embeddings=shape["max_position_embeddings"], rope_theta=theta,
                  rope_scaling=rope or None, tie_word_embeddings=False)
    aux = eagle3_aux_layers(shape["num_hidden_layers"])
    return config if aux is None else config | {"eagle_aux_hidden_state_layer_ids": list(aux)}


def draft_vocab_maps(vocab: int, draft_vocab: int) -> dict[str, torch.Tensor]:
    """EAGLE-3's d2t ([draft_vocab] int64: target id - draft id) and t2d ([vocab] bool) over a seeded random subset
    of the target's ids, ascending (as EAGLE-3's frequency scan lists them)."""
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(draft_vocab), "t2d": t2d}


def write_random_checkpoint(root: Path, kind: str, config: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                            weights_file: str, dtype: torch.dtype, device: torch.device,
                            extra: dict[str, torch.Tensor] | None = None) -> Path:
    """<root>/<kind>-<recipe hash>/: config.json and `weights_file` (safetensors) holding every tensor of `shapes`
    drawn as the engine's dummy weights are (matrices N(0, 0.02) in `dtype`, seeded; norm scales 1, biases 0),
    then `extra` as given. Written once: a directory holding its recipe file is reused."""
    from safetensors.torch import save_file

    recipe = {"kind": kind, "config": config, "shapes": shapes, "dtype": str(dtype), "extra": sorted(extra or {})}
    out = root / f"{kind}-{hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]}"
    if (out / RECIPE).is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {name: _draw(name, dims, dtype, device, gen).cpu() for name, dims in shapes.items()}
    save_file(tensors | (extra or {}), str(out / weights_file))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / RECIPE).write_text(json.dumps(recipe, indent=1) + "\n")  # last: marks the directory complete
    return out


def _draw(name: str, dims: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          gen: torch.Generator) -> torch.Tensor:
    if len(dims) >= 2:
        return torch.empty(dims, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
    return torch.full(dims, 0.0 if name.endswith(".bias") else 1.0, dtype=dtype, device=device)


def write_drafters(args: argparse.Namespace, shape: dict[str, Any], draft_shape: dict[str, Any]) -> dict[str, str]:
    """The checkpoint directory of each model-based drafter the cells need (method -> path)."""
    from transformers import LlamaConfig

    dtype, device, root = getattr(torch, args.dtype), torch.device(args.device), args.cache_dir
    out: dict[str, str] = {}
    if "eagle3" in args.methods:
        draft_vocab = min(args.draft_vocab, shape["vocab_size"])
        out["eagle3"] = str(write_random_checkpoint(
            root, "eagle3", eagle3_config(shape, draft_vocab), eagle3_shapes(shape, draft_vocab), "model.safetensors",
            dtype, device, draft_vocab_maps(shape["vocab_size"], draft_vocab)))
    if "draft_model" in args.methods:
        config = json.loads(LlamaConfig(**draft_shape, architectures=["LlamaForCausalLM"]).to_json_string())
        out["draft_model"] = str(write_random_checkpoint(root, "draft", config, llama_shapes(draft_shape),
                                                         "model.safetensors", dtype, device))
    if "medusa" in args.methods and args.medusa_profile:
        heads = max(args.ks)
        config = {"medusa_num_heads": heads, "medusa_num_layers": 1, "hidden_size": shape["hidden_size"],
                  "vocab_size": shape["vocab_size"]}
        out["medusa"] = str(write_random_checkpoint(root, "medusa", config, medusa_shapes(shape, heads),
                                                    "medusa_lm_head.safetensors", dtype, device))
    return out


# ---- the cells: one engine each ----


@dataclass(frozen=True)
class Cell:
    """One engine: `method` at k drafts per step (plain decoding: k = 0) serving each of `batches` in turn."""

    method: str
    k: int
    batches: tuple[int, ...]
    profile_name: str = ""  # the profile it replays, as the table names it ("" for plain decoding)
    profile: AcceptanceProfile | None = None
    spec: dict[str, Any] | None = None  # speculative_config
    skipped: str = ""  # why it does not run


def speculative_config(method: str, k: int, drafters: dict[str, str]) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    return {"method": method, "model": drafters[method], "num_speculative_tokens": k}


def profiles_of(method: str, args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(name, the profile, or vllm_profile: one per K) that `method`'s cells replay; [] where none was given."""
    given = {"eagle3": args.profile, "draft_model": args.draft_profile, "ngram": args.ngram_profile,
             "medusa": args.medusa_profile}[method]
    named = [(Path(given).stem, load_profile(given))] if given else []
    if method == "eagle3":
        return [(VLLM, vllm_profile), *named]
    if method == "draft_model":
        return named or [(VLLM, vllm_profile)]
    return named


def plan_cells(args: argparse.Namespace, drafters: dict[str, str]) -> list[Cell]:
    """Plain decoding first (at every batch size a speculative cell uses), then each method x profile x k; a cell its
    profile cannot serve is kept, skipped with the reason."""
    batches = tuple(args.batches)
    anchor_ks = [k for k in args.anchor_ks if k not in args.ks] if "eagle3" in args.methods else []
    cells = [Cell("plain", 0, tuple(sorted(set(batches) | ({1} if anchor_ks else set()))))]
    for method in args.methods:
        profiles = profiles_of(method, args)
        if not profiles:
            print(f"{method}: no --{method.replace('_', '-')}-profile given, no cells", flush=True)
        for name, profile in profiles:
            extra = [(k, (1,)) for k in anchor_ks] if name == VLLM and method == "eagle3" else []
            for k, at in [(k, batches) for k in args.ks] + extra:
                spec = speculative_config(method, k, drafters)
                if profile is vllm_profile and k not in VLLM_EAGLE3:
                    why = f"{VLLM} publishes K = {min(VLLM_EAGLE3)} .. {max(VLLM_EAGLE3)} only"
                    cells.append(Cell(method, k, at, f"{name} K={k}", None, spec, why))
                    continue
                p = vllm_profile(k) if profile is vllm_profile else profile
                short = p.num_speculative_tokens < k
                why = f"profile {name} has {p.num_speculative_tokens} draft positions, k = {k}" if short else ""
                cells.append(Cell(method, k, at, f"{name} K={k}" if profile is vllm_profile else name, p, spec, why))
    return cells


# ---- measuring ----


@dataclass
class VerifyCounts(EngineMetrics):
    """EngineMetrics plus each request's verify steps in order, (real drafts, accepted), counted as the harness's
    AcceptanceMetrics counts them."""

    verify_steps: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def record_step(self, sched, out, stats, seconds) -> None:
        super().record_step(sched, out, stats, seconds)
        for req_id, k, emitted in zip(out.req_ids, out.num_draft_tokens or [], out.sampled_token_ids):
            if k > 0 and emitted:
                self.verify_steps.setdefault(req_id, []).append((k, min(len(emitted) - 1, k)))

    def acceptance(self) -> dict[str, float]:
        """tau = 1 + accepted / verifications and the real drafts per verification, over every request's verify
        steps but its last (max_tokens cuts that one short)."""
        steps = [s for trace in self.verify_steps.values() for s in trace[:-1]]
        if not steps:
            return {}
        n = len(steps)
        return {"tau": 1 + sum(a for _, a in steps) / n, "drafts_per_step": sum(d for d, _ in steps) / n,
                "verify_steps": n}


def build_llm(args: argparse.Namespace, target: str, c: Cell) -> LLM:
    """The target with random weights, sized for c's largest batch, graphs captured at each of its batch sizes."""
    max_len = args.prompt_len + args.tokens + 2 * c.k + 16  # + drafts and the drafter's lookahead past the last token
    n = max(c.batches)
    return LLM(target, load_format="dummy", dtype=args.dtype, device=args.device, attention_backend=args.backend,
               max_num_seqs=n, max_num_batched_tokens=max(args.prompt_len * n, 256), max_model_len=max_len,
               num_gpu_blocks=n * -(-max_len // 16) + 2, enable_prefix_caching=False, cuda_graph_sizes=list(c.batches),
               prefill_graph_sizes=[], speculative_config=c.spec,
               acceptance_replay=None if c.profile is None else c.profile.to_dict(),
               acceptance_replay_echo=args.period if c.method in READS_THE_TEXT and c.profile is not None else 0)


def serve(llm: LLM, prompts: list[list[int]], batch: int, tokens: int, device: torch.device) -> tuple[list, float]:
    """The prompts in rounds of `batch` requests at once, greedy, `tokens` each (request i seeded i): (the outputs,
    the rounds' wall seconds)."""
    outputs, seconds = [], 0.0
    for start in range(0, len(prompts), batch):
        params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, seed=start + i)
                  for i in range(len(prompts[start:start + batch]))]
        sync(device)
        t0 = time.perf_counter()
        outputs += llm.generate(prompts[start:start + batch], params, use_tqdm=False)
        seconds += time.perf_counter() - t0
    return outputs, seconds


def measure_batch(llm: LLM, c: Cell, prompts: list[list[int]], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """One batch size of a cell: its rounds served, the row's measured fields."""
    counts = llm.engine.metrics = VerifyCounts()
    outputs, seconds = serve(llm, prompts[: batch * -(-args.requests // batch)], batch, args.tokens,
                             torch.device(args.device))
    row = {"tpot_ms": statistics.fmean(o.metrics.time_per_output_token for o in outputs) * 1e3,
           "tok_s": sum(o.metrics.num_output_tokens for o in outputs) / seconds, "requests": len(outputs)}
    if c.profile is None:
        return row
    marks = {o.acceptance_replayed for o in outputs}
    if marks != {c.profile.source}:
        raise RuntimeError(f"outputs of a replaying engine marked {sorted(map(str, marks))}, not by its profile")
    phases = spec_phase_stats(counts.steps)
    return row | counts.acceptance() | {
        "expected_tau": expected_tau(c.profile, c.k), "acceptance": f"replayed({c.profile.source})",
        **({"draft_ms": phases["draft_ms_per_step_median"], "verify_ms": phases["verify_ms_per_step_median"]}
           if phases else {})}


def run_cell(args: argparse.Namespace, c: Cell, target: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """c's rows, one per batch size: built, warmed up at each batch size (kernels and graphs), measured, freed. A
    failure (e.g. out of memory) becomes the rows' error; the other cells still run."""
    rows = [{"batch": b, "method": c.method, "k": c.k, "profile": c.profile_name} for b in c.batches]
    if c.skipped:
        return [r | {"error": f"skipped: {c.skipped}"} for r in rows]
    print(f"[{time.strftime('%X')}] {c.method} k={c.k} {c.profile_name} at batch {', '.join(map(str, c.batches))}",
          flush=True)
    llm = None
    try:
        llm = build_llm(args, target, c)
        for b in c.batches:
            serve(llm, prompts[:b], b, args.warmup_tokens, torch.device(args.device))
        return [r | measure_batch(llm, c, prompts, b, args) for r, b in zip(rows, c.batches, strict=True)]
    except Exception as e:  # reported in the table, not fatal
        return [r | {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"} for r in rows]
    finally:
        llm = None
        free_cuda()
        if torch.cuda.is_available():  # every engine was freed: a leak would add up over cells and repeats
            print(f"CUDA memory still allocated {torch.cuda.memory_allocated() / 1e9:.2f} GB", flush=True)


def measure(args: argparse.Namespace, cells: list[Cell], target: str, prompts: list[list[int]]) -> dict[str, Any]:
    """One repeat of the whole table: every cell, then each speculative row's speedup over plain decoding at its
    batch size in this repeat."""
    rows = [row for c in cells for row in run_cell(args, c, target, prompts)]
    plain = {r["batch"]: r["tpot_ms"] for r in rows if r["method"] == "plain" and "tpot_ms" in r}
    for r in rows:
        if r["method"] != "plain" and "tpot_ms" in r and r["batch"] in plain:
            r["speedup"] = plain[r["batch"]] / r["tpot_ms"]
    return {"rows": rows}


def make_prompts(n: int, length: int, period: int, vocab: int) -> list[list[int]]:
    """n prompts of `length` token ids, each a seeded random block of `period` ids repeated: an n-gram drafter finds
    matches in them; the model-based drafters' time does not depend on the ids."""
    rng = random.Random(0)
    prompts = []
    for _ in range(n):
        block = [rng.randrange(vocab) for _ in range(period)]
        prompts.append((block * -(-length // period))[:length])
    return prompts


# ---- the table ----


def _label(row: dict[str, Any]) -> str:
    return "—" if row["method"] == "plain" else f"replayed({row['profile']})"


def render(payload: dict[str, Any]) -> str:
    s, rows = payload["shape"], payload["rows"]
    head = (f"{env_line(payload['env'])}\n\nSpeculative decoding on the {payload['shape_name']} shape (hidden "
            f"{s['hidden_size']}, {s['num_hidden_layers']} layers, {s['num_attention_heads']}/"
            f"{s['num_key_value_heads']} heads, vocab {s['vocab_size']}), random weights, {payload['dtype']}, "
            f"{payload['backend']}, CUDA graphs where the device has them, public API (`LLM.generate`), greedy, "
            f"acceptance replayed (research_lm/worker/acceptance_replay.py): every forward, KV write and launch is "
            f"real, each request's accepted drafts come from the profile, the output tokens mean nothing. Drafters "
            f"of real shapes, random weights: {payload['drafters']}. {payload['requests']}+ requests per cell and "
            f"batch size (batch b: ceil({payload['requests']} / b) rounds of b at once) of {payload['prompt_len']} "
            f"prompt tokens (a random block of {payload['period']} repeated), {payload['tokens']} output tokens "
            f"each, the same prompts and seeds in every cell. TPOT: mean over requests of (finish - first token) / "
            f"(tokens - 1); tok/s: output tokens / wall time (prefill included); speedup: plain TPOT / TPOT, same "
            f"repeat; τ: 1 + accepted / verify steps (each request's last step left out), beside the profile's "
            f"expectation at k; drafts/step: real drafts per verify step (the replay keeps at most those); draft / "
            f"verify ms: the engine's median host ms per speculative step. {repeats_line(payload)}\n")
    lines = [head, "| batch | method | k | acceptance | TPOT ms | tok/s | speedup | τ | τ expected | drafts/step | "
             "draft ms | verify ms | note |", "| ---: | --- | ---: | --- |" + " ---: |" * 8 + " --- |"]
    for r in rows:
        note = r.get("error", "") + (f"{len(r['errors'])} repeat(s) failed: {r['errors'][0]}" if r.get("errors")
                                     and "error" not in r else "")
        k = str(int(r["k"])) if r["k"] else "—"
        values = [str(int(r["batch"])), r["method"], k, _label(r), cell(r, "tpot_ms", ".3f"), cell(r, "tok_s", ".0f"),
                  cell(r, "speedup", ".2f"), cell(r, "tau", ".2f"), cell(r, "expected_tau", ".2f"),
                  cell(r, "drafts_per_step", ".2f"), cell(r, "draft_ms", ".3f"), cell(r, "verify_ms", ".3f"), note]
        lines.append("| " + " | ".join(values) + " |")
    lines += ["", *anchor_table(payload), "", "Profiles (what each replays, as its `source` says):", ""]
    lines += [f"- {name}: {source}" for name, source in payload["profiles"].items()]
    return "\n".join(lines)


def anchor_table(payload: dict[str, Any]) -> list[str]:
    """vLLM's published EAGLE-3 numbers beside our batch-1 EAGLE-3 rows at the same K's profile."""
    ours = {int(r["k"]): r for r in payload["rows"] if r["method"] == "eagle3" and int(r["batch"]) == 1
            and r["profile"] == f"{VLLM} K={int(r['k'])}" and "tpot_ms" in r}
    plain = next((r for r in payload["rows"] if r["method"] == "plain" and int(r["batch"]) == 1 and "tpot_ms" in r),
                 None)
    if not ours or plain is None:
        return []
    lines = [f"Beside the published anchor ({VLLM}: EAGLE-3 on Llama-3.1-8B with its trained head, real weights, "
             "MT-bench, batch 1, on its authors' GPU (an H100 in their vLLM EAGLE benchmarks); our batch-1 EAGLE-3 "
             f"rows at the profile fit to the same K's acceptance length, on {payload['env']['device']}):", "",
             "| K | vLLM TPOT ms plain → EAGLE-3 | vLLM speedup | vLLM acceptance length | research_lm TPOT ms "
             "plain → EAGLE-3 | research_lm speedup | research_lm τ |", "| ---: |" + " ---: |" * 6]
    for k, r in sorted(ours.items()):
        tau, tpot = VLLM_EAGLE3[k]
        lines.append(f"| {k} | {VLLM_PLAIN_TPOT_MS:.2f} → {tpot:.2f} | {VLLM_PLAIN_TPOT_MS / tpot:.2f} | {tau:.2f} | "
                     f"{cell(plain, 'tpot_ms', '.3f')} → {cell(r, 'tpot_ms', '.3f')} | {cell(r, 'speedup', '.2f')} | "
                     f"{cell(r, 'tau', '.2f')} |")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--backend", default="triton")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run of the code paths")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES), help="the target's shape")
    p.add_argument("--draft-shape", default="llama-3.2-1b", choices=sorted(SHAPES), help="draft_model's shape")
    p.add_argument("--draft-vocab", type=int, default=32000, help="the EAGLE-3 head's draft vocabulary")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="drafters to run (ngram and medusa only with their profiles)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--ks", type=int, nargs="+", default=[3, 5], help="drafts per step")
    p.add_argument("--anchor-ks", type=int, nargs="*", default=[4],
                   help="more k for EAGLE-3 at vLLM's profile, at batch 1 only (the anchor's K)")
    p.add_argument("--profile", help="an acceptance profile (JSON) for more EAGLE-3 cells")
    p.add_argument("--draft-profile", help="draft_model's profile (default: vLLM's EAGLE-3 profile)")
    p.add_argument("--ngram-profile", help="ngram's profile (no ngram cells without one)")
    p.add_argument("--medusa-profile", help="medusa's profile (no medusa cells without one)")
    p.add_argument("--requests", type=int, default=8, help="at least this many requests per cell and batch size")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--period", type=int, default=16, help="prompts repeat a random block of this many ids")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--cache-dir", type=Path, default=CACHE, help="the drafters' random checkpoints (reused)")
    add_repeat_args(p)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser()
    args = p.parse_args(argv)
    if min(args.batches) < 1 or len(set(args.batches)) != len(args.batches):
        p.error(f"--batches: distinct sizes >= 1, got {args.batches}")
    if min(args.ks + args.anchor_ks) < 1 or args.tokens < 2 or args.requests < 1:
        p.error("--ks and --anchor-ks must be >= 1, --tokens >= 2 (TPOT), --requests >= 1")
    shape = TINY if args.tiny else SHAPES[args.shape]
    draft_shape = TINY_DRAFT if args.tiny else SHAPES[args.draft_shape]
    drafters = write_drafters(args, shape, draft_shape)
    cells = plan_cells(args, drafters)
    batches = sorted({b for c in cells for b in c.batches})
    prompts = make_prompts(max(b * -(-args.requests // b) for b in batches), args.prompt_len, args.period,
                           shape["vocab_size"])
    profiles = {c.profile_name: c.profile.source for c in cells if c.profile is not None}
    shape_name = "tiny" if args.tiny else args.shape
    described = {"eagle3": f"an EAGLE-3 head (draft vocabulary {min(args.draft_vocab, shape['vocab_size'])})",
                 "draft_model": f"a {'tiny' if args.tiny else args.draft_shape} draft model",
                 "medusa": f"{max(args.ks)} Medusa heads"}
    name = args.name or (NAME + ("_tiny" if args.tiny else ""))
    return run_table(name, torch.device(args.device), args,
                     partial(measure, cells=cells, target=model_dir(shape), prompts=prompts), render, KEY,
                     shape=shape, shape_name=shape_name, dtype=args.dtype, backend=args.backend,
                     batches=args.batches, ks=args.ks, requests=args.requests, prompt_len=args.prompt_len,
                     period=args.period, tokens=args.tokens, profiles=profiles,
                     drafters="; ".join(described[m] for m in drafters) or "none",
                     anchor={"source": vllm_source(4), "plain_tpot_ms": VLLM_PLAIN_TPOT_MS,
                             "eagle3": [{"k": k, "acceptance_length": t, "tpot_ms": ms}
                                        for k, (t, ms) in VLLM_EAGLE3.items()]})


if __name__ == "__main__":
    main()
