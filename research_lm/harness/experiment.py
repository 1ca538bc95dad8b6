"""Turn a composed Hydra config into a run: engine, workload, logger, results on disk."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm.auto import tqdm

from attention_zoo.registries import Registry
from research_lm.api.config import EngineConfig
from research_lm.api.llm import LLM
from research_lm.assets import shipped_head
from research_lm.engine.distributed import is_main_process
from research_lm.engine.metrics import EngineMetrics
from research_lm.eplb import available_policies
from research_lm.harness.env_info import environment
from research_lm.harness.loggers import get_logger
from research_lm.harness.report import describe_head
from research_lm.harness.spec_notes import SPEC_HEAD_PRESETS, head_record, quick_head_note, speculation_note
from research_lm.harness.workloads import WorkloadSpec, build_workload
from research_lm.worker.acceptance_replay import AcceptanceProfile, expected_tau, profile_from_steps, write_profile
from research_lm.worker.token_tree import TokenTree

# Tasks registered here, and by modules imported when first asked for (their import registers them).
TASKS: Registry[Callable[..., dict[str, Any]]] = Registry("task", {
    name: "research_lm.harness.train.tasks"
    for name in ("train_target", "train_eagle3", "train_eagle", "train_medusa", "train_draft", "train_moe",
                 "train_mtp")})
register_task = TASKS.register


def run(cfg: DictConfig, run_dir: Path, sweep_group: str | None = None,
        overrides: list[str] | None = None) -> dict[str, Any]:
    """Run `cfg.task` into `run_dir`. `overrides`: the command line's (Hydra's overrides.task), which the
    preset's `gpu:` block leaves alone (apply_gpu_sizes)."""
    cfg = apply_gpu_sizes(cfg, overrides or [])
    task = TASKS.get(cfg.task)
    seed_everything(cfg.seed, deterministic=bool(cfg.deterministic))
    run_dir.mkdir(parents=True, exist_ok=True)
    flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
    # under torchrun rank 0 alone logs; the other ranks run the same work silently (research_lm.__main__)
    logger_cfg = OmegaConf.to_container(cfg.logger, resolve=True) if is_main_process() else {"name": "none"}
    logger = get_logger(**logger_cfg)
    group = cfg.sweep_name or sweep_group
    logger.start(run_dir, flat, name=run_dir.name, group=group)
    try:
        results = task(cfg, run_dir, logger)
        logger.summary(results["summary"])
    finally:
        logger.finish()
    record_reproducibility(cfg, run_dir, results, group)
    return results


def cuda_device(cfg: DictConfig) -> bool:
    """Whether the run's device resolves to CUDA: `device: cuda[:N]`, or `auto` with a GPU present."""
    device = str(cfg.get("device") or "auto")
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def override_paths(overrides: list[str]) -> list[str]:
    """The config paths a command line sets: `key.path=v`, `+k=v`, `++k=v`, `~k` -> the key path;
    a group override (`attention=flashinfer`, `model@pkg=hf`) -> the group's name."""
    paths = []
    for arg in overrides:
        key = arg.partition("=")[0].lstrip("+~").partition("@")[0].strip()
        if key:
            paths.append(key)
    return paths


def _overlaps(path: str, user: list[str]) -> bool:
    """`path` is a path the user set, under one, or above one (a group the user chose or changed a key of)."""
    return any(path == u or path.startswith(u + ".") or u.startswith(path + ".") for u in user)


