#!/usr/bin/env bash
# Acceptance profiles of the GPU reference pair (issue 30): each trained drafter at k = 5, batch 1, greedy, on
# spec_ablation's code workload (8 prompts x 128 tokens, seed 0), recorded with record_acceptance=true (per-position
# rates and every request's trace) into research_lm/assets/profiles/reference_<method>_k5.json, which
# spec_transfer_8b_h200 and spec_replay_validation_h200 replay. Trains the reference first when it is missing.
#   [METHODS="eagle3 ..."] bash experiments/record_reference_profiles.sh [REF_DIR]   # default outputs/reference, all
#   four methods; ~3 min on an H200
set -euo pipefail
REF=${1:-outputs/reference}
[ -d "$REF/target" ] || SIDE_BY_SIDE=1 bash experiments/train_reference.sh "$REF"
for spec in "eagle3 spec.model=$REF/eagle3" "medusa spec.model=$REF/medusa" "draft_model spec.model=$REF/draft" ngram; do
  set -- $spec
  method=$1; shift
  case " ${METHODS:-eagle3 medusa draft_model ngram} " in *" $method "*) ;; *) continue ;; esac
  python -m research_lm experiment=spec_ablation device=cuda attention=triton logger=jsonl model=hf \
    model.name="$REF/target" spec="$method" "$@" spec.num_speculative_tokens=5 workload.temperature=0.0 \
    workload.max_tokens=128 workload.num_requests=8 runner.max_num_seqs=1 runner.num_gpu_blocks=4096 seed=0 \
    record_acceptance=true hydra.run.dir="outputs/profiles/$method"
  python - "$method" <<'PY'
import itertools, json, sys, torch
from research_lm.harness.env_info import git_state
method = sys.argv[1]
profile = json.load(open(f"outputs/profiles/{method}/acceptance_profile.json"))
commit = git_state()["commit"][:12]
profile["source"] = (f"research_lm's GPU reference pair (experiments/train_reference.sh): {method} k=5 on the 24-layer "
                     f"target, batch 1, greedy, spec_ablation's 8 code prompts x 128 tokens, seed 0; "
                     f"{torch.cuda.get_device_name()}, commit {commit or 'unknown'} "
                     f"(experiments/record_reference_profiles.sh)")
with open(f"research_lm/assets/profiles/reference_{method}_k5.json", "w") as f:
    json.dump(profile, f, indent=1)
    f.write("\n")
print(method, "tau", 1 + sum(itertools.accumulate(profile["per_position"], lambda a, b: a * b)))
PY
done
