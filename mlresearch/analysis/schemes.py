"""Similarity-guided coalescing schemes: merge the heads, and the runs of adjacent layers, that
already behave alike, instead of the fixed pairing (head i with i+H/2, layers 2i and 2i+1).

- Heads: the similarity of two heads is the linear CKA of their outputs (real tokens as
  examples), averaged over layers and batches (one width scheme serves every layer, because the
  hidden axis is shared). Groups of ``width_factor`` are formed greedily: the most similar free
  pair starts a group, which then takes the free head most similar on average to its members.
- Layers: the similarity of adjacent layers is the CKA of their outputs. Splitting L layers into
  L / depth_factor contiguous groups keeps L - n of the L - 1 adjacent links; the best split cuts
  the n - 1 least similar links (groups may then differ in size, which depth coalescing allows).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SchemeError
from ..families import family_of
from ..operators.scheme import Scheme
from .capture import capture
from .similarity import head_similarity, layer_similarity


def group_greedily(sim: torch.Tensor, size: int) -> list[list[int]]:
    n = sim.shape[0]
    if n % size:
        raise SchemeError(f"cannot split {n} heads into groups of {size}")
    free = set(range(n))
    pairs = sorted(((float(sim[i, j]), i, j) for i in range(n) for j in range(i + 1, n)), reverse=True)
    groups = []
    while free:
        _, i, j = next(p for p in pairs if p[1] in free and p[2] in free) if size > 1 else (0, min(free), None)
        group = [i] if j is None else [i, j]
        free -= set(group)
        while len(group) < size:
            best = max(free, key=lambda k: (sum(float(sim[k, m]) for m in group), -k))
            group.append(best)
            free.discard(best)
        groups.append(sorted(group))
    return sorted(groups)


def contiguous_groups(adjacent: list[float], n_groups: int) -> list[list[int]]:
    """Split layers 0..L-1 into ``n_groups`` runs, cutting the least similar adjacent links."""
    layers = len(adjacent) + 1
    cuts = sorted(sorted(range(len(adjacent)), key=lambda k: (adjacent[k], k))[: n_groups - 1])
    bounds = [0] + [c + 1 for c in cuts] + [layers]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


@torch.no_grad()
def scheme_from_similarity(model: nn.Module, batches: list[dict], width_factor: int | None = 2,
                           depth_factor: int | None = 2, metric: str = "cka") -> Scheme:
    family = family_of(model)
    sizes = family.sizes(model)
    if not batches:
        raise SchemeError("similarity-guided schemes need at least one batch of inputs")
    caps = [capture(model, b) for b in batches]
    width = depth = None
    if width_factor not in (None, 1):
        head = sum(head_similarity(c, layer, metric, kind="outputs") for c in caps for layer in range(sizes.layers))
        width = group_greedily(head / (len(caps) * sizes.layers), width_factor)
    if depth_factor not in (None, 1):
        if sizes.layers % depth_factor:
            raise SchemeError(f"cannot merge {depth_factor} layers into one: the model has {sizes.layers} layers")
        layer = sum(layer_similarity(c, metric) for c in caps) / len(caps)
        adjacent = [float(layer[k, k + 1]) for k in range(sizes.layers - 1)]
        depth = contiguous_groups(adjacent, sizes.layers // depth_factor)
    kv = sizes.kv_heads if sizes.kv_heads != sizes.heads else None
    scheme = Scheme(width=width, depth=depth, kv_heads=kv)
    from ..operators import make_plan

    make_plan(sizes, scheme, down=True)  # e.g. a GQA split that does not fit raises here
    return scheme
