#!/usr/bin/env bash
# GPU checks to repeat after a change to the runner, in one-H200 device calls (each block fits 10 minutes). From
# the repository root (or a `git archive HEAD` copy of it), with hydra/omegaconf/flashinfer wheels installed and
# RESEARCH_LM_COMMIT / BENCH_COMMIT set to the commit.
#   bash experiments/gpu_pending.sh tests | trees | match | t1 | b1 | host
# Session 4 (2026-11-25) ran both at 6e6bc1b / 89ff565, and the tables bench_decode, bench_throughput,
# bench_decode_8b and attention_ablation_h200 (parts over two calls, --print-commands / --from-sweep), and the
# attention_ablation preset at GPU size (113 s). Still never run on a GPU: the fa2 variant of mla_flashinfer.
# Session 5 ran `tests/spec_decode/test_draft_graphs.py -m gpu` at b47efbf (the whole-step draft graphs) and
# spec_ablation_h200 on one H200. Session 6 ran `pytest -m gpu tests/spec_decode tests/engine` at 082b9f0 (sampled
# draft graphs) on an H100, and spec_t1_graphs_h100 (PERFORMANCE.md, sixth pass). CPU-tested only since: Medusa's
# one-pass greedy drafts, the numpy-keyed rejection sampler (run `t1` and compare its verify ms with
# spec_t1_graphs_h100.json on the same card kind, or run 082b9f0 from `git archive` in the same call), prompt
# steps drafting from the graph (DraftGraphs.split), logprobs of verify steps, stop strings.
# Session 7 ran `tests` and `t1` at d74876b on an H100 (the numpy-keyed rejection sampler measured: PERFORMANCE.md,
# seventh pass) and `pytest -m gpu tests/spec_decode/test_draft_graphs.py` at 566079a. Still unchecked on a GPU:
# `b1` (the prompt-step split on the reference target), Medusa's first-k heads, stop strings and n > 1 on CUDA.
# Session 8 measured two host-side changes with same-process toggles and reverted both (PERFORMANCE.md, eighth
# pass). Its heads were 800 steps (two side by side: 106 s on an H100, so `tau`'s 2000-step pair should take
# ~270 s; three 3000-step heads side by side did not finish in 330 s). Still unchecked on a GPU then:
# logit_bias / allowed_token_ids.
# Session 9 ran `host` (bench_spec_host_*.md) and the GPU tests of the sampler (now with logit_bias and
# allowed_token_ids), test_gpu_engine (now with n > 1, stop strings and logit_bias), tests/spec_decode and
# test_cuda_graphs at c9e4e43: all passed. It trained five EAGLE-3 heads (spec_eagle3_recipe_h100.json); `tau` now
# compares the recipe's MLP 2048 with 4096 (the CPU pilots' best). Still
# unchecked on a GPU: `b1`.
# Session 10 ran `pytest -m gpu tests/spec_decode tests/ops tests/test_cuda_graphs.py tests/engine` at d703195 / cbdc2f0
# (drafts left on the device, the rejection kernel): all passed; bench_spec_host_eagle3_b{1,8}[_t1] are its A/Bs.
# `tau` still compares MLP 2048 with 4096 at equal footing (session 10 trained only a 4096 head: τ 3.36 / 4.13 / 3.61,
# val acc 0.79 against session 9's 0.77 at 2048; train_reference.sh now trains 4096).
# Session 12 (H200s) ran `pytest -m gpu tests/spec_decode/test_draft_graphs.py tests/test_cuda_graphs.py
# tests/engine/test_spec_greedy_identity.py` at f8b0d57 and the draft-graph tests at de67e3e (drafting before
# verification, the bookkeeping kernel): all passed; `host` at b1/b8 with the "eagle3 verify first" row; and
# spec_ablation_h200 with --gpus 2. The stacked Medusa heads (2f558fe) have CPU tests only; on the GPU their
# spec_ablation cells ran with τ unchanged.
# Session 16 made the 24-layer target the reference (PERFORMANCE.md, fifteenth pass; its head variants replace the
# old `tau` block, removed) and ran the GPU tests of
# test_cuda_graphs, test_draft_graphs, test_spec_greedy_identity and test_async_scheduling at 6248ca2: all passed.
# Session 17 ran `match` on the 24-layer target (1.0 in float32 and bfloat16 at 48 tokens) and a `waves` block (4 x batch
# requests; removed: it showed eager mixed steps, now avoided by runner.separate_prefills, and spec_ablation_h200 now
# runs 4 x batch requests itself), and the GPU tests of test_separate_prefills, test_async_scheduling and
# test_spec_greedy_identity at 14ddbd1, and `pytest -m gpu tests/spec_decode tests/engine tests/test_cuda_graphs.py` at
# 5db887c (28 passed; at 7782e71 a cuBLAS failure during graph capture in test_drafting_before_verification_on_cuda[eagle]
# showed twice in four runs and then not again: watch for it).
# Session 18 (async scheduling of EAGLE/EAGLE-3 verify steps, 6266b15) ran the GPU tests at 1f2feac: one failure of the
# same kind (CUBLAS_STATUS_EXECUTION_FAILED capturing draft graphs, late in the run), and one spec_ablation_h200 sweep
# part failed so too. d710295 turns Python's GC off during captures.
# Session 19 ran `tests` at b87f70c (passed), at b9cf3f2 (one capture failure, in the one capture made with the collector
# on) and twice at 5e49910 (passed: cuda_graph_capture keeps it off); and spec_ablation_h200 at b9cf3f2 on one H100
# (15 parts of 66-94 s from --print-commands over three calls, --from-sweep): no capture failure in 270 jobs.
# Session 20 ran bench_defaults (experiments/results/bench_defaults.md) and `pytest -m gpu tests/test_cuda_graphs.py
# tests/engine tests/ops tests/attention_zoo` at 1c767a0 (passed), the triton-attention and graph GPU tests at f29c7d9
# (split-KV: empty splits idle). Not yet run on a GPU: issue 28's stages 1-2 (b44db70, da81c16: the generic registry,
# proposers found through the entry point, the Proposer base class and DraftTarget): run `tests` first next session.
# Session 21 (one H200) ran `tests` at acb4f9a (101 passed: every GPU backend now replays from graphs, FlashInfer
# included), test_draft_graphs + test_spec_greedy_identity at d81e102 (hidden-state taps by hooks),
# attention_ablation_h200, mla_h200, mamba_h200 and experiments/ab_commits.py against 27437bc; after tensor parallelism
# landed (a410463's tree) the graph / spec-identity / draft-graph GPU tests at TP = 1. Never run on a GPU yet: NCCL
# tensor parallelism (on nvidia-h100-x2: `pytest -m gpu tests/models/test_tensor_parallel.py tests/moe/test_engine_ep.py`,
# then `torchrun --nproc-per-node 2 experiments/bench_tensor_parallel.py --shape llama-3.1-8b --batch 1 64 --steps 64
# --warmup 8 --repeats 3`), suffix decoding and disable_by_batch_size on CUDA, the EPLB lplb dispatch on NCCL.
# Session 22 (one H200; issue 28 stage 4, per-request state in device tables) ran `pytest -m gpu tests/spec_decode
# tests/ops tests/engine tests/test_cuda_graphs.py tests/test_sampler.py tests/test_rejection_sampler.py` at 1014c3f
# (passed; tests/engine/test_launch_never_waits.py launches under sync-debug mode) and the ab_issue28_stage4 A/Bs.
# Not run at 1014c3f: tests/attention_zoo -m gpu (flashinfer / mla / mamba graph engine tests over the new gather),
# the TP and EP GPU tests above, spec_ablation_h200 (the reference target) with ngram / Medusa now launching ahead.
# Session 23 (one H200; issue 28 stage 5) ran `pytest -m gpu tests/spec_decode tests/engine tests/test_cuda_graphs.py
# tests/ops tests/test_sampler.py tests/test_rejection_sampler.py` and tests/attention_zoo/test_mla_triton.py at 61cad69
# (passed) and the ab_issue28_stage5 A/Bs. Not run since stage 4: the rest of tests/attention_zoo -m gpu.
# Session 24 (2 x H200) ran `tests` at 90bf447 on one GPU (116 passed) and the NCCL tests
# (tests/models/test_tensor_parallel.py, tests/moe/test_engine_ep.py: passed once the EP test compared like with like:
# synchronous steps on both sides), trained the reference beside them, then ab_issue28_ablation_h200,
# spec_ablation_k5_h200 and both bench_tensor_parallel tables (PERFORMANCE.md, twenty-third pass). Not run since:
# the eagle3 batch-8 ablation cell with repeats (see that pass). CPU-tested only since (run `tests` and `trees` first next
# session): token trees (issue 29: tree masks in the triton kernel, verify graphs reading them, EAGLE / Medusa tree
# drafting), the adaptive speculation policy, MTP heads (issue 36), RankLostError's one line.
# Session 25 (2 x H200) ran `tests` at 1159b9d (passed: token trees on a GPU for the first time, static and dynamic) and
# the batch-invariance GPU tests (passed but one test bug, fixed); its other device time was lost (PERFORMANCE.md,
# twenty-fourth pass). CPU-tested only since: acceptance replay, suffix trees, Mamba2 / Bamba TP (`tp_mamba` on two
# GPUs), the split-K invariant GEMM (`bi`). Tables registered and never run: spec_tree_h200, spec_suffix_h200,
# spec_transfer_8b_h200, ab_issue28_ablation_eagle3_b8_h200, bench_decode_batch_invariant_h200,
# bench_throughput_batch_invariant_h200 (and spec_mtp_h200 once its DeepSeek reference script lands).
#   bash experiments/gpu_pending.sh bi | replay | tp_mamba | tree_host | tree_profile | bi_gap | skinny
# Session 26 (2 x H200, experiments/gpu_lanes.sh's way) ran `tests`, `tp_mamba` and `bi` at 6fdec22, `replay`, the
# batch-invariance tables, spec_ablation_batch_invariant_h200 and ab_issue28_ablation_eagle3_b8_h200; session 27 ran
# `bi` (retuned tiles) and both batch-invariance tables, spec_replay_validation_h200, spec_transfer_8b_h200, bench_decode
# beside gpt-fast, `bi_gap` with Medusa (as is / async off / graphs off) and the tree-graph A/B (PERFORMANCE.md,
# twenty-sixth pass). Next: `tests` (the replay kernel, dynamic tree graphs), `tree_profile` (~1 min),
# spec_replay_validation_h200, bench_decode with .peers/ carried (gpt-fast's row), spec_tree_h200 (--gpus 2), `BI_GAP_HEAD=medusa
# BI_GAP_VARIANTS="runner.enable_prefix_caching=false runner.separate_prefills=false" ... bi_gap`, spec_suffix_h200,
# spec_mtp_h200 (needs experiments/train_reference_mtp.sh first), then `tests` at the final commit.
# Session 28 (2 x H200, then one H100) lost most of its device time. At 568f54c every GPU test through the triton
# backend failed: `rope_and_cache` did not compile on the GPU (Triton 3.6 refuses a variable an `if` redefines with
# another shape; the interpreter never checks), so the reference training (EAGLE-3 generates through the engine)
# failed too. Fixed; `tests` at 5044f35 on the H100: 129 passed, 1 failed (test_async_matches_sync_on_cuda_with_graphs
# [bfloat16]: the skinny kernels' rows depended on M; f78d670 makes them M-independent, and skinny_rows is off by
# default since). The second call's other lane (training, spec_replay_validation_h100, the skinny sweep, the decode
# A/B, bench_decode, spec_transfer_8b_h100) ran out of device time and returned nothing: the one-chip rate of 67 %
# did not hold for that machine (read `lease.budget_left_s` after the first call), and poll packed its results only
# at its end (now every minute too). Before a device session: `python -m tests.compile_for_gpu` (~15 min on the
# 2-core CPU: compiles every kernel the CPU tests launch for sm_90). Next, in order: `tests`, `skinny`, the reference
# training, spec_replay_validation (issue 30), bench_decode's table, then the rest of session 27's list above.
# Session 29 (2 x H200 for an h100-x2 request, 7024cea; PERFORMANCE.md twenty-eighth pass) ran the GPU tests of
# tests/ops, test_acceptance_replay, test_async_scheduling and test_cuda_graphs (22 passed), `skinny` (the sweep, its
# tests, bench_decode: the one-row skinny kernel 1.122 ms beside gpt-fast's 1.259, now the default skinny_rows=1),
# the reference training, spec_replay_validation_h200 (within noise), spec_transfer_ngram_8b_h200, `tree_host`, and
# 63 of spec_tree_h200's 108 jobs (its 600 s ran out). CPU-tested only since: the all-rows skinny kernel
# (skinny_rows > 1). Next, on an H100 first (issue 31 needs both kinds; issue 30's anchor is an H100's): `skinny`
# (both kernels), bench_decode_h100, spec_transfer_8b_h100; then `tree_cprofile`, spec_tree_h200 with its own 20
# minutes, `tests` in full, bi_gap, spec_suffix_h200, spec_mtp_h200.
# Session 30 (4 x H200 for h100-x4 requests, d25e63f; PERFORMANCE.md twenty-ninth pass) ran `tests` (137 passed),
# `skinny` (the all-rows kernel: 3.4x cuBLAS a layer), bench_decode, `tree_cprofile`, bi_gap (prefix caching /
# separate prefills: neither), and spec_tree_h200 / spec_suffix_h200 in full with --gpus 2 each (5 min / 4 min; the
# tree table's batch 8 / 32 ran at a 128-token budget, since fixed). Next: on an H100 `skinny` and bench_decode_h100,
# spec_transfer_8b_h100; then the reference training, spec_tree (--gpus 2), spec_mtp (train_reference_mtp.sh first:
# it failed on transformers 5.17, fixed since), `tests`. Poll at once after `start`: the machine goes after 30 s idle.
# Session 31 (one H200, 37d433f; PERFORMANCE.md thirtieth pass) trained both references side by side (~15 / ~18 min on
# one GPU), ran the spec_decode / tree / graph GPU tests (29 passed) and spec_tree_h200 at T = 0; spec_mtp_h200 failed
# at capture (fixed since, with MLA draft-graph metadata). Next: `tests`, spec_mtp_h200, spec_tree_h200 (the adaptive
# cells: failed steps fixed since, CPU-checked by experiments/fuzz_spec_caps.py), spec_suffix_h200; then issue 31 on
# an H100 (`skinny`, bench_decode_h100).
set -euo pipefail
case ${1:-tests} in
  tests)  # every GPU test: graphs, compile, async scheduling, the engine, the fused ops, the drafters, the zoo
    python -m pytest -m gpu tests/test_cuda_graphs.py tests/engine tests/ops tests/spec_decode tests/test_sampler.py \
      tests/test_rejection_sampler.py tests/test_acceptance_replay.py tests/attention_zoo -p no:cacheprovider -rfE -q ;;
  match)  # greedy spec outputs vs the baseline on the GPU: 1.0 of requests in float32, 0.875 in bfloat16 at
          # 89ff565 (bf16 rounding differs between a k+1-token verify forward and a 1-token decode forward)
    [ -d outputs/reference/target ] || bash experiments/train_reference.sh outputs/reference
    python -m research_lm -m experiment=spec_ablation device=cuda attention=triton logger=jsonl model=hf \
      model.name=outputs/reference/target model.dtype=float32,bfloat16 spec=ngram spec.num_speculative_tokens=3 \
      runner.max_num_seqs=8 workload.num_requests=8 workload.max_tokens=48 runner.num_gpu_blocks=4096 seed=0 \
      hydra.sweep.dir=multirun/match && grep -h outputs_match_baseline multirun/match/*/results.json ;;
  t1)  # temperature-1 spec steps on the built-in tiny pair at batch 1, k = 5 (spec_t1_graphs_h100.json's command)
    for method in eagle3 draft_model; do
      python -m research_lm -m experiment=$method gpu=null device=cuda attention=triton logger=jsonl runner.max_num_seqs=1 \
        spec.num_speculative_tokens=5 workload.num_requests=8 workload.max_tokens=48 workload.temperature=1.0 seed=0,1,2 \
        hydra.sweep.dir=multirun/t1_$method
      grep -hE '"(draft_ms_per_step_median|verify_ms_per_step_median|mean_acceptance_length|speedup|tpot_ratio)"' \
        multirun/t1_$method/*/results.json
    done ;;
  b1)  # issue 4's batch-1 cells on the reference target (spec_ablation_h200's settings), k = 5, greedy and T = 1:
        # checks the prompt-step split (speedup vs tpot_ratio) and the T = 1 verify on the real target
    [ -d outputs/reference/target ] || SIDE_BY_SIDE=1 bash experiments/train_reference.sh outputs/reference
    for pair in "eagle3 eagle3" "draft_model draft" "eagle eagle"; do
      set -- $pair
      python -m research_lm -m experiment=spec_ablation device=cuda attention=triton logger=jsonl model=hf \
        model.name=outputs/reference/target spec=$1 spec.model=outputs/reference/$2 spec.num_speculative_tokens=5 \
        workload.temperature=0.0,1.0 workload.max_tokens=48 runner.num_gpu_blocks=4096 runner.max_num_seqs=1 \
        workload.num_requests=8 warmup_requests=1 seed=0,1,2 hydra.sweep.dir=multirun/b1_$1
      grep -hE '"(mean_acceptance_length|speedup|tpot_ratio|draft_ms_per_step_median|verify_ms_per_step_median)"' \
        multirun/b1_$1/*/results.json
    done ;;
  trees)  # issue 29: the tree GPU tests, then spec_tree (chain vs tree16 vs dynamic) on the reference target at batch 1 / 8 / 32,
          # greedy and T = 1, with the adaptive policy off and on (trains the reference first when missing)
    python -m pytest -m gpu tests/spec_decode/test_token_tree.py tests/attention_zoo/test_tree_attention.py \
      -p no:cacheprovider -rfE -q
    [ -d outputs/reference/target ] || SIDE_BY_SIDE=1 bash experiments/train_reference.sh outputs/reference
    python -m research_lm -m experiment=spec_tree device=cuda logger=jsonl model=hf \
      model.name=outputs/reference/target spec.model=outputs/reference/eagle3 spec_tree=chain,tree16,dynamic \
      runner.max_num_seqs=1,8,32 workload.temperature=0.0,1.0 +spec.speculation_policy=always,adaptive \
      runner.num_gpu_blocks=4096 hydra.sweep.dir=multirun/trees
    python -m research_lm.harness.report multirun/trees ;;
  host)  # host time per speculative step, phase by phase (experiments/bench_spec_host.py; PERFORMANCE.md, eighth
          # pass): the built-in pair, eagle3 and ngram at batch 1 and 8, ~2 min; the table goes to experiments/results
    for b in 1 8; do
      python experiments/bench_spec_host.py --method eagle3 --batch $b --name bench_spec_host_eagle3_b$b
      python experiments/bench_spec_host.py --method ngram --batch $b --name bench_spec_host_ngram_b$b
    done ;;
  bi_gap)  # issue 35: spec_ablation_batch_invariant_h200 had 1-2 of 128 requests differ from plain greedy at batch 32
          # with eagle3 / eagle / medusa / draft_model (seeds 0 and 2 of eagle3). Bisect: which switch makes it 1.0?
    [ -d outputs/reference/target ] || SIDE_BY_SIDE=1 bash experiments/train_reference.sh outputs/reference
    head=${BI_GAP_HEAD:-eagle3}  # eagle3 | medusa (its head trains in ~1 min: a quicker bisect)
    cell="experiment=spec_ablation device=cuda attention=triton logger=jsonl model=hf model.name=outputs/reference/target
      spec=$head spec.model=outputs/reference/$head spec.num_speculative_tokens=5 workload.temperature=0.0
      workload.max_tokens=64 runner.num_gpu_blocks=4096 runner.batch_invariant=true runner.max_num_seqs=32
      workload.num_requests=128 warmup_requests=32 seed=0,2"
    for variant in ${BI_GAP_VARIANTS:-as_is runner.async_scheduling=false runner.cuda_graphs=false \
                     runner.enable_prefix_caching=false runner.separate_prefills=false}; do
      dir=multirun/bi_gap/$(echo "$variant" | tr '=.' '__')  # Hydra refuses '=' in an override's value
      python -m research_lm -m $cell $([ "$variant" = as_is ] || echo "$variant") hydra.sweep.dir=$dir
      echo "$variant: $(grep -h outputs_match_baseline $dir/*/results.json | tr -d ' \n')"
    done ;;
  tree_host)  # issue 29: where a token-tree step's time goes (spec_tree_h200: tree16 at 0.17x, 10x a chain's step),
              # with the Triton compiles inside the measured runs; tables to outputs/ (diagnostics, not results)
    for m in eagle3_tree16 eagle3_dynamic eagle3; do
      python experiments/bench_spec_host.py --method $m --k 4 --batch 1 --out outputs/tree_host --name host_$m
    done ;;
  tree_profile)  # issue 29: where a tree16 step's 4.6 ms go (the timed phases add up to under half): torch profile of
                 # the built-in pair at batch 1, kernels and host ops by total time, and the tree step count
    python - <<'PY'
