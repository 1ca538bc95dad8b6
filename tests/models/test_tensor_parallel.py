"""Tensor parallelism (worker/parallel.py, engine/distributed.py): `LLM(..., tensor_parallel_size=N)` on N
gloo processes (2 and 4, on CPU) generates the single-process run's greedy tokens for Llama (2 KV heads: replicated
at N = 4), Qwen3 (q/k norms, async scheduling), Mixtral (experts sharded over the ranks), DeepSeek-V2 (MLA: heads
split, latent replicated; and its MoE variant), Qwen2-MoE (a dense layer, a gated shared expert), speculative runs
with an EAGLE-3 head and with a draft model (drafters replicated), and, at N = 2, EAGLE-3 under async scheduling
with graph-captured target and drafter steps (the CPU stand-in capture), each rank holding only its slice of the
checkpoint; NCCL on 2 GPUs runs the same with real CUDA graphs (marked gpu). The state-space models run apart
(`STATE_SPACE`): Mamba2 with one B/C group (replicated on every rank) and with two (one per rank at N = 2, one split
over two ranks at N = 4, whose gated norm all-reduces across them), and Bamba (attention + Mamba2 layers), each
rank's state slots holding only its SSM heads.

Exact and meaningful: a row-parallel all-reduce sums the same products in another order, so logits move by float32
rounding (~1e-6) and a near-tie could flip a greedy token without any bug. The single-process reference therefore
also asks for the top-2 logprobs, and every emitted token must lead the runner-up by at least MARGIN (a prompt
that fails this guard is replaced, not tolerated); then the tokens must be identical and the logprobs equal to
1e-4, which a wrong shard, a missing all-reduce or a bias added twice all break by far more.
"""

from __future__ import annotations

import json
import os
import random
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from research_lm import LLM, SamplingParams
from research_lm.worker.cuda_graphs import eager_capture
from tests.spec_decode.test_spec_formats import V, eagle3_tensors, write_eagle3

MARGIN = 1e-3  # the smallest top-1 lead over the runner-up the reference may show; fp32 reduction noise is ~1e-6
KNOBS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64,
             num_gpu_blocks=64, enable_prefix_caching=False)
PROMPT_LENS, MAX_TOKENS = (3, 11, 6), 6


def _cases(tiny_checkpoint, tmp_path: Path, world: int) -> dict[str, dict]:
    """name -> LLM arguments (without device and tensor_parallel_size); "graphs": capture the steps' graphs (on CPU
    the stand-in that re-runs them, with the Triton kernels under the interpreter: slow, so at N = 2 only)."""
    head = write_eagle3(tmp_path / "eagle3", eagle3_tensors(22, sorted(random.Random(0).sample(range(V), 96))),
                        eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    llama = str(tiny_checkpoint("llama"))
    eagle3 = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    graphs = {} if world > 2 else {"eagle3-graphs-async": dict(
        model=llama, speculative_config=eagle3, attention_backend="triton", async_scheduling=True, graphs=True)}
    return graphs | {
        "llama": dict(model=llama),
        "qwen3": dict(model=str(tiny_checkpoint("qwen3")), async_scheduling=True),
        "mixtral": dict(model=str(tiny_checkpoint("mixtral"))),
        "deepseek-v2": dict(model=str(tiny_checkpoint("deepseek-v2"))),
        "deepseek-v2-moe": dict(model=str(tiny_checkpoint("deepseek-v2-moe"))),
        "qwen2-moe": dict(model=str(tiny_checkpoint("qwen2-moe"))),
        "eagle3": dict(model=llama, speculative_config=eagle3),
        # the target drafting for itself: its drafts are accepted, which a random EAGLE-3 head's are not
        "draft-model": dict(model=llama, speculative_config={"method": "draft_model", "model": llama,
                                                             "num_speculative_tokens": 2}),
    }


STATE_SPACE = ("mamba2", "mamba2-groups", "bamba")


def _state_space_cases(tiny_checkpoint, tmp_path: Path, world: int) -> dict[str, dict]:
    return {name: dict(model=str(tiny_checkpoint(name))) for name in STATE_SPACE}


def _llm(case: dict, **knobs) -> LLM:
    """The case's LLM; with "graphs", its target and drafter steps captured (and its steps that drafted at launch
    counted: an EAGLE verify step under graphs drafts on the device, behind its verification)."""
    case = dict(case)
    graphs = case.pop("graphs", False)
    llm = LLM(**KNOBS, **knobs, **case)
    if graphs:
        runner = llm.engine.runner
        assert runner.capture_cuda_graphs([1, 2, 4], prefill_sizes=[], capture=eager_capture) is None
        launch, llm.deferred = runner.launch, []

        def counting(sched):
            step = launch(sched)
            llm.deferred.append(step.drafted is not None)
            return step

        runner.launch = counting
    return llm


def _prompts() -> list[list[int]]:
    rng = random.Random(1)  # every case's greedy tokens lead by >= 3.8e-3 (seed 3: Qwen2-MoE's only by 3.5e-4)
    return [[rng.randrange(V) for _ in range(n)] for n in PROMPT_LENS]


def _generate(llm: LLM) -> dict[str, list]:
    """Per request: tokens, their logprobs, the top-2 lead of each token, and the drafts accepted. A graphs case asks
    for no logprobs (they keep the next step from launching ahead); its target is "llama", whose leads are checked."""
    graphs = hasattr(llm, "deferred")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=None if graphs else 2)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert llm.engine.metrics.num_failed_steps == 0  # one process recovers from a failed step: none may fail
    result: dict[str, list] = {"tokens": [], "logprobs": [], "lead": [], "accepted": [], "drafts": [],
                               "deferred": [sum(getattr(llm, "deferred", []))]}
    for o in outs:
        c = o.outputs[0]
        result["tokens"].append(c.token_ids)
        result["accepted"].append(o.metrics.num_accepted_tokens)
        result["drafts"].append(o.metrics.num_draft_tokens)
        if not graphs:
            result["logprobs"].append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
            result["lead"].append([_lead(lp) for lp in c.logprobs])
    return result


