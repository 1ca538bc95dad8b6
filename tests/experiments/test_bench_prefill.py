"""bench_prefill on CPU: every engine measured and the table written (no graphs on a CPU: the plumbing only)."""

from __future__ import annotations

import json
import sys

from tests.experiments.conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import bench_prefill  # noqa: E402  (experiments/ is a folder of scripts, not a package)


def test_bench_prefill_measures_every_engine_on_cpu(tmp_path):
    payload = bench_prefill.main(["--device", "cpu", "--requests", "2", "--min-len", "5", "--max-len", "12",
                                  "--k", "2", "--repeats", "1", "--out", str(tmp_path)])
    rows = {r["run"]: r for r in payload["rows"]}
    assert set(rows) == {"plain", "plain eager prompts", "eagle3", "eagle3 eager prompts"}
    assert all(r["ms_per_request"] > 0 and r["step_ms"] > 0 for r in rows.values())
    saved = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert saved["rows"] and "| eagle3 eager prompts |" in (tmp_path / "bench_prefill.md").read_text()
