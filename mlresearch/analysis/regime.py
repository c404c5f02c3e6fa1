"""Regime check: is the full model clearly better than the small shape trained alone for the same
FLOPs? Only then can a growth method's saving mean something (issue: evidence that answers the
question). The ``regime`` stage of a study (``mlresearch study SPEC --stage regime``) trains the
two runs per seed; this module turns them into ``results/tables/regime.csv`` rows, the verdict and
the figure.

- :func:`loss_at_flops`: a curve's validation loss at a FLOPs count, linear in log FLOPs between
  evaluations (the small model is evaluated on its own grid, never exactly at the baseline's total);
- :func:`regime_row`: one seed's row -- the baseline's final loss on the full validation split, the
  small model's at the baseline's FLOPs, the margin (positive: the full model is better);
- :func:`verdict`: per experiment, the margin against the baseline's seed spread. In the regime
  only when the *smallest* margin exceeds the spread: one lucky seed proves nothing;
- :func:`merge_rows`: a new run of the script replaces its own (experiment, seed) rows and keeps
  every other experiment's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from ..study import curves
from ..training.record import RunRecord

KEY = ["experiment", "seed"]


def loss_at_flops(curve: pd.DataFrame, flops: float) -> float:
    """The curve's validation loss at ``flops`` (linear in log FLOPs between evaluations). A curve
    that ends before ``flops`` is an error: extrapolating would invent the control's result."""
    if flops > curve.flops.iloc[-1] * (1 + 1e-9):
        raise ValueError(f"the curve ends at {curve.flops.iloc[-1]:.4g} FLOPs, before {flops:.4g}")
    return float(np.interp(np.log(flops), np.log(curve.flops), curve.val_loss))


def regime_row(experiment: str, seed: int, baseline: Path, small: Path, small_steps: int,
               word_order: Callable[[Path], float] | None = None) -> dict:
    """One seed's row from a finished baseline run and a finished small-alone run; ``word_order``
    (a run directory -> its final model's word-order gain) adds the two gain columns."""
    base, alone = RunRecord.read(baseline), RunRecord.read(small)
    row = {"experiment": experiment, "seed": seed, "baseline_final_val_loss": base.val_loss, "baseline_flops": base.flops,
           "small_val_loss_at_baseline_flops": loss_at_flops(curves(small), base.flops),
           "small_steps": small_steps, "small_final_val_loss": alone.val_loss}
    row["margin"] = row["small_val_loss_at_baseline_flops"] - row["baseline_final_val_loss"]
    if word_order is not None:
        row["baseline_word_order_gain"] = word_order(Path(baseline))
        row["small_word_order_gain"] = word_order(Path(small))
    return row


def merge_rows(previous: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """``new``'s rows, plus every row of ``previous`` whose (experiment, seed) ``new`` does not have;
    sorted by experiment and seed. A new row whose values equal its previous row's keeps that row's
    ``git_commit``: re-reading finished runs (``--finished``) from a later checkout measured nothing
    new, so the commit stays the one that wrote the row."""
    if len(previous):
        old = previous.set_index(KEY)
        new = new.copy()
        for i, row in new.iterrows() if "git_commit" in old else ():
            key = tuple(row[k] for k in KEY)
            if key in old.index and _same_values(old.loc[key], row):
                new.at[i, "git_commit"] = old.loc[key, "git_commit"]
        keep = ~old.index.isin(new.set_index(KEY).index)
        new = pd.concat([previous[keep], new], ignore_index=True)
    return new.sort_values(KEY).reset_index(drop=True)


def _same_values(old: pd.Series, row: pd.Series) -> bool:
    """Every column of ``row`` but the commit and the key equal in ``old`` (missing on both sides counts as equal)."""
    columns = [c for c in row.index if c not in ("git_commit", *KEY)]
    return all(c in old.index and (old[c] == row[c] or (pd.isna(old[c]) and pd.isna(row[c]))) for c in columns)


def verdict(part: pd.DataFrame) -> dict:
    """One experiment's rows -> the baseline's mean and seed spread (max - min), the margin's mean and
    minimum, and whether it is in the regime: every seed's margin beyond the spread."""
    spread = float(part.baseline_final_val_loss.max() - part.baseline_final_val_loss.min())
    return {"seeds": len(part), "baseline": float(part.baseline_final_val_loss.mean()), "spread": spread,
            "small": float(part.small_val_loss_at_baseline_flops.mean()), "margin": float(part.margin.mean()),
            "margin_min": float(part.margin.min()), "in_regime": bool(part.margin.min() > spread)}


def figure(root: Path, experiment: str, runs) -> Path:
    """Both shapes' validation curves against FLOPs, every seed (``runs``: (seed, baseline run,
    small-alone run) triples), into ``<root>/figures/regime_<experiment>.png``."""
    import matplotlib.pyplot as plt

    from . import plots

    fig, ax = plt.subplots(figsize=(7, 4))
    runs = sorted(runs, key=lambda r: r[0])
    for i, (seed, baseline, small) in enumerate(runs):
        for run, style, label in ((baseline, "k-", "full model"), (small, "C1-", "small shape alone")):
            c = curves(run)
            ax.plot(c.flops, c.val_loss, style, lw=1, alpha=0.8, label=label if i == 0 else None)
    ax.set(xscale="log", xlabel="training FLOPs", ylabel="validation loss (full split)",
           title=f"{experiment}: full model vs the small shape at equal FLOPs ({len(runs)} seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return plots.save(fig, Path(root) / "figures" / f"regime_{experiment}.png")
