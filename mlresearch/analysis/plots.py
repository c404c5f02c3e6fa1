"""Figures: heatmaps with labelled axes and colour bars, small multiples, trends over training."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch


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
    x = range(len(summary))
    for column, label in (("adjacent_layers", "mean adjacent-layer"), ("within_layer_heads", "mean within-layer heads")):
        ax.plot(x, summary[column], marker="o", label=label)
    ax.set_xticks(list(x), summary["snapshot"], rotation=45, ha="right", fontsize=7)
    ax.set(ylabel="similarity", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def save(fig, path: str | Path, close: bool = True) -> Path:
    """Write a PNG atomically (``close=False`` keeps it for a notebook to show)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    if close:
        plt.close(fig)
    return path