import torch
from torch.profiler import ProfilerActivity, profile
from research_lm import LLM, SamplingParams
tree = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
        (1, 0, 0), (0, 0, 0, 0), (0, 0, 1, 0)]
llm = LLM("tiny-llama", speculative_config={"method": "eagle3", "model": "tiny-llama-eagle3",
                                            "speculative_token_tree": tree}, max_num_seqs=1)
prompt, params = ["def fibonacci(n):\n    "], SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
llm.generate(prompt, params, use_tqdm=False)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    out = llm.generate(prompt, params, use_tqdm=False)
m = out[0].metrics
print("steps ~", m.num_output_tokens - m.num_accepted_tokens, "tokens", m.num_output_tokens)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
PY
    ;;
  tree_cprofile)  # issue 29: the tree16 step's host time by Python function (cProfile; the torch profile above showed
              # 5.6 ms of host against 1.2 ms of GPU per step), beside the chain's, the built-in pair at batch 1
    python - <<'PY'
import cProfile, pstats, time
from research_lm import LLM, SamplingParams
tree = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
        (1, 0, 0), (0, 0, 0, 0), (0, 0, 1, 0)]
for name, extra in (("chain4", {"num_speculative_tokens": 4}), ("tree16", {"speculative_token_tree": tree})):
    llm = LLM("tiny-llama", speculative_config={"method": "eagle3", "model": "tiny-llama-eagle3", **extra},
              max_num_seqs=1)
    prompt, params = ["def fibonacci(n):\n    "], SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    pr = cProfile.Profile()
    pr.enable()
    out = llm.generate(prompt, params, use_tqdm=False)
    pr.disable()
    m = out[0].metrics
    print(f"== {name}: {wall * 1e3:.1f} ms unprofiled, tokens {m.num_output_tokens}, accepted {m.num_accepted_tokens}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    pstats.Stats(pr).sort_stats("cumtime").print_stats(45)
PY
    ;;
  bi)  # issue 35: the GPU proofs, then the invariant GEMM against cuBLAS and the tile sweep that rewrites the tuned tiles
    python -m pytest tests/test_batch_invariant_gpu.py tests/ops/test_batch_invariant.py -m "gpu or not gpu" \
      -p no:cacheprovider -rfE -q
    (cd experiments && python bench_invariant_gemm.py --sweep --m 1 64 256 --out ../outputs/bi_gemm \
      --tune ../research_lm/assets/tuned/batch_invariant_gemm.json) ;;
  replay)  # issue 30 item 3: the reference pair's EAGLE-3 at batch 1 recorded, then its own profile replayed, 3 seeds
    [ -d outputs/reference/target ] || SIDE_BY_SIDE=1 bash experiments/train_reference.sh outputs/reference
    common="experiment=spec_ablation device=cuda attention=triton logger=jsonl model=hf \
      model.name=outputs/reference/target spec=eagle3 spec.model=outputs/reference/eagle3 spec.num_speculative_tokens=5 \
      runner.max_num_seqs=1 workload.num_requests=8 workload.max_tokens=128 runner.num_gpu_blocks=4096"
    python -m research_lm $common record_acceptance=true hydra.run.dir=outputs/replay/recorded
    python -m research_lm -m $common acceptance_replay=$PWD/outputs/replay/recorded/acceptance_profile.json \
      seed=0,1,2 hydra.sweep.dir=multirun/replay
    python -m research_lm -m $common seed=0,1,2 hydra.sweep.dir=multirun/replay_real
    grep -hE '"(mean_acceptance_length|speedup|tpot_ratio)"' multirun/replay/*/results.json multirun/replay_real/*/results.json ;;
  skinny)  # issue 31: the skinny kernels' tiles swept on this GPU (written where skinny_tiles reads them), their GPU
           # tests, then bench_decode beside gpt-fast: the one-row kernel (the default), the per-op path and the
           # all-rows kernel (skinny_rows=4) (copy ../shared/peers to .peers/ and carry it)
    # --m 1: skinny_rows=1 (the default) sends only one-row steps here; session 30 tuned over M = 1, 2, 4 and the
    # tile it kept for o_proj took 8.45 us at M = 1 against 5.3 (bench_decode 1.169 ms against 1.122)
    (cd experiments && python bench_skinny_linear.py --m 1 --sweep --tune ../research_lm/assets/tuned/skinny_linear.json \
      --out ../outputs/skinny && python bench_skinny_linear.py --rows-per-program 4 --sweep \
      --tune ../research_lm/assets/tuned/skinny_linear.json --out ../outputs/skinny --name bench_skinny_rows)
    python -m pytest -m gpu tests/ops/test_skinny_linear.py tests/engine/test_async_scheduling.py -p no:cacheprovider \
      -rfE -q
    python -m experiments.paper bench_decode ;;
  tp_mamba)  # issue 33: Mamba2 / Bamba tensor parallelism over NCCL on two GPUs
    python -m pytest -m gpu tests/models/test_tensor_parallel.py -k "mamba or bamba" -p no:cacheprovider -rfE -q ;;
  *) echo "unknown block $1" >&2; exit 2 ;;
esac