def gpu_entries(cfg: DictConfig) -> list[tuple[str, Any]]:
    """The `gpu:` block as (dotted path, value) pairs: mappings are followed down to the config's own leaves
    (a mapping over a config leaf, e.g. `baseline: null`, is one entry); a string under a top-level config
    group's name names one of its options (`model: random-llama-1b`, as in `baseline:`). ValueError on a key
    the config does not have or an option that does not exist (a typo in a preset)."""
    block = cfg.get("gpu")
    if not block:
        return []
    out: list[tuple[str, Any]] = []

    def walk(node: dict, target: Any, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if not isinstance(target, DictConfig) or key not in target:
                raise ValueError(f"gpu: {path!r} is not a key of the config (see --cfg job)")
            sub = target._get_node(key)
            if isinstance(value, dict) and isinstance(sub, DictConfig) and not sub._is_none():
                walk(value, sub, path + ".")
                continue
            if isinstance(value, str) and not prefix and (CONF_DIR / key).is_dir():
                if not (CONF_DIR / key / f"{value}.yaml").is_file():
                    options = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
                    raise ValueError(f"gpu: unknown {key} {value!r}; choose one of: {', '.join(options)}")
            out.append((path, value))

    walk(OmegaConf.to_container(block, resolve=False), cfg, "")
    return out


def apply_gpu_sizes(cfg: DictConfig, overrides: list[str], cuda: bool | None = None) -> DictConfig:
    """When the run's device resolves to CUDA (`cuda`: that answer, else cuda_device(cfg)), merge the preset's
    `gpu:` block (its GPU sizes) into cfg, except every entry the command line touched: an entry is kept
    as the user chose when its path equals, lies under or lies above a path in `overrides` (so
    `workload.max_tokens=8` keeps that key, `attention=flashinfer` keeps the whole attention group, and a
    user key under a group keeps a `gpu:` group option from replacing that group). Returns the config with
    `gpu_applied` set to the merged paths ([] when nothing was applied); a config that already has
    `gpu_applied` (a recorded run being reproduced) is returned as is. `gpu: null` applies nothing."""
    if cfg.get("gpu_applied") is not None:
        return cfg
    applied: list[str] = []
    entries = gpu_entries(cfg) if cfg.get("gpu") and (cuda if cuda is not None else cuda_device(cfg)) else []
    user = override_paths(overrides)
    kept = [path for path, _ in entries if _overlaps(path, user)]
    if entries:
        cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        for path, value in entries:
            if path in kept:
                continue
            if isinstance(value, str) and "." not in path and (CONF_DIR / path).is_dir():
                cfg[path] = OmegaConf.load(CONF_DIR / path / f"{value}.yaml")
            else:
                OmegaConf.update(cfg, path, value, merge=False)
            applied.append(path)
        print(f"gpu: device is CUDA: applied the preset's GPU sizes ({', '.join(applied) or 'none'}"
              + (f"; kept from the command line: {', '.join(kept)}" if kept else "")
              + "); off with gpu=null", flush=True)
    with open_dict(cfg):
        cfg.gpu_applied = applied
    return cfg


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, numpy and torch. `deterministic`: torch's deterministic algorithms (warn, not fail,
    where an op has none), cuDNN autotuning off, and CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS needs it
    for deterministic GEMMs; it only takes effect before the first CUDA call, so it is set here, before
    any model is built). CPU runs are bit-identical for the same thread count either way; GPU runs are
    as deterministic as torch allows (atomics in some kernels, e.g. Triton split-K reductions, are not)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def record_reproducibility(cfg: DictConfig, run_dir: Path, results: dict[str, Any], group: str | None) -> None:
    """Add what re-running needs to results.json (whatever task wrote it): seeds, the deterministic
    switch, the command-line overrides, the sweep group, the thread count and the re-run command."""
    path = run_dir / "results.json"
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = list(OmegaConf.load(overrides_file)) if overrides_file.is_file() else None
    seeds = {"seed": cfg.seed}
    for key in ("workload", "model"):
        block = cfg.get(key)
        if isinstance(block, DictConfig):
            value = block.get("seed") if key == "workload" else (block.get("random") or {}).get("seed")
            if value is not None:
                seeds[f"{key}_seed"] = value
    data["reproducibility"] = {
        "seeds": seeds,
        "deterministic": bool(cfg.deterministic),
        "overrides": overrides,
        "sweep_group": group,
        "torch_num_threads": torch.get_num_threads(),
        "rerun": f"python -m research_lm.harness.reproduce {run_dir}",
    }
    data.setdefault("config", OmegaConf.to_container(cfg, resolve=True))
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    results["reproducibility"] = data["reproducibility"]


def engine_config(cfg: DictConfig) -> EngineConfig:
    m, r = cfg.model, cfg.runner
    spec = OmegaConf.to_container(cfg.spec, resolve=True) if cfg.spec.get("method") else None
    return EngineConfig(
        model=m.name, tokenizer=m.tokenizer, dtype=m.dtype, device=cfg.device, seed=cfg.seed,
        block_size=r.block_size, max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
        max_model_len=m.max_model_len, gpu_memory_utilization=r.gpu_memory_utilization,
        num_gpu_blocks=r.num_gpu_blocks, enable_prefix_caching=r.enable_prefix_caching,
        enable_chunked_prefill=r.enable_chunked_prefill, attention_backend=cfg.attention.backend,
        trust_remote_code=m.trust_remote_code, speculative_config=spec,
        mla_backend=cfg.attention.get("mla_backend", "auto"),
        mamba_backend=cfg.attention.get("mamba_backend", "auto"),
        eplb_config=OmegaConf.to_container(cfg.eplb, resolve=True) if "eplb" in cfg else None,
        cuda_graphs=r.get("cuda_graphs", True), cuda_graph_sizes=_list_or_none(r.get("cuda_graph_sizes")),
        prefill_graph_sizes=_list_or_none(r.get("prefill_graph_sizes")),
        fused_ops=r.get("fused_ops", True), skinny_rows=r.get("skinny_rows", 1),
        batch_invariant=r.get("batch_invariant", False),
        compile=r.get("compile", False),
        async_scheduling=r.get("async_scheduling"), separate_prefills=r.get("separate_prefills"),
        host_threads=r.get("host_threads"), tensor_parallel_size=r.get("tensor_parallel_size", 1),
        distributed_timeout_s=r.get("distributed_timeout_s", 300.0),
        load_format=m.get("load_format", "auto"),
        acceptance_replay=_container(cfg.get("acceptance_replay")),
        acceptance_replay_echo=cfg.get("acceptance_replay_echo", 0),
    )


