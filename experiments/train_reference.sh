#!/usr/bin/env bash
# The GPU reference target for the spec-decode benchmarks and its four drafters, trained in-framework
# (self-distillation on the stdlib + pydoc corpus), in the published layouts. One H200: ~11 min, ~8.5 with
# SIDE_BY_SIDE=1 (sums of the parts' times: target 2 min, EAGLE-3 6.3, the other heads ~1 each).
#   [GPUS=N] [SIDE_BY_SIDE=1] [TARGET_ONLY=1] [LAYERS=L] bash experiments/train_reference.sh [OUT_DIR]   # default outputs/reference
# LAYERS (default 24, the reference since session 16: 9.6 M parameters, ~2 min on an H200): the target's depth. LAYERS=8
# is the earlier reference (3.3 M), on which the one-layer EAGLE-3 head costs almost as much as the target: a
# speculative step there costs 2.2 plain steps, on the 24-layer target 1.5 (PERFORMANCE.md, fourteenth and fifteenth
# passes).
# GPUS=N (N > 1) or SIDE_BY_SIDE=1: the heads train at the same time, head i on GPU i mod N (a small head
# leaves most of a GPU idle, so on one GPU SIDE_BY_SIDE=1 shortens the wall time; the results are the same).
# OUT_DIR/{target,eagle3,eagle,medusa,draft}; each holds recipe.json (seed, steps, losses, corpus hash).
# Then: python -m research_lm -m experiment=spec_ablation model=hf model.name=OUT_DIR/target spec=eagle3 \
#   spec.model=OUT_DIR/eagle3 ...  (experiments/paper/README.md has the full sweep).
set -euo pipefail
OUT=${1:-outputs/reference}
COMMON="logger=jsonl train.batch_size=64 train.seq_len=512 train.corpus_bytes=null train.save_dtype=bfloat16 \
  train.log_every=100 train.progress=false"
python -m research_lm experiment=train_target $COMMON train.output_dir=$OUT/target \
  train.steps=1500 train.lr=2e-3 train.warmup_steps=100 train.eval_every=500 train.save_every=1500 \
  train.model.hidden_size=192 train.model.intermediate_size=512 train.model.num_hidden_layers=${LAYERS:-24} \
  train.model.num_attention_heads=6 train.model.num_key_value_heads=2
[ "${TARGET_ONLY:-0}" = 1 ] && exit 0  # TARGET_ONLY=1: the target alone (to train head variants on it)
HEADS="train.target=$OUT/target train.warmup_steps=50"
# The four heads only read the target, so they may train side by side.
GPUS=${GPUS:-1}
SIDE_BY_SIDE=${SIDE_BY_SIDE:-0}
[ "$GPUS" -gt 1 ] && SIDE_BY_SIDE=1
# head i trains on the (i mod GPUS)-th of the GPUs this script may use: those CUDA_VISIBLE_DEVICES names, else 0, 1, ...
# (session 29's heads ignored a lane's CUDA_VISIBLE_DEVICES=1 and trained on GPU 0 beside another lane's benchmarks)
IFS=, read -ra VISIBLE <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( GPUS - 1 )))}"
NUM_VISIBLE=$(( ${#VISIBLE[@]} < GPUS ? ${#VISIBLE[@]} : GPUS ))
i=0; pids=()
# EAGLE-3 trains longest, on the target's own greedy continuations, 3 per corpus window (~2 min of generation
# first), with training-time test over 5 steps and a 4096-wide MLP. On the 24-layer target: held-out acc 0.744
# against 0.737 with one continuation per window, tau 3.89 (3.82-4.04) at k = 5, batch 1 on an H200
# (PERFORMANCE.md, fifteenth pass; 2048 -> 4096 MLP: ninth and tenth passes). spec_ablation_h200 uses this recipe.
for head in "train_eagle3 eagle3 3500 train.head.ttt_steps=5 train.head.intermediate_size=4096 train.regenerate.fraction=1.0 \
             train.regenerate.copies=3" \
            "train_eagle eagle 800" \
            "train_medusa medusa 800 train.head.num_heads=5" "train_draft draft 800"; do
  set -- $head
  preset=$1; dir=$2; steps=$3; shift 3
  set -- train.steps=$steps train.eval_every=$steps train.save_every=$steps "$@"
  if [ "$SIDE_BY_SIDE" = 1 ]; then
    CUDA_VISIBLE_DEVICES=${VISIBLE[$(( i % NUM_VISIBLE ))]} python -m research_lm experiment=$preset $COMMON $HEADS \
      train.output_dir=$OUT/$dir hydra.run.dir=$OUT/runs/$dir "$@" > $OUT/$dir.log 2>&1 &  # own run dir: they start together
    pids+=($!)
  else
    python -m research_lm experiment=$preset $COMMON $HEADS train.output_dir=$OUT/$dir hydra.run.dir=$OUT/runs/$dir "$@"
  fi
  i=$(( i + 1 ))
done
for pid in "${pids[@]}"; do wait "$pid" || { echo "a head failed: see $OUT/*.log" >&2; exit 1; }; done
