#!/usr/bin/env bash
# The GPU reference target for the spec-decode benchmarks and its four drafters, trained in-framework
# (self-distillation on the stdlib + pydoc corpus), in the published layouts. One H100/H200, ~5 min.
#   [GPUS=N] bash experiments/train_reference.sh [OUT_DIR]   # default outputs/reference; GPUS: heads side by side
# OUT_DIR/{target,eagle3,eagle,medusa,draft}; each holds recipe.json (seed, steps, losses, corpus hash).
# Then: python -m research_lm -m experiment=spec_ablation model=hf model.name=OUT_DIR/target spec=eagle3 \
#   spec.model=OUT_DIR/eagle3 ...  (experiments/paper/README.md has the full sweep).
set -euo pipefail
OUT=${1:-outputs/reference}
COMMON="logger=jsonl train.batch_size=64 train.seq_len=512 train.corpus_bytes=null train.save_dtype=bfloat16 \
  train.log_every=100 train.progress=false"
python -m research_lm experiment=train_target $COMMON train.output_dir=$OUT/target \
  train.steps=1500 train.lr=2e-3 train.warmup_steps=100 train.eval_every=500 train.save_every=1500 \
  train.model.hidden_size=192 train.model.intermediate_size=512 train.model.num_hidden_layers=8 \
  train.model.num_attention_heads=6 train.model.num_key_value_heads=2
HEADS="train.target=$OUT/target train.steps=800 train.warmup_steps=50 train.eval_every=800 \
  train.save_every=800"
# The four heads only read the target: with GPUS=N (N > 1) they train side by side, head i on GPU i mod N.
GPUS=${GPUS:-1}
i=0; pids=()
for head in "train_eagle3 eagle3 train.head.ttt_steps=3" "train_eagle eagle" \
            "train_medusa medusa train.head.num_heads=5" "train_draft draft"; do
  set -- $head
  preset=$1; dir=$2; shift 2
  if [ "$GPUS" -gt 1 ]; then
    CUDA_VISIBLE_DEVICES=$(( i % GPUS )) python -m research_lm experiment=$preset $COMMON $HEADS \
      train.output_dir=$OUT/$dir "$@" > $OUT/$dir.log 2>&1 &
    pids+=($!)
  else
    python -m research_lm experiment=$preset $COMMON $HEADS train.output_dir=$OUT/$dir "$@"
  fi
  i=$(( i + 1 ))
done
for pid in "${pids[@]}"; do wait "$pid"; done