def _container(x: Any) -> Any:
    return OmegaConf.to_container(x, resolve=True) if isinstance(x, DictConfig) else x


def _list_or_none(x: Any) -> list[int] | None:
    return None if x is None else [int(v) for v in x]


@register_task("generate")
def generate(cfg: DictConfig, run_dir: Path, logger) -> dict[str, Any]:
    """Run the workload through the engine (arriving all at once, or at `workload.request_rate`); with a
    `baseline:` block, run the same workload again on the baseline config and report the ratios.
    Writes results.json, env.json and samples.jsonl (token ids included)."""
    check_acceptance_options(cfg)
    cfg, head = with_spec_head(cfg, run_dir)
    main = run_workload(cfg, run_dir, logger=logger, record_acceptance=bool(cfg.get("record_acceptance")))
    summary = dict(main["summary"])
    baseline = None
    if cfg.get("baseline"):
        print("baseline: " + json.dumps(OmegaConf.to_container(cfg.baseline, resolve=True)), flush=True)
        baseline = run_workload(baseline_config(cfg), run_dir / "baseline")
        summary.update(compare_to_baseline(main, baseline))
    replayed = [s["acceptance"] for s in (summary, baseline and baseline["summary"]) if s and "acceptance" in s]
    if replayed and "outputs_match_baseline" in summary:  # a replayed run's tokens are not the model's
        summary["outputs_match_baseline"] = None
    # strings derived from timings stay out of `summary`: reproduce compares its untimed keys exactly
    tree = cfg.spec.get("speculative_token_tree")  # a token tree: tau is bounded by its depth + 1
    k = (TokenTree.parse(OmegaConf.to_container(tree)).depth if tree
         else int(cfg.spec.get("num_speculative_tokens") or 0))
    notes = [n for n in (quick_head_note(head), speculation_note(summary, k, cfg.spec.get("method"))) if n]
    if replayed:
        notes.append(f"acceptance {replayed[0]}: the outputs are not the model's, so outputs_match_baseline is null "
                     "and samples.jsonl holds tokens chosen by the replay; the times and counts are real")
    results = {
        "summary": summary,
        "spec_head": head,
        "notes": notes,
        "model": main["model"],
        "engine": main["engine"],
        "workload": main["workload"],
        "config": OmegaConf.to_container(cfg, resolve=True),
        "eplb": main["eplb"],
        "baseline": None if baseline is None else {
            "summary": baseline["summary"], "model": baseline["model"], "workload": baseline["workload"],
            "overrides": OmegaConf.to_container(cfg.baseline, resolve=True)},
        "env": environment(main["device"]),
    }
    if main["acceptance_profile"] is not None:
        results["acceptance_profile"] = str(write_profile(main["acceptance_profile"],
                                                          run_dir / "acceptance_profile.json"))
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (run_dir / "env.json").write_text(json.dumps(results["env"], indent=2) + "\n")
    write_samples(run_dir / "samples.jsonl", main["outputs"])
    if baseline is not None:
        write_samples(run_dir / "baseline" / "samples.jsonl", baseline["outputs"])
    print_table(summary, run_dir, ([f"head: {describe_head(head)}"] if head else []) + [f"note: {n}" for n in notes])
    return results


def check_acceptance_options(cfg: DictConfig) -> None:
    """`record_acceptance` records a real run's acceptance: it needs drafts, and refuses a replayed run."""
    if not cfg.get("record_acceptance"):
        return
    if not cfg.spec.get("method"):
        raise ValueError("record_acceptance=true records the acceptance of drafts: choose a spec method")
    if cfg.get("acceptance_replay") is not None:
        raise ValueError("record_acceptance=true records a real run's acceptance; this run replays a profile "
                         "(acceptance_replay): drop one")


def recorded_profile(metrics: AcceptanceMetrics, outputs: list, k: int, source: str) -> AcceptanceProfile | None:
    """The run's acceptance profile: per-position conditional rates over every request's verify steps, and the
    trace of every request that verified drafts, in prompt order; None (said on stdout) where none did."""
    traces = metrics.traces or {}
    steps = [step for trace in traces.values() for step in trace]
    if not steps:
        print("record_acceptance: the run verified no drafts; no acceptance_profile.json", flush=True)
        return None
    in_order = [traces[o.request_id] for o in outputs if o is not None and traces.get(o.request_id)]
    return profile_from_steps(steps, k, source, traces=in_order)


