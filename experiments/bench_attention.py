"""Paged-attention microbenchmark: triton vs torch_ref vs FlashInfer vs torch SDPA on a dense cache.

    python experiments/bench_attention.py            # full grid
    python experiments/bench_attention.py --quick    # a few points, for a smoke run
    python -m experiments.paper bench_attention      # the committed table (experiments/paper/)

Attention shape of Llama-3-8B (32 query heads, 8 KV heads, head dim 128), page size 16, bf16, pages
of each request scattered at random over the pool (what a paged cache looks like after a while).
Decode: batch {1, 16, 64, 256} x context {512, 2k, 8k, 32k}, one query token per request; the time
is the attention kernel(s) alone (KV write excluded) replayed from a CUDA graph, as the runner runs
decode (the eager time, host launch cost included, is shown beside it); achieved bandwidth counts the
K and V bytes read, and "% copy" divides it by the device-to-device copy bandwidth (read + write)
measured in the same run. Prefill: every request prefills its whole context (causal), reported in TFLOP/s.
"vs FlashInfer" is FlashInfer's time / this backend's time (> 1: faster than FlashInfer).
The whole grid is measured `--repeats` times (default 3) in this process; each cell shows the median over
the repeats and their min–max where they differ.
Prints a table last; writes experiments/results/bench_attention.{md,json}. CUDA only.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import torch
from bench_common import add_repeat_args, cell, env_line, repeats_line, run_table

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES, CONTEXTS = (1, 16, 64, 256), (512, 2048, 8192, 32768)
NAME = "bench_attention"


def bench_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn) -> float:
    """Median time of one CUDA-graph replay of fn: the GPU's time, as the runner's decode graphs see it."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (compile, plan caches) off the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    buffers = torch.empty(2, 2 << 30, dtype=torch.uint8, device="cuda")
    ms = bench_ms(lambda: buffers[1].copy_(buffers[0]))
    return 2 * buffers[0].numel() / (ms * 1e-3)


class Case:
    """One paged batch on the GPU: the cache, block tables and the common metadata record."""

    def __init__(self, batch: int, ctx: int, phase: str):
        from attention_zoo.metadata import CommonAttentionMetadata

        self.batch, self.ctx, self.phase = batch, ctx, phase
        pages = math.ceil(ctx / PAGE)
        num_blocks = batch * pages + 1
        dev = "cuda"
        self.kv_cache = torch.empty(2, num_blocks, PAGE, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device=dev)
        self.kv_cache.normal_()
        self.block_table = (torch.randperm(num_blocks - 1, device=dev) + 1).int().view(batch, pages)
        q_len = 1 if phase == "decode" else ctx
        self.q_len = q_len
        self.q = torch.randn(batch * q_len, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device=dev)
        qsl = torch.arange(batch + 1, dtype=torch.int32) * q_len
        seq = torch.full((batch,), ctx, dtype=torch.int32)
        self.common = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev), seq_lens_cpu=seq,
            num_computed_tokens_cpu=seq - q_len, block_table=self.block_table,
            slot_mapping=torch.full((batch * q_len,), -1, dtype=torch.int64, device=dev),
            request_rows=torch.arange(batch, dtype=torch.int32, device=dev), num_reqs=batch,
            num_tokens=batch * q_len, max_query_len=q_len, max_seq_len=ctx, block_size=PAGE,
        )  # fmt: skip

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.ctx * NUM_KV_HEADS * HEAD_SIZE * self.kv_cache.element_size()

    @property
    def flops(self) -> float:  # QK^T and PV over the causal triangle
        pairs = self.batch * sum(self.ctx - self.q_len + i + 1 for i in range(self.q_len))
        return 4.0 * pairs * NUM_HEADS * HEAD_SIZE


def spec():
    from attention_zoo.base import AttentionSpec

    return AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5)


def run_triton(case: Case):
    from attention_zoo.triton_attn import TritonAttentionBackend
    from attention_zoo.triton_kernels import unified_attention

    plan = TritonAttentionBackend.build_metadata(case.common).plan(spec())
    out = torch.empty_like(case.q)
    c = case.common
    return lambda: unified_attention(
        case.q, case.kv_cache, out, c.query_start_loc, c.seq_lens, c.block_table, num_reqs=c.num_reqs,
        scale=HEAD_SIZE**-0.5, sliding_window=None, config=plan.tile, num_splits=plan.num_splits,
    ), f"splits={plan.num_splits} block_q={plan.tile.block_q} tile_n={plan.tile.tile_n}"  # fmt: skip