def _lead(logprobs: dict) -> float:
    best = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return best[0] - best[1]


def _layer0(model: torch.nn.Module) -> torch.nn.Module:
    """Layer 0's attention, or its Mamba2 mixer."""
    layer = getattr(model, model.backbone_attr).layers[0]
    return getattr(layer, "self_attn", None) or getattr(layer, "mixer", None) or layer.mamba


def _heads(llm: LLM) -> dict:
    """Layer 0's heads on this rank (attention or SSM), and the per-rank cache sizes."""
    layer = _layer0(llm.engine.model)
    num_heads = layer.num_heads if hasattr(layer, "num_heads") else layer.ssm.spec.num_heads
    return {"num_heads": num_heads, "page_size_bytes": llm.engine.runner.page_size_bytes(torch.float32)}


def _mixer_rows(ref: torch.nn.Module, rank: int, world: int) -> torch.Tensor:
    """The rows of layer 0's in_proj that rank `rank` must hold: its heads' z, x and dt, the B and C of the
    groups they read (n_groups / N groups, or the one group of its heads when groups are fewer than ranks)."""
    cfg = ref.cfg
    P, N, H, G = cfg.head_dim, cfg.state_size, cfg.num_heads, cfg.n_groups
    z, x, B, C, dt = ref.in_proj.weight.split([H * P, H * P, G * N, G * N, H])
    heads = slice(rank * H // world, (rank + 1) * H // world)
    groups = slice(rank * G // world, rank * G // world + max(G // world, 1))

    def rows(t: torch.Tensor, s: slice, width: int) -> torch.Tensor:
        return t[s.start * width : s.stop * width]

    return torch.cat([rows(z, heads, P), rows(x, heads, P), rows(B, groups, N), rows(C, groups, N), dt[heads]])


def _shards(llm: LLM, case: dict, rank: int, world: int) -> dict:
    """What this rank holds of layer 0's attention or mixer, checked against the checkpoint's full tensors."""
    from research_lm.models import load_model

    model = llm.engine.model
    device = llm.engine.info.device
    full = load_model(case["model"], device=device, dtype=torch.float32, attention_backend="torch_ref")[0]
    attn, ref = _layer0(model), _layer0(full)
    if hasattr(attn, "in_proj"):  # Mamba2: heads [r H/N, (r+1) H/N) and their groups; its state slots only theirs
        assert torch.equal(attn.in_proj.weight, _mixer_rows(ref, rank, world))
        heads = slice(rank * ref.cfg.num_heads // world, (rank + 1) * ref.cfg.num_heads // world)
        assert torch.equal(attn.A_log, ref.A_log[heads]) and torch.equal(attn.D, ref.D[heads])
        cols = slice(heads.start * ref.cfg.head_dim, heads.stop * ref.cfg.head_dim)
        assert torch.equal(attn.out_proj.weight, ref.out_proj.weight[:, cols])
        assert torch.equal(attn.norm.weight, ref.norm.weight[cols])
        assert attn.ssm.kv_cache[1].shape[1] == heads.stop - heads.start
    elif hasattr(attn, "qkv_proj"):  # Llama family: q heads [r H/N, (r+1) H/N), KV head r K / N (replicated if K < N)
        hd, heads, kv = ref.head_size, ref.num_heads, ref.num_kv_heads
        q_rows = slice(rank * heads // world * hd, (rank + 1) * heads // world * hd)
        kv_heads = max(kv // world, 1)
        first = rank * kv // world
        k_rows = slice(heads * hd + first * hd, heads * hd + (first + kv_heads) * hd)
        want = torch.cat([ref.qkv_proj.weight[q_rows], ref.qkv_proj.weight[k_rows],
                          ref.qkv_proj.weight[k_rows.start + kv * hd : k_rows.stop + kv * hd]])
        assert torch.equal(attn.qkv_proj.weight, want)
        cols = slice(rank * heads // world * hd, (rank + 1) * heads // world * hd)
        assert torch.equal(attn.o_proj.weight, ref.o_proj.weight[:, cols])
        assert attn.attn.kv_cache.shape[-2] == kv_heads  # the cache holds this rank's KV heads only
    else:  # MLA: kv_b_proj split by head, the latent projection replicated
        rows = ref.kv_b_proj.weight.shape[0] // world
        assert torch.equal(attn.kv_b_proj.weight, ref.kv_b_proj.weight[rank * rows : (rank + 1) * rows])
        assert torch.equal(attn.fused_qkv_a_proj.weight, ref.fused_qkv_a_proj.weight)
    vocab = model.lm_head.weight.shape[0]
    assert vocab * world == full.lm_head.weight.shape[0]
    assert torch.equal(model.lm_head.weight, full.lm_head.weight[rank * vocab : (rank + 1) * vocab])
    return _heads(llm)


def _worker(rank: int, world: int, port: int, device: str, cases: dict, out_dir: str) -> None:
    """One torchrun-like rank: the engine creates the process group from these variables."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    results = {}
    try:
        for name, case in cases.items():
            llm = _llm(case, device=device, tensor_parallel_size=world)
            results[name] = {**_generate(llm), **_shards(llm, case, rank, world)}
        dist.barrier()  # no rank tears its connections down while another may still use them
    except BaseException:
        results["error"] = traceback.format_exc()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    os._exit(0)  # skip interpreter finalization, where gloo's threads can abort (SIGABRT) under load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_tensor_parallel(tiny_checkpoint, tmp_path: Path, world: int, device: str, make_cases=_cases,
                           check_caches=None) -> None:
    """Each rank's tokens, logprobs, heads and draft counts against the single process's; `check_caches(want, got)`
    checks the cases' cache sizes per rank."""
    cases = make_cases(tiny_checkpoint, tmp_path, world)
    want = {}
    for name, case in cases.items():
        llm = _llm(case, device=device)
        want[name] = {**_generate(llm), **_heads(llm)}
        lead = min((min(x) for x in want[name]["lead"]), default=MARGIN)
        assert lead >= MARGIN, f"{name}: a greedy token leads its runner-up by {lead:.2e} only; change the prompts"
    if "eagle3" in want:  # drafts verified, kept; graphs launching steps that drafted ahead
        assert sum(want["eagle3"]["drafts"]) > 0 and sum(want["draft-model"]["accepted"]) > 0
    if "eagle3-graphs-async" in want:
        graphs = want["eagle3-graphs-async"]
        assert graphs["deferred"][0] > 0 and graphs["tokens"] == want["llama"]["tokens"]
    mp.start_processes(_worker, args=(world, _free_port(), device, cases, str(tmp_path)), nprocs=world,
                       start_method="spawn")
    for rank in range(world):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        for name, ref in want.items():
            g = got[name]
            assert g["tokens"] == ref["tokens"], name
            for a, b in zip(g["logprobs"], ref["logprobs"], strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
            assert g["num_heads"] * world == ref["num_heads"], name
            for key in ("drafts", "accepted", "deferred"):
                assert g[key] == ref[key], (name, key)
        if check_caches is not None:
            check_caches(want, got)


def _transformers_caches(want: dict, got: dict) -> None:
    """The KV cache per rank: Llama's 2 KV heads, one per rank at N = 2, each held by 2 ranks at N = 4; MLA's whole
    latent."""
    assert got["llama"]["page_size_bytes"] * 2 == want["llama"]["page_size_bytes"]
    assert got["deepseek-v2"]["page_size_bytes"] == want["deepseek-v2"]["page_size_bytes"]


def _bamba_caches(want: dict, got: dict) -> None:
    """Bamba's KV cache (its attention layer) per rank, as Llama's; the SSM state's heads are checked by `_shards`."""
    assert got["bamba"]["page_size_bytes"] * 2 == want["bamba"]["page_size_bytes"]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_process(tiny_checkpoint, tmp_path, world):
    _check_tensor_parallel(tiny_checkpoint, tmp_path, world, "cpu", check_caches=_transformers_caches)


@pytest.mark.parametrize("world", [2])  # (4 ranks: the Llama test's; 18 s of CI)
def test_mamba2_and_bamba_match_single_process(tiny_checkpoint, tmp_path, world):
    _check_tensor_parallel(tiny_checkpoint, tmp_path, world, "cpu", _state_space_cases, _bamba_caches)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_nccl(tiny_checkpoint, tmp_path):
    """The same over NCCL, one GPU per rank, the dense models' steps replayed from CUDA graphs (their all-reduces
    and all-gathers captured)."""
    _check_tensor_parallel(tiny_checkpoint, tmp_path, 2, "cuda", check_caches=_transformers_caches)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_mamba2_and_bamba_nccl(tiny_checkpoint, tmp_path):
    """Mamba2 and Bamba over NCCL on the mamba_triton backend, decodes replayed from CUDA graphs (the gated norm's
    all-reduce captured)."""
    _check_tensor_parallel(tiny_checkpoint, tmp_path, 2, "cuda", _state_space_cases, _bamba_caches)