def with_spec_head(cfg: DictConfig, run_dir: Path) -> tuple[DictConfig, dict[str, Any] | None]:
    """The head a model-based `spec.method` drafts with, and where it came from. `spec.model` set: that one.
    Null, on a built-in target that ships a head for the method (research_lm.assets.SHIPPED_HEADS): the shipped
    one. Null otherwise, with a `spec_head:` block: the head the method's training preset writes (train_<method>'s
    train.output_dir, relative to the working directory), trained first with that preset shortened to
    `spec_head.train_steps` steps (into <run_dir>/prepare) when it does not exist yet; later runs reuse it.
    Returns cfg with spec.model set and the head's record for results.json (head_record); (cfg, None) for a
    method without a head, or a null head nothing resolves (the engine's error then names it)."""
    method = cfg.spec.get("method")
    if method not in SPEC_HEAD_PRESETS:
        return cfg, None
    if cfg.spec.get("model"):
        return cfg, head_record(method, cfg.spec.model, "given")
    shipped = None if cfg.model.get("random") else shipped_head(cfg.model.name, method)
    if shipped is None and not cfg.get("spec_head"):
        return cfg, None
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    if shipped:  # a trained head beats a quick one: no training, and the same head every run
        cfg.spec.model = shipped
        print(f"spec_head: {cfg.model.name} ships its {method} head: spec.model={shipped}", flush=True)
        return cfg, head_record(method, shipped, "shipped")
    preset = OmegaConf.load(CONF_DIR / "experiment" / f"{SPEC_HEAD_PRESETS[method]}.yaml")
    head = cfg.spec.model = str(preset.train.output_dir)
    recipe_steps = int(preset.train.steps)
    if (Path(head) / "config.json").is_file():
        return cfg, head_record(method, head, "reused", recipe_steps=recipe_steps)
    steps = int(cfg.spec_head.train_steps)
    print(f"spec_head: no {method} head at {head}: training one with experiment={preset.task} "
          f"train.steps={steps} (the full recipe: python -m research_lm experiment={preset.task}); "
          "later runs reuse it", flush=True)
    train = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    train.task = preset.task
    train.train = preset.train
    train.train.steps = steps
    train.train.save_every = 0
    train.train.progress = False
    train.train.target = str(prepare_model(cfg, run_dir) or cfg.model.name)
    (run_dir / "prepare").mkdir(parents=True, exist_ok=True)
    TASKS.get(preset.task)(train, run_dir / "prepare", get_logger("none"))
    return cfg, head_record(method, head, "trained", steps=steps, recipe_steps=recipe_steps)


WARMUP_MAX_TOKENS = 16  # warm-up requests are cut to this many output tokens


