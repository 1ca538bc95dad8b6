"""Tensor parallelism's bad setups end with one line naming the cause, never a hang: no torchrun, a world size
that is not tensor_parallel_size, EP ranks that are not the TP ranks, and a rank that dies (the others raise
`RankLostError` at once: gloo sees the closed connection) or hangs (the others raise it after
distributed_timeout_s). Sizes that do not split are refused at build time: test_tensor_parallel_layers.py.
The CLI's `runner.tensor_parallel_size` and `runner.distributed_timeout_s` reach the engine's config."""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from research_lm import LLM, EngineConfig, SamplingParams
from research_lm.engine.distributed import setup_ranks
from research_lm.worker.parallel import RankLostError, guarded
from tests.models.test_tensor_parallel import _free_port

KNOBS = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
             max_model_len=64, num_gpu_blocks=32)


def test_tensor_parallel_needs_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=2 needs one process per rank: launch with torchrun "
                                         r"--nproc-per-node 2 \(WORLD_SIZE is not set\)$"):
        LLM("tiny-llama", tensor_parallel_size=2, **KNOBS)


def test_world_size_must_equal_tensor_parallel_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"^tensor_parallel_size \(2\) must equal the number of processes "
                                         r"\(WORLD_SIZE=4\)$"):
        LLM("tiny-llama", tensor_parallel_size=2, **KNOBS)


def test_expert_parallel_ranks_are_the_tensor_parallel_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for eplb in ({"num_ep_ranks": 4}, {"num_ep_ranks": 1, "expert_parallel": True}):
        with pytest.raises(ValueError, match=r"eplb.num_ep_ranks \(\d\) must equal tensor_parallel_size \(2\)"):
            setup_ranks(2, eplb, torch.device("cpu"))


def test_the_cli_passes_tensor_parallel_size():
    from hydra import compose, initialize_config_dir

    from research_lm.harness.cli_checks import check_config
    from research_lm.harness.experiment import engine_config
    from tests.experiments.conftest import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["runner.tensor_parallel_size=2", "runner.distributed_timeout_s=30"])
        bad = compose("config", overrides=["runner.tensor_parallel_size=0"])
    check_config(cfg)
    config = engine_config(cfg)
    assert (config.tensor_parallel_size, config.distributed_timeout_s) == (2, 30.0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        check_config(bad)


def test_sizes_and_timeout_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_timeout_s must be > 0"):
        EngineConfig(distributed_timeout_s=0.0)


def test_only_distributed_errors_become_rank_lost():
    import torch.distributed as dist

    with pytest.raises(RankLostError, match=r"^rank 1 of 2: an all-reduce failed because another rank exited or did "
                                            r"not answer within distributed_timeout_s=5 \(Timed out after 5 s\)$"):
        with guarded("an all-reduce", 1, 2, 5.0):
            raise dist.DistBackendError("Timed out after 5 s\nmore detail")
    with pytest.raises(RuntimeError, match="^CUDA error: an illegal memory access$"):  # not about the other ranks
        with guarded("an all-reduce", 1, 2, 5.0):
            raise RuntimeError("CUDA error: an illegal memory access")


def _rank(rank: int, world: int, port: int, path: str, out_dir: str, fault: str, timeout_s: float) -> None:
    """A torchrun-like rank; the last one dies ("exit") or blocks for good ("hang") in its third forward."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    llm = LLM(path, tensor_parallel_size=world, distributed_timeout_s=timeout_s, **KNOBS)
    if rank == world - 1:
        calls = []

        def fault_in_third_forward(module, args):
            calls.append(1)
            if len(calls) == 3:
                if fault == "exit":
                    os._exit(7)
                threading.Event().wait()  # hung: never answers the next collective

        llm.engine.model.model.layers[1].register_forward_pre_hook(fault_in_third_forward)
    t0 = time.perf_counter()
    try:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        result = {"error": None}
    except Exception as e:
        result = {"type": type(e).__name__, "error": str(e), "seconds": time.perf_counter() - t0,
                  "traceback": traceback.format_exc()}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    if result["error"] is not None:  # the survivor's process ends (the test waits for it); os._exit, as at
        os._exit(3)  # interpreter exit the gloo process group's teardown may abort (SIGABRT) once its peer is gone


@pytest.mark.parametrize("fault,world,timeout_s", [("exit", 2, 60.0), ("hang", 2, 3.0)])
def test_a_lost_rank_ends_the_others_with_one_line(tiny_checkpoint, tmp_path, fault, world, timeout_s):
    ctx = mp.get_context("spawn")
    args = (world, _free_port(), str(tiny_checkpoint("llama")), str(tmp_path), fault, timeout_s)
    procs = [ctx.Process(target=_rank, args=(rank, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs[:-1]:
            p.join(timeout=300)  # imports and the engine's start; the failure itself takes seconds (below)
            assert p.exitcode == 3, f"a surviving rank did not end (exit code {p.exitcode})"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for rank in range(world - 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["type"] == RankLostError.__name__, got.get("traceback")
        assert "\n" not in got["error"]
        assert got["error"].startswith(f"rank {rank} of {world}: an all-")
        assert f"failed because another rank exited or did not answer within distributed_timeout_s={timeout_s:g}" \
            in got["error"]
        if fault == "exit":  # the closed connection, not the timeout
            assert got["seconds"] < timeout_s / 2
        else:
            assert timeout_s <= got["seconds"] < timeout_s + 30


def test_the_cli_prints_a_lost_rank_in_one_line():
    """RankLostError is a user-facing error: the CLI's one line, without importing torch.distributed to know it."""
    from research_lm.api.errors import RankLostError as light
    from research_lm.harness.cli_checks import USER_ERRORS, one_line

    assert light is RankLostError and issubclass(RankLostError, USER_ERRORS)
    assert one_line(RankLostError("rank 1 of 2: an all-reduce failed\ndetails")) == "rank 1 of 2: an all-reduce failed"
