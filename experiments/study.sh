#!/usr/bin/env bash
# The reproduction study (issue: reproduction study). Each line is one run; a run already complete
# is skipped, a killed one resumes. Runs land in results/<experiment>/<run>/ and can be committed
# as they complete. `mlresearch table` turns them into results/tables/ and README's Results.
#   bash experiments/study.sh [gpt2|bert|deit|all]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
which=${1:-all}

run() {  # run KIND CONFIG [overrides...]
  local kind=$1 config=$2; shift 2
  local sets=()
  for o in "$@"; do sets+=(--set "$o"); done
  mlresearch "$kind" "$config" --resume --skip-done "${sets[@]}"
}

study() {  # study MODEL
  local c=experiments/configs/$1_tiny.yaml
  for seed in 0 1; do
    run train "$c" seed=$seed
    run vcycle "$c" seed=$seed                                   # alpha from the preset, optimizer reset
    run vcycle "$c" seed=$seed vcycle.alpha=adaptive
    run vcycle "$c" seed=$seed vcycle.alpha=adaptive vcycle.optimizer=carry
  done
  run vcycle "$c" vcycle.alpha=0.5
  run vcycle "$c" vcycle.alpha=0.25
  run vcycle "$c" vcycle.optimizer=carry
  run vcycle "$c" vcycle.scheme=similarity
}

case $which in
  gpt2|bert|deit) study "$which" ;;
  all) study gpt2; run vcycle experiments/configs/gpt2_tiny_3level.yaml; study bert; study deit ;;
  *) echo "usage: $0 [gpt2|bert|deit|all]" >&2; exit 2 ;;
esac
