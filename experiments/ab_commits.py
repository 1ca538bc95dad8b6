"""A/B of two source trees of research_lm (an old and a new commit) in one process tree, on one GPU.

    python experiments/ab_commits.py --old 27437bc                     # the old commit against this tree
    python experiments/ab_commits.py --tree old=.ab/old --tree new=.ab/new   # or any two trees (old first)

`--old COMMIT` unpacks `git archive COMMIT` into .ab/<COMMIT> (with a COMMIT file: the GPU machine's copy of a
checkout may have no .git; unpack it here and carry .ab/ there) and compares it with this tree.

Each (repeat, tree, case) runs in a fresh subprocess whose PYTHONPATH starts with that tree, so `import research_lm`
is that commit's code; the trees alternate within each repeat (old, new, old, new, ...) so that drift of the machine
hits both alike. Every case goes through the public API (`LLM`, `SamplingParams`) with the defaults a user gets:
- decode_b1: Llama-3.2-1B shape (random bf16, load_format="dummy"), one greedy request of 128 random prompt tokens
  and 256 output tokens, ms per output token after the first (RequestOutput.metrics), best of 2 after a warm-up;
- throughput: the same model, bench_throughput's nano-vllm workload (256 random prompts, input and output lengths
  uniform in [100, 1024], greedy, ignore_eos), output tok/s over the whole batch;
- spec_<method>_b<batch>: the built-in tiny-llama and its shipped EAGLE-3 head (ngram; draft_model: tiny-llama
  drafting for itself, so every draft is accepted), k = 5, greedy, code
  prompts from the corpus, 384 output tokens (`--spec-tokens`), max_num_seqs = the batch (fewer graphs to
  capture): output tok/s with speculation over output tok/s without, both built in the subprocess (the
  speedup), with tau. `--spec-repeats` (default 1).
- ablation_<method>_b<batch> (with `--reference DIR`, experiments/train_reference.sh's models, ~8.5 min of training
  on a fresh machine): spec_ablation_h200's cell at k = 5, greedy, run by the tree's own CLI, which measures its
  baseline in the same process: the speedup, tau and the outputs' match.
The old tree's commit is read from a COMMIT file at its root (write it beside the archive), else from git.
Prints a table last (each cell: median over repeats, new / old ratio) and writes <out>/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                    rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16")
SPEC = [("eagle3", 1), ("eagle3", 8), ("eagle3", 32), ("ngram", 1), ("ngram", 32), ("draft_model", 1),
        ("draft_model", 32)]
ABLATION = [(m, b) for m in ("eagle3", "draft_model", "ngram") for b in (1, 8, 32)]
HEADS = {"eagle3": "eagle3", "eagle": "eagle", "medusa": "medusa", "draft_model": "draft"}  # train_reference.sh's


def cases(reference: bool = True) -> list[str]:
    ablation = [f"ablation_{m}_b{b}" for m, b in ABLATION] if reference else []
    return ["decode_b1", "throughput"] + [f"spec_{m}_b{b}" for m, b in SPEC] + ablation


# ---- measurement (runs inside the tree under test) -----------------------------------------------------------------
def _llama_dir() -> str:
    import tempfile

    from transformers import LlamaConfig

    path = tempfile.mkdtemp(prefix="ab_llama_")
    LlamaConfig(**LLAMA_3_2_1B, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def _tok_s(outs, wall: float) -> float:
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def measure_decode_b1() -> dict:
    import random

    from research_lm import LLM, SamplingParams

    llm = LLM(_llama_dir(), load_format="dummy", dtype="bfloat16")
    prompt = [random.Random(1).randrange(LLAMA_3_2_1B["vocab_size"]) for _ in range(128)]
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    ms = []
    for _ in range(3):  # the first warms the batch-1 path
        m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
        ms.append((m.finish_time - m.first_token_time) / (m.num_output_tokens - 1) * 1e3)
    return {"value": min(ms[1:]), "unit": "ms/token", "better": "lower"}


def measure_throughput() -> dict:
    import random

    from research_lm import LLM, SamplingParams

    llm = LLM(_llama_dir(), load_format="dummy", dtype="bfloat16")
    rng = random.Random(0)
    vocab = LLAMA_3_2_1B["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(100, 1024), ignore_eos=True) for _ in prompts]
    llm.generate([p[:200] for p in prompts[:8]], SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    walls = []
    for _ in range(2):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
    return {"value": _tok_s(outs, min(walls)), "unit": "tok/s", "better": "higher"}


def measure_spec(method: str, batch: int) -> dict:
    import sysconfig

    import research_lm
    from research_lm import LLM, SamplingParams

    assets = Path(research_lm.__file__).parent / "assets"
    target = str(assets / "tiny-llama")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: 2 * batch]
    prompts = [f.read_text(errors="ignore")[:1500] for f in files][:batch]
    params = SamplingParams(temperature=0.0, max_tokens=int(os.environ.get("AB_SPEC_TOKENS", "384")), ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": 5}
    if method == "eagle3":
        spec["model"] = str(assets / "tiny-llama-eagle3")
    elif method == "draft_model":  # the target drafting for itself: every draft accepted, the mechanism's cost shows
        spec["model"] = target
    else:
        spec |= {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
    runs = {}
    for name, config in (("plain", None), ("spec", spec)):
        llm = LLM(target, max_num_seqs=batch, speculative_config=config)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        walls = []
        for _ in range(2):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
        runs[name] = (_tok_s(outs, min(walls)), outs)
        del llm
    drafts = sum(o.metrics.num_draft_tokens for o in runs["spec"][1])
    accepted = sum(o.metrics.num_accepted_tokens for o in runs["spec"][1])
    steps_per_req = drafts / 5 if drafts else 0
    return {"value": runs["spec"][0] / runs["plain"][0], "unit": "x plain", "better": "higher",
            "tau": 1 + accepted / steps_per_req if steps_per_req else None,
            "match": sum(a.outputs[0].token_ids == b.outputs[0].token_ids
                         for a, b in zip(runs["spec"][1], runs["plain"][1], strict=True)) / batch}


def measure_ablation(method: str, batch: int) -> dict:
    """One spec_ablation_h200 cell at k = 5, greedy, through the tree's own CLI (the job runs its baseline too)."""
    import tempfile

    ref = os.environ["AB_REFERENCE"]
    run_dir = Path(tempfile.mkdtemp(prefix="ab_ablation_"))
    head = [f"spec.model={ref}/{HEADS[method]}"] if method in HEADS else []
    device = os.environ.get("AB_DEVICE", "cuda")  # cpu: a smoke run of the case
    overrides = ["experiment=spec_ablation", f"device={device}", "attention=" + ("triton" if device == "cuda"
                 else "torch_ref"), "logger=jsonl", "model=hf",
                 f"model.name={ref}/target", f"spec={method}", *head, "spec.num_speculative_tokens=5",
                 "workload.temperature=0.0", "workload.max_tokens=128", "runner.num_gpu_blocks=4096",
                 f"runner.max_num_seqs={batch}", f"workload.num_requests={8 if batch == 1 else 4 * batch}",
                 f"warmup_requests={batch}", "seed=0", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-m", "research_lm", *overrides], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    s = json.loads((run_dir / "results.json").read_text())["summary"]
    return {"value": s["speedup"], "unit": "x plain", "better": "higher", "tau": s.get("mean_acceptance_length"),
            "match": s["outputs_match_baseline"]}


def measure(case: str) -> dict:
    if case.startswith("ablation_"):
        method, batch = case.removeprefix("ablation_").rsplit("_", 1)
        return measure_ablation(method, int(batch[1:]))
    if case == "decode_b1":
        return measure_decode_b1()
    if case == "throughput":
        return measure_throughput()
    method, batch = case.removeprefix("spec_").rsplit("_", 1)
    return measure_spec(method, int(batch[1:]))


# ---- orchestration ---------------------------------------------------------------------------------------------------
def run_case(tree: Path, case: str, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE), "--measure", case], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-800:], "wall_s": time.perf_counter() - t0}
    return {**json.loads(lines[-1]), "wall_s": time.perf_counter() - t0}


