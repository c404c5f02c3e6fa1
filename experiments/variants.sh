#!/usr/bin/env bash
# V-cycle variants against the paper's variant on GPT-2 tiny, same seed(s), beside the baseline and the
# other methods (issue: methods as plans). Resumable (finished runs are reported, killed ones resume);
# runs go to runs/variants/ and runs/variants-tune/ (not the committed study). One run at a time; run it niced:
#   nice -n 10 bash experiments/variants.sh [SEED...]        (default seed 0)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
c=experiments/configs/gpt2_tiny.yaml
root=runs/variants
for seed in "${@:-0}"; do
  go() { mlresearch run "$c" --root "$root" --resume --skip-done --set seed="$seed" "$@"; }
  go --method baseline
  go --method vcycle                                                     # the paper: copy up-path, alpha 0.25
  go --method vcycle --set vcycle.up_path=identity                       # identity blocks on the way up
  go --method vcycle --set vcycle.up_path=identity --set vcycle.alpha=1.0  # ... and no merge with the partner
  go --method vcycle --set vcycle.up_path=identity --set vcycle.alpha=1.0 --set vcycle.tie_break=0.01  # ... + noise
  go --method small
  go --method staged
  go --method staged --set staged.trigger=true --set train.eval_every=10 --set staged.tag=trigger  # grow when B.6 fires
  go --method stack
  # Searched alpha needs documents held out of training for its choice (data.tune_fraction), so it and
  # the runs it is compared with train on 2% fewer documents: their own root.
  tune=(--root "$root-tune" --set data.tune_fraction=0.02)
  go "${tune[@]}" --method baseline
  go "${tune[@]}" --method vcycle
  go "${tune[@]}" --method vcycle --set vcycle.alpha=search
  go "${tune[@]}" --method vcycle --set vcycle.alpha=search --set vcycle.up_path=identity
  for r in "$root" "$root-tune"; do
    for run in "$r"/gpt2_tiny/*-seed"$seed"; do
      [ "$(basename "$run")" = "baseline-seed$seed" ] && continue
      echo "== $(basename "$run")"; mlresearch compare "$r/gpt2_tiny/baseline-seed$seed" "$run"
    done
  done
done
