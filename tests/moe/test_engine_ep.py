"""Engine-level expert parallelism (research_lm.engine.distributed): `LLM` on 2 ranks (gloo on CPU; NCCL on 2 GPUs),
each holding only its half of every MoE layer's slots, generates the single-process run's greedy tokens
through rebalances that send experts between ranks, one layer a step (chunked moves), with least-loaded
dispatch among replicas (`lplb`), the single-process run's placements, EPLB metrics and load trace; the
same ranks run layer EP with least-loaded dispatch (per-expert counts all-reduced); a launch that cannot
work fails with a sentence."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from research_lm import LLM, SamplingParams
from research_lm.engine.distributed import setup_expert_parallel
from research_lm.eplb import get_policy, load_trace
from research_lm.eplb.controller import moe_layers
from research_lm.eplb.dispatch import least_loaded
from research_lm.models import load_model
from research_lm.moe import MoeBlock, MoeOptions, RouterConfig
from research_lm.moe.ep import transfer_plan

WORLD = 2
# 8 experts + 2 redundant = 10 slots, 5 per rank; a rebalance every 2 steps (7 over the run), its 2 layers moving
# after the next 2 steps; tokens go to the least-loaded replica (lplb)
EPLB = dict(policy="lplb", step_interval=2, window_size=3, num_redundant_experts=2, num_ep_ranks=WORLD,
            rebalance_layers_per_chunk=1)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
SUMMARY_KEYS = ("num_steps", "tokens_routed", "rank_load", "balancedness_total", "num_rebalances",
                "moved_slots_total", "experts_moved_per_rebalance", "balancedness_layer_min", "dispatch")


def _llm(path, device: str, eplb: dict | None, num_gpu_blocks: int | None = None) -> LLM:
    # a 16-token budget: chunked prefill steps of 16 tokens, then decode steps of 1 to 4 (a rank's shard empty).
    # Synchronous steps, as expert parallelism runs them: launched ahead (CUDA's default), a rebalance lands a step
    # later, so the simulated ranks would end on another (equally valid) placement than the real ones.
    return LLM(str(path), dtype="float32", device=device, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
               max_model_len=64, eplb_config=eplb, num_gpu_blocks=num_gpu_blocks, async_scheduling=False)


def _generate(llm: LLM) -> list[list[int]]:
    """Greedy tokens, each followed by its logprob: the tokens alone barely notice a wrong expert output."""
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (4, 9, 15, 22, 31)]
    return [[x for token, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
             for x in (token, lp[token].logprob)] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _assert_same(got: list[list[float]], want: list[list[float]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g[0::2] == w[0::2]  # tokens: identical
        torch.testing.assert_close(torch.tensor(g[1::2]), torch.tensor(w[1::2]), atol=1e-5, rtol=1e-5)


def _worker(rank: int, port: int, device: str, path: str, out_dir: str) -> None:
    """One torchrun-like rank: the engine creates the process group from these variables."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    try:
        trace = str(Path(out_dir) / "ep_trace.npz")  # rank 0 writes it
        llm = _llm(path, device, {**EPLB, "expert_parallel": True, "record_trace": trace})
        layers = moe_layers(llm.engine.model)
        cross_rank = []  # per rebalance and layer: slots that receive an expert from the other rank
        for layer in layers:
            def apply(phy2log, log2phy, logcnt, layer=layer, apply=layer.apply_placement):
                plan = transfer_plan(layer.phy2log_cpu, layer.log2phy_cpu, phy2log, layer.num_local_slots)
                cross_rank.append(sum(d // layer.num_local_slots != s // layer.num_local_slots for d, s in plan))
                return apply(phy2log, log2phy, logcnt)
            layer.apply_placement = apply
        tokens = _generate(llm)

        # this rank holds its slots only, and each holds the expert its (final) map names: compare with
        # every slot of a single-process model moved to the same placement
        ref = load_model(path, device=llm.engine.info.device, dtype=torch.float32, attention_backend="torch_ref",
                         extra={"eplb": EPLB})[0]
        for layer, ref_layer in zip(layers, moe_layers(ref), strict=True):
            assert layer.gate_up_proj.shape[0] == layer.down_proj.shape[0] == layer.num_slots // WORLD
            ref_layer.apply_placement(layer.phy2log_cpu, layer.log2phy_cpu, layer.logcnt.cpu())
            mine = slice(rank * layer.num_local_slots, (rank + 1) * layer.num_local_slots)
            assert torch.equal(layer.gate_up_proj, ref_layer.gate_up_proj[mine])
            assert torch.equal(layer.down_proj, ref_layer.down_proj[mine])
        summary = llm.engine.eplb.summary()
        result = {"tokens": tokens, "phy2log": [layer.phy2log_cpu.tolist() for layer in layers],
                  "cross_rank_moves": sum(cross_rank), "summary": {k: summary[k] for k in SUMMARY_KEYS},
                  "num_blocks": llm.engine.num_blocks}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
        _check_layer_ep_least_loaded(rank, llm.engine.info.device)
        dist.barrier()  # no rank tears its connections down while the other may still use them
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(0)  # passed: skip interpreter finalization, where gloo's threads can abort (SIGABRT) under load


def _check_layer_ep_least_loaded(rank: int, device: torch.device) -> None:
    """Layer EP (each rank its own tokens) with least-loaded dispatch: outputs equal the single-process layer's,
    and the ranks' pairs together follow the split of the all-reduced counts (within a pair per rank)."""
    num_experts, hidden, inter = 6, 16, 12
    eplb = {"policy": "lplb", "num_redundant_experts": 2, "num_ep_ranks": WORLD}
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(num_experts, hidden, generator=gen)
    w13, w2 = torch.randn(num_experts, 2 * inter, hidden, generator=gen), torch.randn(num_experts, hidden, inter,
                                                                                      generator=gen)
    placement = get_policy("deepseek")(torch.tensor([[50.0, 30.0, 5, 5, 5, 5]]), num_experts + 2, 1, 1, WORLD)
    blocks = []
    for extra in ({"eplb": eplb, "ep_group": dist.group.WORLD}, {"eplb": eplb}):
        with torch.device(device):
            block = MoeBlock(hidden, inter, num_experts, RouterConfig(top_k=2), MoeOptions.from_extra(extra, device))
        ex = block.experts
        with torch.no_grad():
            block.gate.weight.copy_(gate)
            ex.gate_up_proj.weight_loader(ex.gate_up_proj, w13 * 0.2, None)
            ex.down_proj.weight_loader(ex.down_proj, w2 * 0.2, None)
        ex.apply_placement(*(t[0] for t in placement))  # layer EP: the ranks send weights to each other
        blocks.append(block)
    ep, single = blocks
    x = (torch.randn(12 if rank == 0 else 7, hidden, generator=torch.Generator().manual_seed(5 + rank)) * 3).to(device)
    with torch.no_grad():
        torch.testing.assert_close(ep(x), single(x), atol=1e-5, rtol=0)
        ids = ep.gate(x)[1]
        slots = ep.experts.to_physical(ids)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    per_slot = torch.bincount(slots.flatten(), minlength=num_experts + 2)
    for t in (counts, per_slot):
        dist.all_reduce(t)
    _, alloc = least_loaded(counts[None, None], ep.experts.log2phy[None], WORLD, (num_experts + 2) // WORLD,
                            return_alloc=True)
    replicas = ep.experts.log2phy
    want = torch.zeros(num_experts + 2, dtype=torch.float64, device=replicas.device).index_add_(
        0, replicas[replicas >= 0], alloc[0, 0][replicas >= 0])
    assert (per_slot.double() - want).abs().max() <= WORLD


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_engine_ep(path, device: str, out_dir: Path) -> None:
    # Every request at full length fits in 65 blocks. Fixed here, so that on a GPU these runs leave memory to
    # the rank sharing their GPU: the ranks size their caches from free memory (different) and agree on the min.
    plain = _generate(_llm(path, device, None, num_gpu_blocks=65))
    # the same rebalances, simulated ranks, one process
    single = _llm(path, device, {**EPLB, "record_trace": str(out_dir / "trace.npz")}, num_gpu_blocks=65)
    _assert_same(_generate(single), plain)
    summary = single.engine.eplb.summary()
    assert summary["num_rebalances"] >= 3 and summary["moved_slots_total"] > 0
    mp.spawn(_worker, args=(_free_port(), device, str(path), str(out_dir)), nprocs=WORLD, join=True)
    ranks = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert len({got["num_blocks"] for got in ranks}) == 1
    for got in ranks:
        _assert_same(got["tokens"], plain)
        assert got["phy2log"] == [layer.phy2log_cpu.tolist() for layer in moe_layers(single.engine.model)]
        assert got["summary"] == {k: summary[k] for k in SUMMARY_KEYS}
        assert got["cross_rank_moves"] > 0, "no rebalance sent an expert to the other rank"
    assert torch.equal(load_trace(out_dir / "ep_trace.npz").load, load_trace(out_dir / "trace.npz").load)


def test_engine_expert_parallel_matches_single_process(tiny_checkpoint, tmp_path):
    """gloo, 2 CPU processes, tiny Mixtral (8 experts, top-2, 2 layers)."""
    _check_engine_ep(tiny_checkpoint("mixtral"), "cpu", tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 GPUs")
def test_engine_expert_parallel_nccl(tiny_checkpoint, tmp_path):
    """The same over NCCL, one GPU per rank (the KV budget comes from each GPU's free memory: agreed by min)."""
    _check_engine_ep(tiny_checkpoint("mixtral"), "cuda", tmp_path)


def test_expert_parallel_needs_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        setup_expert_parallel({**EPLB, "expert_parallel": True}, torch.device("cpu"))
    assert setup_expert_parallel(EPLB, torch.device("cpu")) is None  # simulated ranks: no process group


def test_num_ep_ranks_must_equal_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"num_ep_ranks \(2\) must equal the number of processes \(WORLD_SIZE=4\)"):
        setup_expert_parallel({**EPLB, "expert_parallel": True}, torch.device("cpu"))


def test_expert_parallel_layer_needs_a_group():
    with pytest.raises(ValueError, match="needs a process group"):
        MoeOptions.from_extra({"eplb": {**EPLB, "expert_parallel": True}}, torch.device("cpu"))