def git_commit(tree: Path) -> str:
    if (tree / "COMMIT").is_file():
        return (tree / "COMMIT").read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def render(result: dict) -> str:
    names = [t["name"] for t in result["trees"]]
    old, new = names[0], names[-1]
    trees = " vs ".join(f"{t['name']} = {t['commit'] or t['path']}" for t in result["trees"])
    about = (f"Device: {result['device']}; torch {result['torch']}; {result['date']}; {result['repeats']} repeats "
             f"(spec cells: {result['spec_repeats']}), trees alternating within each. Command: `{result['command']}`.")
    lines = [f"# A/B of two commits: {trees}", "", about, "",
             f"| case | unit | {' | '.join(names)} | {new} / {old} | notes |", "|---|---|" + "---|" * (len(names) + 2)]
    for case in result["cases"]:
        cells, meds = [], {}
        for name in names:
            vals = [r["value"] for r in result["runs"] if r["tree"] == name and r["case"] == case and "value" in r]
            if vals:
                meds[name] = statistics.median(vals)
                cells.append(f"{meds[name]:.4g} ({min(vals):.4g}–{max(vals):.4g})")
            else:
                cells.append("failed")
        unit = next((r["unit"] for r in result["runs"] if r["case"] == case and "unit" in r), "")
        ratio = f"{meds[new] / meds[old]:.3f}" if old in meds and new in meds else "—"
        taus = [r.get("tau") for r in result["runs"] if r["case"] == case and r.get("tau")]
        match = [r.get("match") for r in result["runs"] if r["case"] == case and r.get("match") is not None]
        notes = (f"tau {statistics.median(taus):.2f}; " if taus else "") + (
            f"outputs match plain {min(match):.2f}–{max(match):.2f}" if match else "")
        lines.append(f"| {case} | {unit} | {' | '.join(cells)} | {ratio} | {notes} |")
    return "\n".join(lines) + "\n"


