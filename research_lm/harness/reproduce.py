"""`python -m research_lm.harness.reproduce <run dir>`: re-run a run from its recorded config into a new directory
and say whether the results are the same.

    python -m research_lm.harness.reproduce outputs/2026-11-22/10-00-00              # -> ..._reproduced
    python -m research_lm.harness.reproduce outputs/... --out /tmp/again --logger none --set workload.max_tokens=8

What it re-runs: the resolved config in the run's results.json (else .hydra/config.yaml), in this process,
with the recorded torch thread count (CPU float reductions depend on it). A training run writes its
checkpoint inside the new directory instead of over the recorded `train.output_dir`.
What it compares:
- the token ids of every request (samples.jsonl), request by request: identical on CPU for the same code,
  versions and thread count (with or without `deterministic=true`); on a GPU only as deterministic as
  torch allows (see conf/README.md, "Reproducibility");
- the summary metrics that do not measure time (token counts, steps, acceptance, balancedness, ...);
- for eplb_replay, the balancedness curves.
It warns when the commit, the dirty flag, package versions or the device differ from the recording.
Writes <new dir>/reproduce.json; exits 0 when identical, 1 when not, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

# Summary keys that measure time (or derive from it) and so differ between runs.
_TIMED = re.compile(r"(_s$|_ms|time|throughput|elapsed|speedup|ratio|fraction|gb_s|tok_s|wall|rate_s$|^eplb_.*ms)")


def load_recorded(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config, results) of a run directory."""
    results_file = run_dir / "results.json"
    if not results_file.is_file():
        raise FileNotFoundError(f"{run_dir} has no results.json: not a research_lm run directory")
    results = json.loads(results_file.read_text())
    config = results.get("config")
    if config is None and (run_dir / ".hydra" / "config.yaml").is_file():
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=True)
    if config is None:
        raise ValueError(f"{run_dir}/results.json records no config")
    return config, results


def _samples(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {str(r["request_id"]): r for r in rows}


def compare(old_dir: Path, new_dir: Path) -> dict[str, Any]:
    """Compare two run directories: token outputs, untimed summary metrics, eplb curves."""
    old = json.loads((old_dir / "results.json").read_text())
    new = json.loads((new_dir / "results.json").read_text())
    report: dict[str, Any] = {"old": str(old_dir), "new": str(new_dir)}
    a, b = _samples(old_dir / "samples.jsonl"), _samples(new_dir / "samples.jsonl")
    if a or b:
        key = "token_ids" if all("token_ids" in r for r in [*a.values(), *b.values()]) else "text"
        differ = sorted((rid for rid in set(a) | set(b) if (a.get(rid) or {}).get(key) != (b.get(rid) or {}).get(key)),
                        key=lambda r: (len(r), r))
        report["samples"] = {"compared": key, "num_requests": len(set(a) | set(b)), "num_different": len(differ),
                             "different_request_ids": differ[:20]}
    sa, sb = old.get("summary") or {}, new.get("summary") or {}
    untimed = [k for k in sorted(set(sa) | set(sb)) if not _TIMED.search(k)]
    if ((old.get("config") or {}).get("workload") or {}).get("request_rate") is not None:
        untimed = []  # arrivals follow the wall clock: batching (steps, KV usage) differs, tokens must not
        report["note"] = "timed arrivals (workload.request_rate): only the token outputs are compared"
    report["metrics"] = {"compared": untimed,
                         "different": {k: [sa.get(k), sb.get(k)] for k in untimed if sa.get(k) != sb.get(k)}}
    if "curves" in old or "curves" in new:
        report["curves_identical"] = old.get("curves") == new.get("curves")
    report["identical"] = (
        (report.get("samples") or {}).get("num_different", 0) == 0
        and not report["metrics"]["different"]
        and report.get("curves_identical", True)
    )
    report["warnings"] = environment_warnings(old.get("env") or {}, new.get("env") or {})
    return report


def environment_warnings(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    og, ng = old.get("git") or {}, new.get("git") or {}
    if og.get("commit") != ng.get("commit"):
        out.append(f"recorded at commit {og.get('commit')}, re-run at {ng.get('commit')}")
    if og.get("dirty") or ng.get("dirty"):
        out.append("a working tree had uncommitted changes (dirty): the code may differ from the commit")
    for pkg, version in (old.get("packages") or {}).items():
        now = (new.get("packages") or {}).get(pkg)
        if version != now:
            out.append(f"{pkg} {version} recorded, {now} now")
    for key in ("device", "device_name"):
        if old.get(key) != new.get(key):
            out.append(f"{key}: {old.get(key)} recorded, {new.get(key)} now")
    return out


def _new_dir(run_dir: Path) -> Path:
    base = run_dir.parent / f"{run_dir.name}_reproduced"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}{n}")
    return out


def reproduce(run_dir: Path, out_dir: Path | None = None, logger: str | None = None,
              overrides: list[str] | None = None) -> dict[str, Any]:
    import torch
    from omegaconf import OmegaConf

    from research_lm.harness.experiment import run

    run_dir = Path(run_dir)
    config, results = load_recorded(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else _new_dir(run_dir)
    cfg = OmegaConf.create(config)
    if logger is not None:
        cfg.logger = {"name": logger} if logger != "wandb" else {**config.get("logger", {}), "name": "wandb"}
    if "train" in cfg and cfg.train.get("output_dir"):
        cfg.train.output_dir = str(out_dir / "checkpoint")
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    threads = (results.get("reproducibility") or {}).get("torch_num_threads")
    if threads:
        torch.set_num_threads(int(threads))
    run(cfg, out_dir)
    report = compare(run_dir, out_dir)
    # what this directory re-ran, next to its own reproducibility record
    new_results = json.loads((out_dir / "results.json").read_text())
    new_results.setdefault("reproducibility", {})["reproduced_from"] = str(run_dir)
    new_results["reproducibility"]["overrides"] = (results.get("reproducibility") or {}).get("overrides")
    (out_dir / "results.json").write_text(json.dumps(new_results, indent=2, default=str) + "\n")
    (out_dir / "reproduce.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research_lm.harness.reproduce", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a run directory (holding results.json)")
    ap.add_argument("--out", type=Path, default=None, help="where to re-run (default: <run_dir>_reproduced)")
    ap.add_argument("--logger", choices=("none", "jsonl", "wandb"), default=None,
                    help="logger of the re-run (default: the recorded one)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recorded config key (dot notation); the comparison then tells what changed")
    args = ap.parse_args(argv)
    try:
        report = reproduce(args.run_dir, args.out, args.logger, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"research_lm.harness.reproduce: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    for w in report["warnings"]:
        print(f"warning: {w}")
    s = report.get("samples")
    if s:
        print(f"outputs ({s['compared']}): {s['num_requests'] - s['num_different']}/{s['num_requests']} requests "
              f"identical" + (f"; different: {', '.join(s['different_request_ids'])}" if s["num_different"] else ""))
    diff = report["metrics"]["different"]
    print(f"untimed metrics: {len(report['metrics']['compared']) - len(diff)}/{len(report['metrics']['compared'])} "
          "identical" + "".join(f"\n  {k}: {v[0]} -> {v[1]}" for k, v in diff.items()))
    if "curves_identical" in report:
        print(f"eplb curves identical: {report['curves_identical']}")
    print(f"{'IDENTICAL' if report['identical'] else 'DIFFERENT'}: {args.run_dir} vs {report['new']} "
          f"(details: {Path(report['new']) / 'reproduce.json'})")
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