def run_workload(cfg: DictConfig, run_dir: Path, logger=None, record_acceptance: bool = False) -> dict[str, Any]:
    """Build the engine and the workload of `cfg`, serve it once (after `warmup_requests` discarded
    requests) and return the summary, the outputs and what identifies the model and the requests;
    `record_acceptance`: also the run's acceptance profile (`recorded_profile`)."""
    model_dir = prepare_model(cfg, run_dir)
    config = engine_config(cfg)
    if model_dir is not None:
        config.model = str(model_dir)
    llm = LLM(**vars(config))
    engine = llm.engine
    # + per-position acceptance and tau, when drafts are verified (and each request's steps, to record them)
    engine.metrics = AcceptanceMetrics(traces={} if record_acceptance else None)
    w = OmegaConf.to_container(cfg.workload, resolve=True)
    w = {k: tuple(v) if isinstance(v, list) else v for k, v in w.items()}
    workload = build_workload(WorkloadSpec(**w), engine.info.vocab_size)
    if cfg.warmup_requests:  # compiles the kernels' batched shapes too: n requests at once, short outputs
        n = cfg.warmup_requests
        params = [replace(p, max_tokens=min(p.max_tokens, WARMUP_MAX_TOKENS)) for p in workload.params[:n]]
        llm.generate(workload.prompts[:n], params, use_tqdm=False)
    engine.metrics.reset()
    if engine.acceptance_replay is not None:
        engine.acceptance_replay.rewind()
    outputs = serve(engine, workload.prompts, workload.params, workload.arrival_times,
                    clock=engine.ranks.clock if engine.ranks is not None else time.perf_counter,  # EP: rank 0's
                    progress=is_main_process())
    metrics = engine.metrics
    if logger is not None:
        for step in metrics.steps:
            logger.log(step, step=step["step"])
    summary = metrics.summary()
    replay, profile = engine.acceptance_replay, None
    k = engine.runner.proposer.num_speculative_tokens if engine.runner.proposer is not None else 0
    if replay is not None:  # marks the run; the tau the profile predicts, beside the measured one
        summary["acceptance"] = f"replayed({replay.source})"
        summary["acceptance_replay_expected_tau"] = expected_tau(replay.profile, k)
    if record_acceptance:
        profile = recorded_profile(metrics, outputs, k, f"{run_dir} ({cfg.spec.method}, k={k}, model {cfg.model.name}, "
                                                        f"workload {cfg.workload.kind})")
    summary.update(decode_step_stats(metrics.steps))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    if summary.get("decode_step_ms_median"):  # the weights are read once per decode step, at least
        summary["decode_weight_gb_s"] = weight_bytes / (summary["decode_step_ms_median"] * 1e-3) / 1e9
    info = engine.info
    page_bytes = engine.runner.page_size_bytes(info.dtype)
    state_bytes = engine.runner.state_bytes(info.dtype)
    memory = {
        # KV bytes one more token of context costs (all layers); 0 for a pure state-space model
        "kv_bytes_per_token": page_bytes / config.block_size,
        # fixed per-request state (Mamba conv + SSM), all layers
        "state_bytes_per_request": state_bytes / engine.config.max_num_seqs,
        # peak KV memory the run touched: blocks in use at the busiest step
        "kv_bytes_used_max": round(summary.get("kv_cache_usage_max", 0.0) * engine.num_blocks) * page_bytes,
    }
    summary.update(memory)
    if workload.arrival_times is not None:
        span = workload.arrival_times[-1] if len(workload.arrival_times) > 1 else 0.0
        summary["request_rate"] = w["request_rate"]
        summary["offered_request_rate"] = (len(workload.arrival_times) - 1) / span if span > 0 else float("inf")
    eplb = engine.eplb.summary() if engine.eplb is not None else None  # MoE models only
    if eplb is not None:
        summary.update({f"eplb_{k}": v for k, v in eplb.items() if isinstance(v, int | float | str | bool)})
    return {
        "summary": summary,
        "outputs": outputs,
        "acceptance_profile": profile,
        "eplb": eplb,
        "device": info.device,
        "model": {"path": info.path, "dtype": str(info.dtype), "num_kv_blocks": engine.num_blocks,
                  "num_params": sum(p.numel() for p in engine.model.parameters()), "weight_bytes": weight_bytes,
                  "kv_page_bytes": page_bytes, "block_size": config.block_size,
                  "random": _random_recipe(model_dir)},
        # what "auto" and the device-sized defaults resolved to
        "engine": {"attention_backends": engine.backends, "max_num_seqs": engine.config.max_num_seqs,
                   "max_num_batched_tokens": engine.config.max_num_batched_tokens},
        "workload": {"kind": w["kind"], "num_requests": len(workload.prompts), "hash": workload.source_hash,
                     "fingerprint": workload.fingerprint(), "seed": w.get("seed"),
                     "request_rate": w.get("request_rate")},
    }


def prepare_model(cfg: DictConfig, run_dir: Path) -> Path | None:
    """A `model.random` block (conf/model/random-*.yaml): build that seeded random checkpoint into
    <run_dir>/model, or, with `model.random.cache_dir`, into <cache_dir>/<architecture>-<recipe hash> where
    every job of a sweep with the same recipe reuses it; return its directory. Otherwise None (model.name
    is loaded as it is)."""
    spec = cfg.model.get("random")
    if not spec:
        return None
    from research_lm.harness.random_checkpoints import build_random_checkpoint, recipe_hash

    spec = OmegaConf.to_container(spec, resolve=True)
    arch, config, dtype = spec["architecture"], spec.get("config") or {}, spec.get("dtype", "float32")
    seed, tokenizer = int(spec.get("seed", cfg.seed)), spec.get("tokenizer", "tiny-llama")
    out = run_dir / "model"
    if spec.get("cache_dir"):
        out = Path(spec["cache_dir"]) / f"{arch}-{recipe_hash(arch, {**config, '__dtype__': dtype}, seed, tokenizer)}"
    return build_random_checkpoint(out, arch, config, seed=seed, tokenizer=tokenizer, dtype=dtype)


def _random_recipe(model_dir: Path | None) -> dict[str, Any] | None:
    if model_dir is None:
        return None
    from research_lm.harness.random_checkpoints import RECIPE

    return json.loads((model_dir / RECIPE).read_text())