def archived(commit: str) -> Path:
    """.ab/<commit>: `git archive` of the commit, unpacked beside this checkout (once), with its COMMIT file."""
    tree = HERE.parent.parent / ".ab" / commit
    if not (tree / "COMMIT").is_file():
        repo = HERE.parent.parent
        full = subprocess.run(["git", "rev-parse", commit], cwd=repo, capture_output=True, text=True, check=True)
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit], cwd=repo, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        (tree / "COMMIT").write_text(full.stdout.strip() + "\n")
    return tree


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one case, in the tree under test
    ap.add_argument("--tree", action="append", default=[], help="name=path, old first (repeat)")
    ap.add_argument("--old", help="a commit: compared, as `old`, with this tree (`new`); replaces --tree")
    ap.add_argument("--case", action="append", default=None, choices=cases())
    ap.add_argument("--reference", type=Path, help="experiments/train_reference.sh's folder: the ablation_* cells")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec-repeats", type=int, default=1)
    ap.add_argument("--spec-tokens", type=int, default=384, help="output tokens per request of the spec cells")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per (tree, case) subprocess")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results")
    ap.add_argument("--name", default="ab_commits")
    args = ap.parse_args(argv)
    if args.old:
        args.tree = [f"old={archived(args.old)}", f"new={HERE.parent.parent}"]
    if args.measure:
        print(json.dumps(measure(args.measure)), flush=True)
        return
    import torch

    os.environ["AB_SPEC_TOKENS"] = str(args.spec_tokens)  # read by the measuring subprocesses
    if args.reference:
        os.environ["AB_REFERENCE"] = str(args.reference.resolve())
    trees = [dict(zip(("name", "path"), spec.split("=", 1), strict=True)) for spec in args.tree]
    for t in trees:
        # AB_COMMIT_<NAME> first: a device's copy of the tree may carry a stale .git
        t["commit"] = os.environ.get(f"AB_COMMIT_{t['name'].upper()}") or git_commit(Path(t["path"]))
    result = {"trees": trees, "cases": args.case or cases(reference=args.reference is not None),
              "repeats": args.repeats,
              "spec_repeats": args.spec_repeats, "runs": [],
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": "python experiments/ab_commits.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    for r in range(args.repeats):
        for case in result["cases"]:
            if case.startswith(("spec_", "ablation_")) and r >= args.spec_repeats:
                continue
            for t in trees:
                run = {"tree": t["name"], "case": case, "repeat": r,
                       **run_case(Path(t["path"]), case, args.timeout)}
                print(json.dumps(run), flush=True)
                result["runs"].append(run)
                table = write(result, args.out, args.name)  # after every run: a call cut short keeps what ran
    print(table)


def write(result: dict, out: Path, name: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    table = render(result)
    (out / f"{name}.md").write_text(table)
    return table


if __name__ == "__main__":
    main()
