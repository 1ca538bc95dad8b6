#!/usr/bin/env bash
# The GPU reference DeepSeek target for MTP vs EAGLE-3 (issue 36), trained in-framework (self-distillation on the
# stdlib + pydoc corpus), then its two drafters side by side. One H200, estimated (not yet measured): target ~2.5 min,
# then the MTP layer (~4 min) beside EAGLE-3 (~6.5 min; each head regenerates its data first, ~2 min) -> ~9-10 min.
#   [GPUS=N] [LAYERS=L] [TINY=1] bash experiments/train_reference_mtp.sh [OUT_DIR]   # default outputs/reference_mtp
# The target: DeepSeek-V2 (experiment=train_moe, harness/train/moe.py) sized like experiments/train_reference.sh's
# Llama: hidden 192, LAYERS (default 24) layers, 6 heads, MLA of head_dim 32 (qk_nope = v = 32, qk_rope 16,
# kv_lora_rank 128, no q_lora), a dense MLP of 512 in every layer (first_k_dense_replace above the depth, so the MTP
# layer at index LAYERS is dense too: transformers' routed-expert loop would train several times slower), the same
# corpus, steps and learning rate.
# The heads read the target only, so they train at the same time (head i on GPU i mod GPUS), on the same data: the
# target's own greedy continuations, 3 per corpus window, 3500 steps (train_reference.sh's EAGLE-3 recipe: ttt_steps 5,
# MLP 4096). OUT_DIR/mtp is a copy of the target with one MTP layer (DeepSeek-V3's layout; spec=mtp drafts from it);
# OUT_DIR/eagle3 the EAGLE-3 head; OUT_DIR/{target,mtp,eagle3}/recipe.json record seed, steps, losses, corpus hash;
# OUT_DIR/runs/<name> each run's results.json (the heads start together: a timestamped run dir could be shared).
# TINY=1: the same presets at CPU sizes in seconds (tests/train/test_deepseek_reference.py runs it).
# Then: python -m experiments.paper spec_mtp_h200 (experiments/paper/README.md).
set -euo pipefail
OUT=${1:-outputs/reference_mtp}
LAYERS=${LAYERS:-24}
mkdir -p "$OUT"
if [ "${TINY:-0}" = 1 ]; then
  COMMON="logger=none device=cpu train.batch_size=2 train.seq_len=32 train.corpus_bytes=30000 train.pydoc=false \
    train.save_dtype=float32 train.log_every=1 train.progress=false train.eval_batches=2"
  SHAPE="train.model.hidden_size=32 train.model.intermediate_size=64 train.model.num_hidden_layers=4 \
    train.model.num_attention_heads=2 train.model.head_dim=16 train.model.first_k_dense_replace=5"
  TARGET_STEPS=3; HEAD_STEPS=3; EAGLE3_SIZE="train.head.intermediate_size=64"; COPIES="train.regenerate.copies=1 \
    train.regenerate.fraction=0.05"
else
  COMMON="logger=jsonl train.batch_size=64 train.seq_len=512 train.corpus_bytes=null train.save_dtype=bfloat16 \
    train.log_every=100 train.progress=false"
  SHAPE="train.model.hidden_size=192 train.model.intermediate_size=512 train.model.num_hidden_layers=$LAYERS \
    train.model.num_attention_heads=6 train.model.head_dim=32 train.model.first_k_dense_replace=$(( LAYERS + 1 ))"
  TARGET_STEPS=1500; HEAD_STEPS=3500; EAGLE3_SIZE="train.head.intermediate_size=4096"; COPIES="train.regenerate.copies=3 \
    train.regenerate.fraction=1.0"
fi
python -m research_lm experiment=train_moe $COMMON train.architecture=DeepseekV2ForCausalLM $SHAPE \
  train.output_dir=$OUT/target train.steps=$TARGET_STEPS train.lr=2e-3 train.warmup_steps=100 \
  train.eval_every=$(( TARGET_STEPS / 3 )) train.save_every=$TARGET_STEPS hydra.run.dir=$OUT/runs/target
HEADS="train.target=$OUT/target train.warmup_steps=50 train.steps=$HEAD_STEPS train.eval_every=$HEAD_STEPS \
  train.save_every=$HEAD_STEPS $COPIES"
GPUS=${GPUS:-1}
# head i on the (i mod GPUS)-th of the GPUs CUDA_VISIBLE_DEVICES names (else 0, 1, ...): a lane's GPU, not GPU 0
IFS=, read -ra VISIBLE <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( GPUS - 1 )))}"
NUM_VISIBLE=$(( ${#VISIBLE[@]} < GPUS ? ${#VISIBLE[@]} : GPUS ))
i=0; pids=()
for head in "train_mtp mtp" "train_eagle3 eagle3 train.head.ttt_steps=5 $EAGLE3_SIZE"; do
  set -- $head
  preset=$1; dir=$2; shift 2
  CUDA_VISIBLE_DEVICES=${VISIBLE[$(( i % NUM_VISIBLE ))]} python -m research_lm experiment=$preset $COMMON $HEADS \
    train.output_dir=$OUT/$dir hydra.run.dir=$OUT/runs/$dir "$@" > $OUT/$dir.log 2>&1 &
  pids+=($!)
  i=$(( i + 1 ))
done
for pid in "${pids[@]}"; do wait "$pid" || { echo "a head failed: see $OUT/*.log" >&2; exit 1; }; done