def serve(engine, prompts: list, params: list, arrival_times: list[float] | None = None, *,
          clock=time.perf_counter, sleep=time.sleep, progress: bool = True) -> list:
    """Feed requests to `engine` as they arrive and step it until all finish; outputs in prompt order.

    arrival_times[i]: seconds after the start at which request i arrives (non-decreasing); None: all at
    t = 0 (the offline batch, as `LLM.generate`). Arrivals are checked between engine steps: a request
    arriving during a step is queued when the step ends, and its arrival time is set to when it arrived,
    so its TTFT includes that wait (latency under load). When nothing is running the driver sleeps
    until the next arrival. `clock` and `sleep` are injectable for tests (a simulated clock)."""
    n = len(prompts)
    arrivals = list(arrival_times) if arrival_times is not None else [0.0] * n
    if len(arrivals) != n or any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("arrival_times must be non-decreasing, one per prompt")
    order: dict[str, int] = {}
    results: list = [None] * n
    nxt = 0
    t0 = clock()
    with tqdm(total=n, desc="generate", disable=not progress, dynamic_ncols=True) as bar:
        while nxt < n or engine.has_unfinished_requests():
            now = clock() - t0 + 1e-6  # a sleep that ends a hair early (clock rounding) still admits
            while nxt < n and arrivals[nxt] <= now:
                req = engine.add_request(prompts[nxt], params[nxt])
                req.arrival_time = t0 + arrivals[nxt]
                order[req.request_id] = nxt
                nxt += 1
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
            elif nxt < n:
                sleep(max(0.0, arrivals[nxt] - (clock() - t0)))
    return results


@dataclass
class AcceptanceMetrics(EngineMetrics):
    """EngineMetrics plus speculative-decoding acceptance: per draft position j, the fraction of
    verified drafts at position j that were accepted, and the mean acceptance length tau (vLLM's
    definition: tokens emitted per target forward of a request that verified drafts = 1 + accepted /
    verifications). Without drafts it adds nothing. Beside it, `emitted_per_forward`: tokens emitted per target forward
    of a request over every step that emitted one, drafts or not: tau counts only the steps that verified drafts, so
    a proposer that drafts on fewer steps (ngram without a match) shows a higher tau than the tokens it buys."""

    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    num_verifications: int = 0
    num_accepted: int = 0
    num_evaluated: int = 0  # drafts the target judged: up to and including the first rejection
    verifications_with_k: dict[int, int] = field(default_factory=dict)  # k -> verifications with k drafts
    num_emitting: int = 0  # (request, step) pairs that emitted tokens, drafts or not
    num_emitted: int = 0  # the tokens they emitted
    # request id -> its verify steps' [real drafts, accepted], in order; None: not recorded
    traces: dict[str, list[list[int]]] | None = None

    def reset(self) -> None:
        super().reset()
        self.drafted_at, self.accepted_at = [], []
        self.num_verifications = self.num_accepted = self.num_evaluated = 0
        self.num_emitting = self.num_emitted = 0
        self.verifications_with_k = {}
        self.traces = None if self.traces is None else {}

    def record_step(self, sched, out, stats, seconds) -> None:
        super().record_step(sched, out, stats, seconds)
        self.record_acceptance(out.num_draft_tokens or [], out.sampled_token_ids)
        if self.traces is not None:
            for req_id, k, emitted in zip(out.req_ids, out.num_draft_tokens or [], out.sampled_token_ids):
                if k > 0 and emitted:  # as record_acceptance counts a verification
                    self.traces.setdefault(req_id, []).append([k, min(len(emitted) - 1, k)])

    def record_acceptance(self, num_draft_tokens: list[int], emitted_per_request: list[list[int]]) -> None:
        emitting = [emitted for emitted in emitted_per_request if emitted]
        self.num_emitting += len(emitting)
        self.num_emitted += sum(map(len, emitting))
        for k, emitted in zip(num_draft_tokens, emitted_per_request):
            if k <= 0 or not emitted:
                continue
            accepted = min(len(emitted) - 1, k)
            if len(self.drafted_at) < k:
                grow = k - len(self.drafted_at)
                self.drafted_at += [0] * grow
                self.accepted_at += [0] * grow
            for j in range(k):
                self.drafted_at[j] += 1
                self.accepted_at[j] += j < accepted
            self.num_verifications += 1
            self.num_accepted += accepted
            self.num_evaluated += min(accepted + 1, k)
            self.verifications_with_k[k] = self.verifications_with_k.get(k, 0) + 1

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        if self.num_verifications:
            out["mean_acceptance_length"] = 1.0 + self.num_accepted / self.num_verifications
            for j, (d, a) in enumerate(zip(self.drafted_at, self.accepted_at)):
                out[f"acceptance_rate_pos{j}"] = a / d if d else 0.0
            out["draft_alpha"] = alpha = self.num_accepted / self.num_evaluated
            out["leviathan_tau"] = sum(n * leviathan_tau(alpha, k) for k, n in self.verifications_with_k.items()
                                       ) / self.num_verifications
            out["emitted_per_forward"] = self.num_emitted / self.num_emitting
        return out


