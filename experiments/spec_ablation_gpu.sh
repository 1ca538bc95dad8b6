#!/usr/bin/env bash
# experiment=spec_ablation on the GPU reference target (experiments/train_reference.sh): every proposer x
# k {1, 3, 5} x temperature {0, 1} x seed {0, 1, 2} at one batch size per call, each job against the same
# workload without speculation in the same process (speedup), on the Triton backend, eager (the same
# runner for both: CUDA graphs do not cover speculative steps yet).
#   bash experiments/spec_ablation_gpu.sh REF_DIR SWEEP_DIR BATCH [METHODS...]
# Then: python -m research_lm.report SWEEP_DIR  (or python -m experiments.paper spec_ablation).
set -uo pipefail
REF=$1; SWEEP=$2; BATCH=$3; shift 3
METHODS=${*:-ngram eagle3 eagle medusa draft_model}
NREQ=$(( BATCH > 8 ? BATCH : 8 ))
for method in $METHODS; do
  case $method in
    ngram) head="" ;;
    draft_model) head="spec.model=$REF/draft" ;;
    *) head="spec.model=$REF/$method" ;;
  esac
  python -m research_lm -m experiment=spec_ablation device=cuda attention=triton logger=jsonl \
    model=hf model.name=$REF/target spec=$method $head spec.num_speculative_tokens=1,3,5 \
    workload.temperature=0.0,1.0 seed=0,1,2 runner.max_num_seqs=$BATCH workload.num_requests=$NREQ \
    workload.max_tokens=48 warmup_requests=$BATCH runner.num_gpu_blocks=4096 \
    hydra.sweep.dir=$SWEEP/$method-b$BATCH > $SWEEP/$method-b$BATCH.log 2>&1 \
    || echo "sweep $method-b$BATCH failed: see $SWEEP/$method-b$BATCH.log"
done
