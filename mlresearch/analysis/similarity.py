"""Similarity matrices: between layers (inter-layer) and between heads or neurons (intra-layer)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from ..families import family_of
from .capture import Capture
from .metrics import cosine, js_divergence, linear_cka, pairwise


@dataclass(frozen=True)
class Metric:
    """One way to compare representations, by its name (``--metric``): ``compare(a, b)``, a similarity of
    two (examples, features) matrices; or, ``on_attention_rows``, attention maps compared row by row
    (the Jensen-Shannon divergence of real query tokens' attention: a distance, for attention only)."""

    name: str
    compare: Callable | None = None
    on_attention_rows: bool = False


METRICS = {m.name: m for m in (
    Metric("cka", linear_cka),
    Metric("cka-unbiased", partial(linear_cka, unbiased=True)),
    Metric("cosine", cosine),
    Metric("attention", on_attention_rows=True),
)}


def metric_of(name: "str | Metric") -> Metric:
    """The metric called ``name`` (a :class:`Metric` is its own)."""
    if isinstance(name, Metric):
        return name
    if name not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {name!r}")
    return METRICS[name]


def _tokens(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) -> (real tokens, features): every real token is one example."""
    return x[mask].reshape(int(mask.sum()), -1)


def _compare(metric: "str | Metric"):
    m = metric_of(metric)
    if m.on_attention_rows:
        raise ValueError(f"metric {m.name!r} compares attention maps row by row: use it with kind='attention'")
    return m.compare


def layer_similarity(cap: Capture, metric: str = "cka", kind: str = "features") -> torch.Tensor:
    """L x L matrix. ``kind="features"``: the residual stream after each block (tokens as
    examples for CKA). ``kind="attention"``: each layer's attention maps, compared head by head
    (cosine of the flattened maps, or ``metric="attention"``: mean Jensen-Shannon divergence of
    the attention rows of real query tokens, a distance)."""
    if kind == "features":
        items = [_tokens(h, cap.mask) for h in cap.hidden]
        return pairwise(items, _compare(metric))
    if kind != "attention":
        raise ValueError(f"kind must be 'features' or 'attention', got {kind!r}")
    if metric_of(metric).on_attention_rows:
        rows = cap.mask[:, None, :]
        return pairwise(cap.attentions, lambda a, b: js_divergence(a, b, rows))
    items = [a.permute(0, 2, 1, 3)[cap.mask] for a in cap.attentions]  # (tokens, H, T)
    return pairwise(items, _compare(metric))


def head_similarity(cap: Capture, layer: int, metric: str = "cosine", kind: str = "attention") -> torch.Tensor:
    """H x H matrix within one layer: heads' attention maps, or (``kind="outputs"``) their outputs."""
    if kind == "attention":
        maps = [cap.attentions[layer][:, h] for h in range(cap.attentions[layer].shape[1])]
        if metric_of(metric).on_attention_rows:
            return pairwise(maps, lambda a, b: js_divergence(a, b, cap.mask))
        return pairwise([m[cap.mask] for m in maps], _compare(metric))
    if kind == "outputs":
        heads = cap.heads[layer]
        return pairwise([_tokens(heads[:, :, h], cap.mask) for h in range(heads.shape[2])], _compare(metric))
    raise ValueError(f"kind must be 'attention' or 'outputs', got {kind!r}")


@torch.no_grad()
def neuron_similarity(model: nn.Module) -> list[dict]:
    """Per layer: the distribution of each FFN neuron's highest cosine similarity to another neuron
    of the same layer, over its input weights (every tensor with an FFN output axis, concatenated)."""
    family = family_of(model)
    tied = family.head_tied(model)
    per_layer: dict[int, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        where = family.locate(name, tied)
        if where.layer is None or "ffn" not in where.roles or p.dim() < 2:
            continue
        axis = where.roles.index("ffn")
        per_layer.setdefault(where.layer, []).append(p.detach().movedim(axis, 0).reshape(p.shape[axis], -1))
    out = []
    for layer in sorted(per_layer):
        w = torch.cat(per_layer[layer], dim=1).double()
        w = w / w.norm(dim=1, keepdim=True).clamp_min(1e-12)
        sim = w @ w.T
        sim.fill_diagonal_(-math.inf)
        best = sim.max(dim=1).values
        q = torch.quantile(best, torch.tensor([0.1, 0.5, 0.9], dtype=best.dtype))
        out.append({"layer": layer, "neurons": len(best), "mean_max_cos": float(best.mean()),
                    "p10": float(q[0]), "median": float(q[1]), "p90": float(q[2]), "max": float(best.max())})
    return out


__all__ = ["METRICS", "Metric", "head_similarity", "layer_similarity", "metric_of", "neuron_similarity"]