def run_torch_ref(case: Case):
    from attention_zoo.torch_ref import TorchRefBackend

    impl = TorchRefBackend.make_impl(spec())
    kv = torch.zeros(case.q.shape[0], NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")  # slots are -1
    return lambda: impl.forward(case.q, kv, kv, case.kv_cache, case.common), ""


def run_flashinfer(case: Case):
    import flashinfer

    b, pages = case.block_table.shape
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda") * pages
    last = torch.full((b,), (case.ctx - 1) % PAGE + 1, dtype=torch.int32, device="cuda")
    paged = (case.kv_cache[0], case.kv_cache[1])
    if case.phase == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD", use_tensor_cores=True)
        wrapper.plan(
            indptr=indptr, indices=case.block_table.flatten(), last_page_len=last, num_qo_heads=NUM_HEADS,
            num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_SIZE, page_size=PAGE, pos_encoding_mode="NONE",
            sm_scale=HEAD_SIZE**-0.5, q_data_type=DTYPE, kv_data_type=DTYPE,
        )  # fmt: skip
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        wrapper.plan(
            qo_indptr=case.common.query_start_loc, paged_kv_indptr=indptr,
            paged_kv_indices=case.block_table.flatten(), paged_kv_last_page_len=last, num_qo_heads=NUM_HEADS,
            num_kv_heads=NUM_KV_HEADS, head_dim_qk=HEAD_SIZE, page_size=PAGE, causal=True,
            pos_encoding_mode="NONE", sm_scale=HEAD_SIZE**-0.5, q_data_type=DTYPE, kv_data_type=DTYPE,
        )  # fmt: skip
    return lambda: wrapper.run(case.q, paged), f"flashinfer {flashinfer.__version__}"


def run_sdpa_dense(case: Case):
    """A dense [batch, kv_heads, ctx, d] cache: no paging at all, the peer with the easiest job."""
    b, s = case.batch, case.ctx
    k = torch.randn(b, NUM_KV_HEADS, s, HEAD_SIZE, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    q = case.q.view(b, case.q_len, NUM_HEADS, HEAD_SIZE).transpose(1, 2)
    causal = case.phase == "prefill"
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), ""


RUNNERS = {"triton": run_triton, "flashinfer": run_flashinfer, "torch_ref": run_torch_ref, "sdpa_dense": run_sdpa_dense}


def fits(name: str, case: Case, free_bytes: int) -> bool:
    if name == "torch_ref":  # a Python loop that gathers and upcasts each request's whole context
        return case.batch * case.ctx <= 64 * 8192 and case.phase == "decode" or case.batch * case.ctx <= 16384
    if name == "sdpa_dense":
        return case.kv_bytes * 1.2 < free_bytes
    return True


def grid(quick: bool, phase: str) -> list[tuple[int, int]]:
    if quick:
        points = [(1, 8192), (16, 8192), (64, 8192), (256, 2048), (8, 32768)]
        return points if phase == "decode" else [(1, 8192), (4, 2048)]
    if phase == "decode":
        return [(b, c) for b in BATCHES for c in CONTEXTS]
    return [(b, c) for b in BATCHES for c in CONTEXTS if b * c <= 65536]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--phases", default="decode,prefill")
    p.add_argument("--backends", default=",".join(RUNNERS))
    add_repeat_args(p)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention: needs a CUDA GPU (speed claims are made on the GPU); none found, nothing run.")
    shape = dict(heads=NUM_HEADS, kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, page=PAGE, dtype=str(DTYPE))
    return run_table(args.name or NAME, torch.device("cuda"), args, measure, render,
                     ("phase", "batch", "ctx", "backend"), shape=shape)


def measure(args) -> dict[str, Any]:
    """One repeat of the whole grid: {copy_tb_s, rows}."""
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    rows: list[dict] = []
    for phase in args.phases.split(","):
        for batch, ctx in grid(args.quick, phase):
            case = Case(batch, ctx, phase)
            free = torch.cuda.mem_get_info()[0]
            times: dict[str, float] = {}
            for name in args.backends.split(","):
                row = dict(phase=phase, batch=batch, ctx=ctx, backend=name)
                if not fits(name, case, free):
                    continue
                try:
                    fn, note = RUNNERS[name](case)
                    eager = bench_ms(fn)
                    ms = eager if name == "torch_ref" else graph_ms(fn)  # torch_ref syncs: no graph
                    times[name] = ms
                except Exception as e:  # a missing or failing peer is reported, not fatal
                    rows.append(row | dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
                    continue
                row |= dict(ms=ms, eager_ms=eager, note=note)
                if phase == "decode":
                    row |= dict(gb_s=case.kv_bytes / (ms * 1e-3) / 1e9, pct_copy=case.kv_bytes / (ms * 1e-3) / copy_bw)
                else:
                    row |= dict(tflop_s=case.flops / (ms * 1e-3) / 1e12)
                rows.append(row)
                torch.cuda.empty_cache()
            for row in rows:
                here = (row["phase"], row["batch"], row["ctx"]) == (phase, batch, ctx)
                if here and "ms" in row and "flashinfer" in times:
                    row["vs_flashinfer"] = times["flashinfer"] / row["ms"]
            del case
            torch.cuda.empty_cache()
    return {"copy_tb_s": copy_bw / 1e12, "rows": rows}


def render(payload: dict[str, Any]) -> str:
    env = payload["env"]
    head = (f"{env_line(env)}\n\ncopy bandwidth {cell(payload, 'copy_tb_s', '.2f')} TB/s (read+write); 32 q / 8 kv "
            f"heads, d 128, page 16, bf16. ms: one CUDA-graph replay (torch_ref: eager); eager ms: launched from "
            f"Python, host launch cost included; L2 flushed before each run. {repeats_line(payload)}\n")  # fmt: skip
    lines = [head, "| phase | batch | ctx | backend | ms | eager ms | GB/s | % copy | TFLOP/s | vs FlashInfer | note |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for r in payload["rows"]:
        note = r.get("note") or r.get("error", "")
        if r.get("errors"):
            note += f"; {len(r['errors'])} repeat(s) failed: {r['errors'][0]}"
        lines.append(
            f"| {r['phase']} | {r['batch']} | {r['ctx']} | {r['backend']} | {cell(r, 'ms', '.4f')} | "
            f"{cell(r, 'eager_ms', '.4f')} | "
            f"{cell(r, 'gb_s', '.0f')} | {cell(r, 'pct_copy', '.0%')} | {cell(r, 'tflop_s', '.0f')} | "
            f"{cell(r, 'vs_flashinfer', '.2f')} | {note} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
