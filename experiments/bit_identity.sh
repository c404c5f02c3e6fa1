#!/bin/bash
# Behaviour unchanged by a refactor: the smoke presets' runs at two commits give the same
# metrics.jsonl and summary.json, less their wall-clock fields (wall, seconds, mfu, wall_total).
#   experiments/bit_identity.sh OLD_REV [NEW_REV, default HEAD]      (a few minutes on 2 CPU cores)
# Each commit is checked out in a temporary worktree and run with this environment's python.
set -eu
old=$(git rev-parse --short "${1:?usage: experiments/bit_identity.sh OLD_REV [NEW_REV]}")
new=$(git rev-parse --short "${2:-HEAD}")
work=$(mktemp -d)
trap 'for r in $old $new; do git worktree remove --force "$work/tree-$r" 2>/dev/null || true; done; rm -rf "$work"' EXIT
runs=(
 "gpt2_smoke baseline"
 "gpt2_smoke small"
 "gpt2_smoke vcycle"
 "gpt2_smoke vcycle --set vcycle.alpha=adaptive"
 "gpt2_smoke vcycle --set vcycle.alpha=adaptive-row"
 "gpt2_smoke vcycle --set vcycle.alpha=search --set data.tune_fraction=0.1 --set vcycle.search_batches=2"
 "gpt2_smoke vcycle --set vcycle.optimizer=carry"
 "gpt2_smoke staged"
 "gpt2_smoke stack"
 "gpt2_smoke stackbert"
 "gpt2_smoke bert2bert"
 "gpt2_smoke ki"
 "gpt2_smoke ligo"
 "gpt2_smoke msg"
 "bert_smoke baseline"
 "bert_smoke vcycle"
 "deit_smoke vcycle"
 "llama_smoke vcycle"
)
for rev in $old $new; do
  tree=$work/tree-$rev
  git worktree add -q --detach "$tree" "$rev"
  for i in "${!runs[@]}"; do
    set -- ${runs[$i]}; cfg=$1; method=$2; shift 2
    out=$work/out-$rev/$i; mkdir -p "$work/out-$rev"
    (cd "$tree" && PYTHONPATH="$tree" python -m mlresearch.cli run "experiments/configs/$cfg.yaml" --method "$method" "$@" \
       --out "$out" > "$out.log" 2>&1) || echo "$rev: ${runs[$i]} failed: $(tail -n 1 "$out.log")"
  done
done
python - "$work" "$old" "$new" "${runs[@]}" <<'PY'
import json, sys
from pathlib import Path

work, old, new, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
TIMED = {"wall", "seconds", "mfu", "wall_total"}

def untimed(x):
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if k not in TIMED}
    return [untimed(v) for v in x] if isinstance(x, list) else x

def record(rev, i):
    out = work / f"out-{rev}" / str(i)
    if not (out / "summary.json").exists():
        return None
    return ([untimed(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()],
            untimed(json.loads((out / "summary.json").read_text())))

same = 0
for i, run in enumerate(runs):
    a, b = record(old, i), record(new, i)
    if a and b:  # a field the newer summary adds is a new fact, not a changed one: compare the older's fields
        b = (b[0], {k: v for k, v in b[1].items() if k in a[1]})
    ok = a is not None and a == b
    same += ok
    print(f"{'identical' if ok else 'DIFFERENT'}  {run}  ({len(a[0]) if a else 0} rows)")
    if a and b and not ok:
        first = next(((x, y) for x, y in zip(a[0], b[0]) if x != y), None)
        if first:
            print("    first row that differs:", {k: (first[0].get(k), first[1].get(k))
                                                for k in set(first[0]) | set(first[1]) if first[0].get(k) != first[1].get(k)})
print(f"{same} of {len(runs)} smoke runs bit-identical between {old} and {new} "
      "(metrics.jsonl and the older summary.json's fields, less wall-clock fields)")
sys.exit(same != len(runs))
PY
