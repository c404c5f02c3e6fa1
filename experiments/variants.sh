#!/usr/bin/env bash
# V-cycle variants against the paper's variant on GPT-2 tiny, same seed(s), beside the baseline and the
# other methods (issue: methods as plans). Resumable (finished runs are reported, killed ones resume);
# runs go to runs/variants/ (not the committed study). One run at a time; run it niced:
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
  go --method stack
  for run in "$root"/gpt2_tiny/*-seed"$seed"; do
    [ "$(basename "$run")" = "baseline-seed$seed" ] && continue
    echo "== $(basename "$run")"; mlresearch compare "$root/gpt2_tiny/baseline-seed$seed" "$run"
  done
done
