#!/usr/bin/env bash
# The reproduction study (issue: reproduction study). Each line is one run; a run already complete
# is skipped, a killed one resumes. Runs land in results/<experiment>/<run>/ and can be committed
# as they complete. `mlresearch table` turns them into results/tables/ and README's Results.
#   bash experiments/study.sh [gpt2|bert|deit|all]   the grid of variants (2 seeds for the main ones)
#   bash experiments/study.sh tune gpt2|bert|deit [SEED [best]]   budget/LR variants (validation only)
#   bash experiments/study.sh downstream              downstream checks of every finished run
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
which=${1:-all}

run() {  # run KIND CONFIG [overrides...]
  local kind=$1 config=$2; shift 2
  local sets=()
  for o in "$@"; do sets+=(--set "$o"); done
  mlresearch "$kind" "$config" --root results --resume --skip-done "${sets[@]}"
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

tune() {  # tune MODEL [SEED [best]]: budgets of adaptive alpha + carried optimizer (the best preset variant),
          # judged on the validation loss; "best" runs only the budget chosen on GPT-2 seed 0
  local c=experiments/configs/$1_tiny.yaml seed=${2:-0} only=${3:-} s=1
  [ "$1" = deit ] && s=2  # DeiT's preset budgets are twice the language models'
  local v=(seed=$seed vcycle.alpha=adaptive vcycle.optimizer=carry)
  # "full": the up-phase fills the baseline's full-model steps (E_a + up = train.steps), so the run can
  # cross the baseline's final loss wherever it does, or show that it does not.
  # Chosen (GPT-2 seed 0, validation): twice the small-model steps, full up-phase.
  run vcycle "$c" "${v[@]}" vcycle.tag=small300-full vcycle.small_steps=$((300 * s)) "vcycle.up_steps=[$((270 * s))]"
  [ "$only" = best ] && return 0
  run vcycle "$c" "${v[@]}" vcycle.tag=full "vcycle.up_steps=[$((270 * s))]"
  run vcycle "$c" "${v[@]}" vcycle.tag=ea60-full "vcycle.down_steps=[$((60 * s))]" "vcycle.up_steps=[$((240 * s))]"
  run vcycle "$c" "${v[@]}" vcycle.tag=full-smalllr4e-3 "vcycle.lr=[0.001,0.004]" "vcycle.up_steps=[$((270 * s))]"
}

downstream() {  # every finished run that still has its final model (final_model/ is not committed)
  local runs=()
  for d in results/*_tiny/*/; do
    [ -f "$d/summary.json" ] && [ -d "$d/final_model" ] && runs+=("$d")
  done
  # BERT's fine-tuning LR is chosen on training articles of the baselines only (held-out ones untouched).
  local f=results/bert_tiny/finetune_lr.json
  [ -f "$f" ] || python experiments/select_finetune_lr.py
  local lr
  lr=$(python -c "import json; print(json.load(open('$f'))['chosen_lr'])")
  mlresearch downstream --skip-done --finetune-lr "$lr" "${runs[@]}"
}

case $which in
  gpt2|bert|deit) study "$which" ;;
  tune) tune "${2:?usage: $0 tune gpt2|bert|deit [seed [best]]}" "${3:-0}" "${4:-}" ;;
  downstream) downstream ;;
  all) study gpt2; run vcycle experiments/configs/gpt2_tiny_3level.yaml; study bert; study deit
       tune gpt2; tune gpt2 1 best; tune bert 0 best; tune deit 0 best; downstream ;;
  *) echo "usage: $0 [gpt2|bert|deit|all] | tune MODEL [SEED] | downstream" >&2; exit 2 ;;
esac
