#!/usr/bin/env bash
# What the last session left for a GPU (see the issues' closing notes), in the order to run it. One H200;
# each block fits one 10-minute device call. From the repository root (or a `git archive HEAD` copy of it),
# with hydra/omegaconf/flashinfer wheels installed and RESEARCH_LM_COMMIT / BENCH_COMMIT set to the commit.
#   bash experiments/gpu_pending.sh tests | presets | decode | throughput | spec_tiny | spec_ablation B | zoo256
set -euo pipefail
case ${1:-tests} in
  tests)  # GPU tests written but not run since their change (graph logits/argmax, compile)
    python -m pytest -m gpu tests/test_cuda_graphs.py tests/engine/test_compile.py tests/engine/test_gpu_engine.py \
      tests/attention_zoo -p no:cacheprovider -rfE -q ;;
  presets)  # every preset's gpu: block, never run on a GPU yet: each preset once, with no arguments
    mkdir -p outputs
    for p in mla sliding_window mamba ngram eagle3 eagle medusa draft_model attention_ablation; do
      python -m research_lm experiment=$p logger=jsonl > outputs/preset_$p.log 2>&1 && echo "ok $p" || echo "FAILED $p"
    done ;;
  decode) python -m experiments.paper bench_decode ;;          # re-measure after the graph logits change
  throughput) python -m experiments.paper bench_throughput ;;  # still session 1's single run
  spec_tiny) python -m experiments.paper spec_eagle3_tiny_h200 ;;
  spec_ablation)  # $2 = batch (1, 8 or 32); trains the reference models first when missing (~3 min).
    # All batches in one go, with the table written: python -m experiments.paper spec_ablation_h200 (~45 min)
    [ -d outputs/reference/target ] || bash experiments/train_reference.sh outputs/reference
    mkdir -p multirun/spec_ablation && bash experiments/spec_ablation_gpu.sh outputs/reference multirun/spec_ablation "$2" ;;
  zoo256)  # the missing batch-256 cells of attention_ablation_h200
    python -m research_lm -m device=cuda logger=jsonl seed=0,1,2 experiment=attention_ablation \
      model=random-llama-1b model.random.cache_dir=outputs/random model.random.seed=0 \
      attention=torch_ref,triton,flashinfer workload=synthetic 'workload.input_len=[512,512]' \
      'workload.output_len=[128,128]' runner.num_gpu_blocks=12000 runner.max_num_batched_tokens=8192 \
      runner.max_num_seqs=256 workload.num_requests=256 warmup_requests=256 ;;
  *) echo "unknown block $1" >&2; exit 2 ;;
esac
