"""Similarity maps over training: one tidy frame over a run's model snapshots.

Columns: ``snapshot`` (directory name), ``phase``, ``step``, ``metric``, ``kind`` (``layers`` for
inter-layer features, ``attention`` for inter-layer attention, ``heads`` for intra-layer head
outputs, with ``layer``), ``i``, ``j``, ``value``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from ..checkpoint import load_model
from .capture import capture
from .similarity import head_similarity, layer_similarity, metric_of


def similarity_frame(model, batch: dict, metric: str = "cka", label: dict | None = None) -> pd.DataFrame:
    cap = capture(model, batch)
    rows = []

    def add(matrix: torch.Tensor, kind: str, layer: int | None, name: str):
        for i in range(matrix.shape[0]):
            for j in range(matrix.shape[1]):
                rows.append({**(label or {}), "metric": name, "kind": kind, "layer": layer, "i": i, "j": j,
                             "value": float(matrix[i, j])})

    if metric_of(metric).on_attention_rows:
        add(layer_similarity(cap, "attention", kind="attention"), "attention", None, "js")
        for layer in range(len(cap.attentions)):
            add(head_similarity(cap, layer, "attention", kind="attention"), "heads", layer, "js")
    else:
        add(layer_similarity(cap, metric, kind="features"), "layers", None, metric)
        add(layer_similarity(cap, "cosine", kind="attention"), "attention", None, "cosine")
        for layer in range(len(cap.heads)):
            add(head_similarity(cap, layer, metric, kind="outputs"), "heads", layer, metric)
    return pd.DataFrame(rows)


def snapshots(run_dir: str | Path) -> list[Path]:
    """A run's model snapshots in training order (``train.keep_snapshots``), then its final model."""
    run_dir = Path(run_dir)
    found = sorted((run_dir / "checkpoints" / "snapshots").glob("*-*"))
    if (run_dir / "final_model").is_dir():
        found.append(run_dir / "final_model")
    if not found:
        raise FileNotFoundError(f"{run_dir} has no model snapshots (train with train.keep_snapshots: true)")
    return found


def similarity_over_training(run_dir: str | Path, batch: dict, metric: str = "cka") -> pd.DataFrame:
    frames = []
    for path in snapshots(run_dir):
        phase, _, step = path.name.rpartition("-")
        label = {"snapshot": path.name, "phase": phase or path.name, "step": int(step) if step.isdigit() else -1}
        frames.append(similarity_frame(load_model(path), batch, metric, label))
    return pd.concat(frames, ignore_index=True)


def summary_over_training(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean adjacent-layer similarity and mean within-layer (off-diagonal) head similarity per snapshot."""
    keys = ["snapshot", "phase", "step"]
    layers = frame[(frame.kind == "layers") & (frame.j == frame.i + 1)].groupby(keys, sort=False)["value"].mean()
    heads = frame[(frame.kind == "heads") & (frame.i != frame.j)].groupby(keys, sort=False)["value"].mean()
    return pd.DataFrame({"adjacent_layers": layers, "within_layer_heads": heads}).reset_index()


def matrix_from_frame(frame, kind: str, layer=None) -> torch.Tensor:
    """The i x j matrix of one kind (and layer) from a tidy similarity frame."""
    sub = frame[(frame.kind == kind) & ((frame.layer == layer) if layer is not None else frame.layer.isna())]
    n = int(sub.i.max()) + 1
    m = torch.zeros(n, n, dtype=torch.float64)
    for i, j, v in zip(sub.i, sub.j, sub.value):
        m[int(i), int(j)] = v
    return m
