"""bench_throughput's roofline: its byte count and its time agree where every step is bandwidth-bound."""

from __future__ import annotations

import sys

from tests.experiments.conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import bench_throughput as bt  # noqa: E402  (experiments/ is a folder of scripts, not a package)


def test_roofline_bytes_match_the_roofline_time_when_bandwidth_bound():
    in_lens, out_lens = [10, 20, 30], [4, 2, 6]
    w, kv, bw = 1000, 3, 1e3  # weights and KV per token in bytes, bytes per second
    nbytes = bt.roofline_bytes(in_lens, out_lens, weight_bytes=w, kv_bytes_per_token=kv)
    # prefill reads the weights once; decode step s reads them again plus the KV of requests with o > s
    want = w + sum(w + sum(i + s for i, o in zip(in_lens, out_lens) if o > s) * kv for s in range(1, 6))
    assert nbytes == want
    flops = float("inf")  # nothing is compute-bound: the roofline time is exactly bytes / bandwidth
    t = bt.roofline_s(in_lens, out_lens, params=1, weight_bytes=w, kv_bytes_per_token=kv, copy_bw=bw, flops=flops)
    assert t == (nbytes - w) / bw  # the prefill's weight read is not timed (it is compute-bound at any real size)
