"""Figures: heatmaps with labelled axes and colour bars, small multiples, trends over training."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

from ..frontier import dominated
from ..study import variant_name
from ..training.methods import METHODS


def heatmap(matrix, ax=None, title: str = "", label: str = "i", value: str = "similarity", vmin=None, vmax=None):
    m = matrix.numpy() if isinstance(matrix, torch.Tensor) else matrix
    ax = ax or plt.subplots(figsize=(4, 3.4))[1]
    im = ax.imshow(m, cmap="viridis", vmin=vmin, vmax=vmax)
    ax.set(title=title, xlabel=label, ylabel=label, xticks=range(m.shape[1]), yticks=range(m.shape[0]))
    ax.figure.colorbar(im, ax=ax, label=value, fraction=0.046, pad=0.04)
    return ax


def small_multiples(matrices: dict, title: str, label: str = "layer", value: str = "similarity", ncols: int = 4):
    n = len(matrices)
    cols = min(ncols, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
    lo = min(float(m.min()) for m in matrices.values())
    hi = max(float(m.max()) for m in matrices.values())
    for ax, (name, m) in zip(axes.flat, matrices.items()):
        heatmap(m, ax, str(name), label, value, lo, hi)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def trend(summary: pd.DataFrame, title: str = "Similarity over training"):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    # Snapshots of several phases (a V-cycle's) share step numbers: their order, labelled "phase step N".
    x = list(summary["step"]) if summary["step"].is_monotonic_increasing else list(range(len(summary)))
    for column, label in (("adjacent_layers", "mean adjacent-layer"), ("within_layer_heads", "mean within-layer heads")):
        ax.plot(x, summary[column], marker="o", label=label)
    if not summary["step"].is_monotonic_increasing:
        ax.set_xticks(x, [("final" if s < 0 else f"{p} step {s}") for p, s in zip(summary["phase"], summary["step"])],
                      rotation=45, ha="right", fontsize=7)  # (a final model's snapshot has no step: -1)
    ax.set(xlabel="training step", ylabel="similarity", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def save(fig, path: str | Path, close: bool = True) -> Path:
    """Write a PNG atomically (``close=False`` keeps it for a notebook to show)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")  # a legend beside the axes is kept whole
    tmp.replace(path)
    if close:
        plt.close(fig)
    return path


def frontier_figure(points: pd.DataFrame, runs: pd.DataFrame, experiment: str, headline=None):
    """The figure that answers the question: validation loss against training FLOPs, with the
    baseline's and the small shape's annealed frontiers (mean over seeds, the band their range) and
    each method's end point (mean, with its seed spread in FLOPs and loss as error bars).
    ``points``: ``frontier.csv`` rows; ``runs``: :func:`mlresearch.study.collect` rows; ``headline``:
    the run directories of the main rows (``study_runner.headlines``: directory -> label, such as
    "the paper's"), drawn strong, labelled and listed first,
    every other variant faded below them (all drawn alike when not given)."""
    fig, ax = plt.subplots(figsize=(13, 6))
    colours = plt.get_cmap("tab10").colors + plt.get_cmap("tab20").colors[1::2]  # strong first, then light
    mine = points[(points.experiment == experiment) & (points.role == "frontier")]
    shapes = mine["shape"].fillna("").astype(str) if "shape" in mine else pd.Series("", index=mine.index)
    curves = [(mine[mine.method == "baseline"], "black", "-o", "baseline (full shape), annealed at each budget")]
    for n, shape in enumerate(sorted(set(shapes[mine.method == "small"]))):  # each small-model control its own curve
        curves.append((mine[(mine.method == "small") & (shapes == shape)], "grey", ("-s", "--s", ":s")[n % 3],
                       f"small shape {shape + ' ' if shape else ''}alone, annealed at each budget"))
    for part, colour, style, name in curves:
        if part.empty:
            continue
        g = part.groupby("budget").agg(flops=("flops", "mean"), loss=("val_loss", "mean"), lo=("val_loss", "min"),
                                       hi=("val_loss", "max"), seeds=("seed", "nunique")).sort_index()
        lo, hi = int(g.seeds.min()), int(g.seeds.max())  # a budget still running has fewer seeds so far
        seeds = f"{hi} seed{'s' * (hi > 1)}" if lo == hi else f"{lo}-{hi} seeds by budget"
        ax.plot(g.flops, g.loss, style, color=colour, lw=2, ms=4, label=f"{name} ({seeds})")
        ax.fill_between(g.flops, g.lo, g.hi, color=colour, alpha=0.15, lw=0)
        off = [row for _, one in part.sort_values("flops").groupby("seed")  # in the mean, not in its seed's frontier
               for row, out in zip(one.itertuples(), dominated(list(one.val_loss))) if out]
        if off:
            ax.plot([r.flops for r in off], [r.val_loss for r in off], "x", color=colour, ms=7, mew=1.5,
                    label=f"{name.split(',')[0]}: a seed's point above a cheaper one of its own, not on its frontier")
    rows = runs[runs.experiment == experiment]
    keys = ["method", "levels", "scheme", "alpha", "optimizer", "budget"]
    groups = list(rows.groupby(keys, dropna=False))
    main = [headline is None or part.run.isin(set(headline)).any() for _, part in groups]
    order = sorted(range(len(groups)), key=lambda i: not main[i])  # the main rows first, in the legend too
    for n, i in enumerate(order):
        part = groups[i][1]
        row, strong = part.iloc[0], main[i]
        tag = next((headline[r] for r in part.run if isinstance(headline, dict) and headline.get(r)), "")
        ax.errorbar(part.method_total_flops.mean(), part.method_full_val_loss.mean(),
                    xerr=part.method_total_flops.std() if len(part) > 1 else None,
                    yerr=part.method_full_val_loss.std() if len(part) > 1 else None,
                    fmt=METHODS[row.method].marker if row.method in METHODS else "^", color=colours[n % len(colours)],
                    ms=8 if strong else 5, capsize=3, alpha=1.0 if strong else 0.45, zorder=3 if strong else 2,
                    label=textwrap.fill(("" if strong or headline is None else "(other) ") +
                                        f"{variant_name(row)} ({tag + '; ' if tag else ''}{len(part)} "
                                        f"seed{'s' * (len(part) > 1)})", 70, subsequent_indent="    "))
    ax.set_xscale("log")
    ax.set(xlabel="training FLOPs (log)", ylabel="final validation loss (full split)",
           title=f"{experiment}: end points against the annealed frontiers\n(band: range over seeds; error bars: sd)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