def leviathan_tau(alpha: float, k: int) -> float:
    """Expected tokens per target forward with k drafts each accepted independently with probability alpha
    (Leviathan et al. 2023, eq. 1): (1 - alpha^(k+1)) / (1 - alpha); k + 1 when alpha = 1. Next to the measured
    tau it tests that model: equal when acceptance does not depend on the draft position, apart when it does.
    `draft_alpha` estimates alpha as accepted drafts / drafts the target judged (every draft up to and including
    the first rejection): the maximum-likelihood estimate under that model."""
    return k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def decode_step_stats(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Step time of pure decode steps (every scheduled request computes one token plus the drafts it
    verifies; no prefill): ms per step, and their mean batch (requests per step)."""
    decode = [s for s in steps
              if s["num_reqs"] and s["num_scheduled_tokens"] == s["num_reqs"] + s.get("num_draft_tokens", 0)]
    if not decode:
        return {}
    arr = np.asarray([s["step_time_s"] * 1e3 for s in decode])
    return {"decode_step_ms_median": float(np.median(arr)), "decode_step_ms_p90": float(np.percentile(arr, 90)),
            "num_decode_steps": len(decode), "decode_batch_mean": float(np.mean([s["num_reqs"] for s in decode]))}


# Group names of conf/: a string value for one of them in a `baseline:` block names that group's option.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def baseline_config(cfg: DictConfig) -> DictConfig:
    """`cfg` with its `baseline:` block applied: `group: option` replaces a config group with that
    option (e.g. `model: random-llama`, `spec: none`); any other key (or a mapping) is merged as an
    override (e.g. `spec: {num_speculative_tokens: 0}`, `runner: {max_num_seqs: 1}`). A baseline without a spec
    method drops `acceptance_replay` (one with drafts keeps it, unless its block sets it)."""
    base = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key, value in OmegaConf.to_container(cfg.baseline, resolve=False).items():
        option = CONF_DIR / key / f"{value}.yaml" if isinstance(value, str) else None
        if option is not None and (CONF_DIR / key).is_dir():
            if not option.is_file():
                options = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
                raise ValueError(f"baseline: unknown {key} {value!r}; choose one of: {', '.join(options)}")
            base[key] = OmegaConf.load(option)
        else:
            base = OmegaConf.merge(base, {key: value})
    base.baseline = None
    if base.get("acceptance_replay") is not None and not base.spec.get("method"):
        base.acceptance_replay = None  # nothing to replay without drafts
    return base


# summary key -> name of its ratio to the baseline (this run / baseline)
_RATIOS = {"output_throughput_tok_s": "speedup", "tpot_ms_mean": "tpot_ratio",
           "decode_step_ms_median": "decode_step_ratio", "kv_bytes_per_token": "kv_bytes_per_token_ratio",
           "kv_bytes_used_max": "kv_bytes_used_ratio", "ttft_ms_mean": "ttft_ratio"}


def compare_to_baseline(main: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The baseline's key metrics (prefixed baseline_), ratios this run / baseline, and the fraction of
    requests whose output tokens are identical (1.0 expected for greedy speculative decoding)."""
    out: dict[str, Any] = {}
    s, b = main["summary"], base["summary"]
    for key, ratio in _RATIOS.items():
        if key in b:
            out[f"baseline_{key}"] = b[key]
            if key in s and b[key]:
                out[ratio] = s[key] / b[key]
    same = [m is not None and r is not None and m.outputs[0].token_ids == r.outputs[0].token_ids
            for m, r in zip(main["outputs"], base["outputs"])]
    out["outputs_match_baseline"] = sum(same) / len(same) if same else 1.0
    return out


def write_samples(path: Path, outputs: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for out in outputs:
            f.write(json.dumps({"request_id": out.request_id, "prompt": out.prompt,
                                "text": out.outputs[0].text, "token_ids": out.outputs[0].token_ids,
                                "finish_reason": out.outputs[0].finish_reason, "error": out.error}) + "\n")


def print_table(summary: dict[str, Any], run_dir: Path, lines: list[str] | None = None) -> None:
    """The summary as a markdown table, then `lines` (what drafted, notes on the result), then where it went."""
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
    width = max(len(k) for k, _ in rows)
    print(f"\n| {'metric'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|", file=sys.stdout)
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")
    if lines:
        print("\n" + "\n".join(lines))
    print(f"\nresults: {run_dir / 'results.json'}")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


@register_task("eplb_replay")
def eplb_replay(cfg: DictConfig, run_dir: Path, logger) -> dict[str, Any]:
    """Replay expert-load traces through every EPLB policy offline (`research_lm.eplb.replay`) and compare
    balancedness over time. Traces: a synthetic drifting Zipf trace (`eplb_replay.synthetic`), a recorded
    trace file (`eplb_replay.trace`, written by a run with `eplb.record_trace=<path>`), and/or one
    recorded here from a model (`eplb_replay.record_model`: a model option such as random-qwen3-moe,
    served the run's workload). Writes results.json (a row per trace x policy, the per-step curves) and
    eplb_balancedness.png."""
    from research_lm.eplb import load_trace, replay, zipf_trace

    r = OmegaConf.to_container(cfg.eplb_replay, resolve=True)
    traces: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {}
    if r.get("synthetic"):
        syn = dict(r["synthetic"])
        load = zipf_trace(syn.pop("num_steps"), syn.pop("num_layers"), syn.pop("num_experts"),
                          seed=int(syn.pop("seed", cfg.seed)), **syn)
        traces["zipf"] = (load, {"source": "synthetic zipf", **r["synthetic"]})
    if r.get("trace"):
        t = load_trace(r["trace"])
        traces[Path(r["trace"]).stem] = (t.load, {"source": str(r["trace"]), **t.meta})
    if r.get("record_model"):
        path = record_model_trace(cfg, r["record_model"], run_dir / "record")
        t = load_trace(path)
        traces[f"model:{r['record_model']}"] = (t.load, {"source": str(path), **t.meta})
    if not traces:
        raise ValueError("eplb_replay needs a trace: set eplb_replay.synthetic, eplb_replay.trace or "
                         "eplb_replay.record_model")
    rows, curves = [], {}
    for trace_name, (load, meta) in traces.items():
        num_experts = load.shape[-1]
        num_groups = int(r.get("num_groups") or meta.get("num_groups") or 1)
        num_replicas = num_experts + int(r["num_redundant_experts"])
        curves[trace_name] = {}
        for name in r.get("policies") or [*available_policies(), "static"]:  # null: every registered policy
            policy, max_rebalances = ("deepseek", 1) if name == "static" else (name, None)
            res = replay(load, policy, num_replicas, num_groups, int(r["num_nodes"]), int(r["num_ep_ranks"]),
                         step_interval=int(r["step_interval"]), window_size=int(r["window_size"]),
                         max_rebalances=max_rebalances)
            rows.append({"trace": trace_name, **res.summary(), "policy": name,
                         "num_steps": int(load.shape[0]), "num_layers": int(load.shape[1]),
                         "num_experts": num_experts})
            curves[trace_name][name] = [round(float(v), 5) for v in res.balancedness]
    for trace_name, per_policy in curves.items():  # one logged step per trace step, every policy in it
        for step in range(len(next(iter(per_policy.values())))):
            logger.log({f"balancedness/{trace_name}/{p}": c[step] for p, c in per_policy.items()}, step=step)
    summary = {f"{row['trace']}/{row['policy']}/balancedness_total": row["balancedness_total"] for row in rows}
    results = {
        "summary": summary,
        "rows": rows,
        "curves": curves,
        "traces": {k: {"shape": list(v[0].shape), "meta": v[1]} for k, v in traces.items()},
        "config": OmegaConf.to_container(cfg, resolve=True),
        "env": environment(torch.device("cpu")),
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (run_dir / "env.json").write_text(json.dumps(results["env"], indent=2) + "\n")
    from research_lm.harness.report import plot_balancedness

    plot_balancedness(curves, run_dir / "eplb_balancedness.png",
                      subtitle=f"{r['num_ep_ranks']} EP ranks, rebalance every {r['step_interval']} steps")
    print_eplb_rows(rows)
    print(f"\nresults: {run_dir / 'results.json'}")
    return results


def record_model_trace(cfg: DictConfig, model_option: str, run_dir: Path) -> Path:
    """Serve the run's workload on `model_option` (a conf/model option, or a checkpoint directory) with
    identity placement, recording the per-step expert load; return the trace file."""
    rec = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    option = CONF_DIR / "model" / f"{model_option}.yaml"
    if option.is_file():
        rec.model = OmegaConf.load(option)
    else:
        rec.model = OmegaConf.merge(OmegaConf.load(CONF_DIR / "model" / "hf.yaml"), {"name": model_option})
    run_dir.mkdir(parents=True, exist_ok=True)
    trace = run_dir / "trace.npz"
    rec.eplb = OmegaConf.merge(OmegaConf.load(CONF_DIR / "eplb" / "none.yaml"), {"record_trace": str(trace)})
    rec.baseline = None
    out = run_workload(rec, run_dir)
    if out["eplb"] is None or not trace.is_file():
        raise ValueError(f"model {model_option!r} recorded no expert load: is it a MoE model?")
    return trace


def print_eplb_rows(rows: list[dict[str, Any]]) -> None:
    print("\n| trace | policy | balancedness (time-weighted) | mean | min | rebalances | ms / rebalance |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['trace']} | {r['policy']} | {r['balancedness_total']:.3f} | {r['balancedness_mean']:.3f} | "
              f"{r['balancedness_min']:.3f} | {r['num_rebalances']} | {r['rebalance_ms_median']:.2f} |")
