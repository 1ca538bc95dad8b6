"""bench_spec_host on CPU: every engine measured, each phase timed where it runs, the table written."""

from __future__ import annotations

import json
import sys

from tests.experiments.conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import bench_spec_host  # noqa: E402  (experiments/ is a folder of scripts, not a package)


def test_bench_spec_host_times_every_phase_on_cpu(tmp_path):
    payload = bench_spec_host.main(["--device", "cpu", "--tokens", "6", "--repeats", "1", "--out", str(tmp_path)])
    rows = {r["run"]: r for r in payload["rows"]}
    inputs = {"plain inputs launched", "eagle3 inputs launched"}
    assert set(rows) == {"plain", "eagle3", "eagle3 verify first"} | inputs
    assert rows["plain"]["tau"] == rows["plain inputs launched"]["tau"] == 1.0
    assert rows["eagle3"]["tau"] == rows["eagle3 verify first"]["tau"] == rows["eagle3 inputs launched"]["tau"] >= 1.0
    assert "verify_us" not in rows["plain"] and "propose_us" not in rows["plain"]
    assert all(f"{p}_us" in rows["eagle3"] for p in bench_spec_host.PHASES)
    assert rows["eagle3"]["step_us"] > rows["eagle3"]["propose_us"] > 0
    saved = json.loads((tmp_path / "bench_spec_host.json").read_text())
    assert saved["rows"] and "| eagle3 | 1 |" in (tmp_path / "bench_spec_host.md").read_text()


def test_bench_spec_host_at_temperature_1_ab_tests_the_rejection_kernel(tmp_path):
    payload = bench_spec_host.main(["--device", "cpu", "--tokens", "6", "--repeats", "1", "--temperature", "1.0",
                                    "--out", str(tmp_path)])
    rows = {r["run"]: r for r in payload["rows"]}
    assert set(rows) == {"plain", "eagle3", "eagle3 torch rejection", "plain inputs launched", "eagle3 inputs launched"}
    assert rows["eagle3"]["tau"] == rows["eagle3 torch rejection"]["tau"]  # CPU: the torch path both times
    assert "temperature 1" in (tmp_path / "bench_spec_host.md").read_text()
