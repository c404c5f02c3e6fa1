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
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

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


def evals(run: Path) -> pd.DataFrame:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return pd.DataFrame([r for r in rows if "val_loss" in r and "event" not in r])


def at_flops(curve: pd.DataFrame, flops: float) -> float:
    """The curve's validation loss at ``flops`` (linear in log FLOPs between evaluations)."""
    if flops > curve.flops.iloc[-1] * (1 + 1e-9):
        raise ValueError(f"the curve ends at {curve.flops.iloc[-1]:.4g} FLOPs, before {flops:.4g}")
    return float(np.interp(np.log(flops), np.log(curve.flops), curve.val_loss))


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
            base_dir = root / cfg.experiment / f"baseline-seed{seed}"
            base = json.loads((base_dir / "summary.json").read_text())
            small = evals(small_out)
            rows.append({"experiment": cfg.experiment, "seed": seed,
                         "baseline_final_val_loss": base["final_full_val"]["val_loss"],
                         "baseline_flops": base["flops_total"],
                         "small_val_loss_at_baseline_flops": at_flops(small, base["flops_total"]),
                         "small_steps": steps, "small_final_val_loss":
                         json.loads((small_out / "summary.json").read_text())["final_full_val"]["val_loss"]})
            rows[-1]["margin"] = rows[-1]["small_val_loss_at_baseline_flops"] - rows[-1]["baseline_final_val_loss"]
            if task_of(cfg.task).sequences:
                rows[-1]["baseline_word_order_gain"] = run_word_order(base_dir).gain
                rows[-1]["small_word_order_gain"] = run_word_order(small_out).gain
    table = pd.DataFrame(rows).assign(git_commit=provenance({}, 0)["git_commit"])
    out = root / "tables" / "regime.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = pd.read_csv(out) if out.exists() else pd.DataFrame()
    if len(previous):  # keep other experiments' rows; replace this run's
        keep = ~previous.set_index(["experiment", "seed"]).index.isin(table.set_index(["experiment", "seed"]).index)
        table = pd.concat([previous[keep], table], ignore_index=True)
    tmp = out.with_suffix(".tmp")
    table.sort_values(["experiment", "seed"]).to_csv(tmp, index=False)
    tmp.replace(out)
    figures(table, root)
    for experiment, part in table.groupby("experiment"):
        spread = part.baseline_final_val_loss.max() - part.baseline_final_val_loss.min()
        print(f"{experiment}: baseline {part.baseline_final_val_loss.mean():.4f} (seed spread {spread:.4f}), small "
              f"alone at the same FLOPs {part.small_val_loss_at_baseline_flops.mean():.4f}; margin "
              f"{part.margin.mean():+.4f} (min {part.margin.min():+.4f}, {len(part)} seeds): "
              + ("in the regime" if part.margin.min() > spread else "NOT clearly in the regime"))
        if "baseline_word_order_gain" in part and part.baseline_word_order_gain.notna().any():
            print(f"  word-order gain (shuffled - ordered validation loss): full model "
                  f"{part.baseline_word_order_gain.mean():.3f}, small shape {part.small_word_order_gain.mean():.3f}")
    print(f"wrote {out}")


def figures(table: pd.DataFrame, root: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mlresearch.analysis import plots

    for experiment, part in table.groupby("experiment"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for seed in part.seed:
            for run, style, label in ((f"baseline-seed{seed}", "k-", "full model"),
                                      (f"small-equalflops-seed{seed}", "C1-", "small shape alone")):
                c = evals(root / experiment / run)
                ax.plot(c.flops, c.val_loss, style, lw=1, alpha=0.8, label=label if seed == part.seed.min() else None)
        ax.set(xscale="log", xlabel="training FLOPs", ylabel="validation loss (full split)",
               title=f"{experiment}: full model vs the small shape at equal FLOPs ({len(part)} seeds)")
        ax.grid(alpha=0.3)
        ax.legend()
        plots.save(fig, root / "figures" / f"regime_{experiment}.png")


if __name__ == "__main__":
    main()
