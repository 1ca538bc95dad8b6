#!/usr/bin/env bash
# The attention-zoo presets at GPU size, 3 seeds each (bf16, one H100/H200, ~6 min):
#   attention_ablation: Llama-3.2-1B shape (random weights), torch_ref / triton / flashinfer x batch 1, 16, 64, 256
#   mla, sliding_window, mamba: memory per token and decode speed vs the same-size dense GQA baseline
#   bash experiments/zoo_presets_gpu.sh SWEEP_DIR
# Then: python -m research_lm.harness.report SWEEP_DIR/<preset> --repeat-key seed (median and spread over the seeds).
# The same sweeps, one table each: python -m experiments.paper {mla,sliding_window,mamba,attention_ablation}_h200
set -uo pipefail
SWEEP=$1
mkdir -p $SWEEP
run() {  # name, overrides...
  local name=$1; shift
  python -m research_lm -m device=cuda logger=jsonl seed=0,1,2 "$@" model.random.cache_dir=/tmp/rl_random \
    model.random.seed=0 hydra.sweep.dir=$SWEEP/$name \
    > $SWEEP/$name.log 2>&1 || echo "sweep $name failed: see $SWEEP/$name.log"
}
for preset in mla sliding_window mamba; do
  backend=$([ $preset = mamba ] && echo "attention=triton ++attention.mamba_backend=mamba_triton" || echo "attention=triton")
  run $preset experiment=$preset $backend workload.num_requests=64 workload.prompt_chars=8000 \
    workload.max_tokens=256 runner.max_num_seqs=64 runner.num_gpu_blocks=16000 warmup_requests=64
done
for batch in 1 16 64 256; do
  nreq=$(( batch < 4 ? 4 : 2 * batch )); nreq=$(( nreq > 256 ? 256 : nreq ))
  run attention_ablation-b$batch experiment=attention_ablation model=random-llama-1b \
    attention=torch_ref,triton,flashinfer workload=synthetic workload.num_requests=$nreq \
    'workload.input_len=[512,512]' 'workload.output_len=[128,128]' runner.max_num_seqs=$batch warmup_requests=$batch \
    runner.num_gpu_blocks=12000 runner.max_num_batched_tokens=8192
done
