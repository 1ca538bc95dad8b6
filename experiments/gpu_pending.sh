#!/usr/bin/env bash
# What the last session left for a GPU (see the issues' closing notes), in the order to run it. Each block fits
# one 10-minute device call. From the repository root (or a `git archive HEAD` copy of it), with hydra/omegaconf/
# flashinfer wheels installed and RESEARCH_LM_COMMIT / BENCH_COMMIT set to the commit.
#   bash experiments/gpu_pending.sh tests | 8b | presets | match | zoo256
# Done in session 3 (tables committed): bench_decode, bench_throughput, spec_ablation_h200 (--gpus 4 on 4 H200s,
# 3 min), spec_eagle3_tiny_h200; GPU tests of the verify and drafting graphs.
set -euo pipefail
case ${1:-tests} in
  tests)  # every GPU test of the runner's graphs, compile, the engine and the attention zoo
    python -m pytest -m gpu tests/test_cuda_graphs.py tests/engine/test_compile.py tests/engine/test_gpu_engine.py \
      tests/spec_decode/test_draft_graphs.py tests/attention_zoo -p no:cacheprovider -rfE -q ;;
  8b)  # the Llama-3.1-8B shape at batch 1 and 64 in one table (bench_decode --shape/--batch; never run yet), ~5 min
    python -m experiments.paper bench_decode_8b ;;
  presets)  # attention_ablation's gpu: block did not finish in 290 s when graphs were off by default; the rest ran
    mkdir -p outputs
    time python -m research_lm experiment=attention_ablation logger=jsonl > outputs/preset_attention_ablation.log 2>&1 \
      && echo ok || echo FAILED ;;
  match)  # greedy spec outputs vs the baseline in bf16 on the GPU (spec_ablation_h200: 0.75-0.875 of requests
          # match; 1.0 on CPU): the same jobs in float32 should match exactly if the cause is bf16 rounding
    [ -d outputs/reference/target ] || bash experiments/train_reference.sh outputs/reference
    python -m research_lm -m experiment=spec_ablation device=cuda attention=triton logger=jsonl model=hf \
      model.name=outputs/reference/target model.dtype=float32,bfloat16 spec=ngram spec.num_speculative_tokens=3 \
      runner.max_num_seqs=8 workload.num_requests=8 workload.max_tokens=48 runner.num_gpu_blocks=4096 seed=0 \
      hydra.sweep.dir=multirun/match && grep -h outputs_match_baseline multirun/match/*/results.json ;;
  zoo256)  # the missing batch-256 cells of attention_ablation_h200
    python -m research_lm -m device=cuda logger=jsonl seed=0,1,2 experiment=attention_ablation \
      model=random-llama-1b model.random.cache_dir=outputs/random model.random.seed=0 \
      attention=torch_ref,triton,flashinfer workload=synthetic 'workload.input_len=[512,512]' \
      'workload.output_len=[128,128]' runner.num_gpu_blocks=12000 runner.max_num_batched_tokens=8192 \
      runner.max_num_seqs=256 workload.num_requests=256 warmup_requests=256 ;;
  *) echo "unknown block $1" >&2; exit 2 ;;
esac
