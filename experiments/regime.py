"""Regime check: is the full model clearly better than the small shape trained alone for the same
FLOPs? Only then can a growth method's saving mean something (issue: evidence that answers the
question). For each experiment and seed, one run at a time, resumable:

1. the baseline (``--method baseline``) at the preset's budget, with the LR and warm-up ``mlresearch
   study`` chose for it on the tuning split when it has (``results/tables/baseline_tuning.csv``);
2. the small shape (the V-cycle's smallest level) trained alone, with its own warm-up + decay
   schedule, for as many steps as the baseline's FLOPs buy it (``--method small``, more steps): the
   strongest small-model control at equal compute.

Then ``results/tables/regime.csv`` (experiment, seed, baseline final validation loss on the full
split, the small model's at the same FLOPs, the margin, for sequence tasks each final model's
word-order gain -- the loss it loses when the tokens of a validation block are shuffled, ~0 on the
masked-LM bag-of-words plateau (:mod:`mlresearch.analysis.word_order`) -- git commit) and
``results/figures/regime_<experiment>.png`` (both curves against FLOPs, every seed). The margin
must exceed the seed spread; the script prints both.

    nice -n 10 python experiments/regime.py gpt2_regime [--seeds 0 1 2] [--root results]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from mlresearch.analysis.regime import figure, merge_rows, regime_row, verdict
from mlresearch.analysis.word_order import run_word_order
from mlresearch.results import REPO, provenance
from mlresearch.study_runner import equal_flops_steps
from mlresearch.tasks import task_of
from mlresearch.training.config import load_config


def mlresearch(*args: str) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "mlresearch.cli", *args], cwd=REPO, env=env)
    if done.returncode:
        sys.exit(f"mlresearch {' '.join(args)} failed ({done.returncode})")


def tuned_baseline(root: Path, experiment: str) -> list[str]:
    """The baseline's LR and warm-up as ``mlresearch study`` chose them on the tuning split
    (``<root>/tables/baseline_tuning.csv``), or the preset's when it has not tuned them."""
    path = root / "tables" / "baseline_tuning.csv"
    if not path.exists():
        return []
    chosen = pd.read_csv(path).query("experiment == @experiment and chosen")
    if chosen.empty:
        return []
    return ["--set", f"train.lr={chosen.lr.iloc[0]:g}", "--set", f"train.warmup={int(chosen.warmup.iloc[0])}"]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiments", nargs="+", help="preset names in experiments/configs (e.g. gpt2_regime)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--root", default="results")
    args = ap.parse_args()
    root = Path(args.root)
    rows = []
    for name in args.experiments:
        config = REPO / "experiments" / "configs" / f"{name}.yaml"
        for seed in args.seeds:
            cfg = load_config(config, [f"seed={seed}"])
            steps, warmup = equal_flops_steps(cfg)
            small_out = root / cfg.experiment / f"small-equalflops-seed{seed}"
            mlresearch("run", str(config), "--method", "baseline", "--root", str(root), "--resume", "--skip-done",
                       "--set", f"seed={seed}", *tuned_baseline(root, cfg.experiment))
            mlresearch("run", str(config), "--method", "small", "--out", str(small_out), "--resume", "--skip-done",
                       "--set", f"seed={seed}", "--set", f"train.steps={steps}", "--set", f"train.warmup={warmup}")
            gain = (lambda run: run_word_order(run).gain) if task_of(cfg.task).sequences else None
            rows.append(regime_row(cfg.experiment, seed, root / cfg.experiment / f"baseline-seed{seed}", small_out,
                                   steps, word_order=gain))
    table = pd.DataFrame(rows).assign(git_commit=provenance({}, 0)["git_commit"])
    out = root / "tables" / "regime.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    table = merge_rows(pd.read_csv(out) if out.exists() else pd.DataFrame(), table)
    tmp = out.with_suffix(".tmp")
    table.to_csv(tmp, index=False)
    tmp.replace(out)
    for experiment, part in table.groupby("experiment"):
        figure(root, experiment, part.seed)
        v = verdict(part)
        print(f"{experiment}: baseline {v['baseline']:.4f} (seed spread {v['spread']:.4f}), small alone at the same "
              f"FLOPs {v['small']:.4f}; margin {v['margin']:+.4f} (min {v['margin_min']:+.4f}, {v['seeds']} seeds): "
              + ("in the regime" if v["in_regime"] else "NOT clearly in the regime"))
        if "baseline_word_order_gain" in part and part.baseline_word_order_gain.notna().any():
            print(f"  word-order gain (shuffled - ordered validation loss): full model "
                  f"{part.baseline_word_order_gain.mean():.3f}, small shape {part.small_word_order_gain.mean():.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
