"""Real expert parallelism over torch.distributed (gloo on CPU, NCCL on 2 GPUs; 2 processes): each rank holds half the
slots, dispatches its own tokens with all-to-all and gets the single-process layer's outputs; an EPLB
rebalance (load all-reduced, weights sent point to point) leaves the outputs unchanged."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from research_lm.eplb import get_policy
from research_lm.eplb.controller import EplbController
from research_lm.eplb.settings import EplbSettings
from research_lm.moe import MoeBlock, MoeOptions, RouterConfig
from research_lm.moe.ep import transfer_plan

E, H, INTER, WORLD = 6, 16, 12, 2
EPLB = {"policy": "deepseek", "step_interval": 1, "window_size": 4, "num_redundant_experts": 2, "num_ep_ranks": WORLD}


def _block(extra: dict, device: torch.device) -> MoeBlock:
    """A block with the same logical weights in every process (seeded), loaded through the loaders."""
    with torch.device(device):
        block = MoeBlock(H, INTER, E, RouterConfig(top_k=2), MoeOptions.from_extra(extra, device),
                         shared_intermediate_size=8, shared_expert_gate=True)
    gen = torch.Generator().manual_seed(0)
    ex = block.experts
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=gen))
        ex.gate_up_proj.weight_loader(ex.gate_up_proj, torch.randn(E, 2 * INTER, H, generator=gen) * 0.2, None)
        ex.down_proj.weight_loader(ex.down_proj, torch.randn(E, H, INTER, generator=gen) * 0.2, None)
        for name, p in block.named_parameters():
            if "shared" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return block


def _check_local_slots(ep_block: MoeBlock, ref_block: MoeBlock) -> None:
    ex, ref = ep_block.experts, ref_block.experts
    local = slice(ex.slot_offset, ex.slot_offset + ex.num_local_slots)
    assert ex.num_local_slots == (E + 2) // WORLD
    assert torch.equal(ex.gate_up_proj, ref.gate_up_proj[local]) and torch.equal(ex.down_proj, ref.down_proj[local])


def _worker(rank: int, port: int, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    try:
        ep_block = _block({"eplb": EPLB, "ep_group": dist.group.WORLD}, device)
        ref_block = _block({"eplb": EPLB}, device)  # every slot, one process
        _check_local_slots(ep_block, ref_block)
        # ranks bring different token counts (rank 1 once brings none)
        x = torch.randn(9 if rank == 0 else 4, H, generator=torch.Generator().manual_seed(10 + rank)) * 3
        x = x.to(device)
        with torch.no_grad():
            for tokens in (x, x[:0] if rank == 1 else x[:3]):
                torch.testing.assert_close(ep_block(tokens), ref_block(tokens), atol=1e-6, rtol=0)

        # One engine step's worth of load, then a rebalance driven by the controller.
        controller = EplbController([ep_block.experts], EplbSettings.from_dict(EPLB))
        ex = ep_block.experts
        old_phy2log, old_log2phy = ex.phy2log_cpu.clone(), ex.log2phy_cpu.clone()
        with torch.no_grad():
            ep_block(x)
        controller.step()
        assert controller.num_rebalances == 1 and controller.moved_slots[0] > 0
        plan = transfer_plan(old_phy2log, old_log2phy, ex.phy2log_cpu, ex.num_local_slots)
        assert any(d // ex.num_local_slots != s // ex.num_local_slots for d, s in plan), "no cross-rank move"
        # The same placement on the single-process copy, from the all-ranks load the controller used.
        phy2log, log2phy, logcnt = ex.phy2log_cpu, ex.log2phy_cpu, ex.logcnt.cpu()
        ref_block.experts.apply_placement(phy2log, log2phy, logcnt)
        _check_local_slots(ep_block, ref_block)
        with torch.no_grad():
            torch.testing.assert_close(ep_block(x), ref_block(x), atol=1e-6, rtol=0)

        # the placement is the policy's on the load of both ranks' tokens, the same on every rank
        load = controller.window.windowed().clone()  # this rank's
        dist.all_reduce(load)
        assert torch.equal(phy2log, get_policy("deepseek")(load, E + 2, 1, 1, WORLD)[0][0])
        mine = phy2log.to(device)
        gathered = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(gathered, mine)
        assert all(torch.equal(g, mine) for g in gathered)
        dist.barrier()  # no rank tears its connections down while the other may still use them
    finally:
        dist.destroy_process_group()
    os._exit(0)  # passed: skip interpreter finalization, where gloo's threads can abort (SIGABRT) under load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_expert_parallel_matches_single_process_and_rebalances():
    mp.spawn(_worker, args=(_free_port(), "gloo"), nprocs=WORLD, join=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 GPUs")
def test_expert_parallel_nccl():
    """The same code path over NCCL on the 2-GPU device kind."""
    mp.spawn(_worker, args=(_free_port(), "nccl"), nprocs=WORLD, join=True)
