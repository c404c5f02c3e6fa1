"""LiGO, the learned linear growth operator (Wang et al., ICLR 2023), on the axis engine.

Every parameter of the large model is a linear function of the small model's: in width, each axis
of a tensor is multiplied by an expansion matrix of its space (hidden, heads, KV heads, FFN) and
mode (an output axis by ``B``, an input axis by ``A``), ``W' = B W A^T`` for a matrix; in depth,
block ``l`` of the large model is ``sum_j D[l, j] W'_j`` over the small model's widened blocks.
The hidden space's matrices are shared by every block (the residual stream has one basis); the
heads, KV heads and FFN matrices are each block's own (the paper's Kronecker factorisation: the
operator is a product of a width and a depth map, never the full large x small matrix). The
matrices act on units (a head's ``head_dim`` rows move together), so an expansion never mixes
coordinates inside a head.

Initialised to bert2BERT's FPI in width (``B`` copies each unit to its group, ``A`` copies and
divides by the group size) and to stacking in depth (``D[l, l mod L] = 1``), so before fitting the
operator gives exactly ``stack_layers(grow_width(model, init="split"))``. :func:`fit` then trains
the operator's parameters, the small model frozen, on the large model's loss; the large model is
then materialised and trained as usual.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from ..families import family_of
from .axes import grouping_for, role_info, role_segments
from .mapping import make_plan
from .scheme import Scheme


def _expansion(groups, mode: str) -> torch.Tensor:
    """The (large units x small units) matrix of FPI: 1 (output) or 1/g (input) where a large unit
    is a member of a small unit's group."""
    g = len(groups[0])
    m = torch.zeros(len(groups) * g, len(groups))
    for i, group in enumerate(groups):
        m[list(group), i] = 1.0 if mode == "out" else 1.0 / g
    return m


class LinearGrowth(nn.Module):
    """The learned operator from ``model`` (frozen) to a model ``width`` x wider and ``depth`` x deeper."""

    def __init__(self, model: nn.Module, width: int = 2, depth: int = 2) -> None:
        super().__init__()
        if width < 1 or depth < 1 or (width == 1 and depth == 1):
            raise ValueError(f"LiGO grows by width {width} and depth {depth}: both >= 1, one of them >= 2")
        self.family = family = family_of(model)
        recipe = family.recipe(model)
        small = family.sizes(recipe)
        tied = family.head_tied(model)
        self.small = {n: p.detach() for n, p in model.named_parameters()}
        self.where = {n: family.locate(n, tied) for n in self.small}
        self.spaces = None
        big = small
        if width > 1:
            plan = make_plan(small, Scheme.uniform(heads=small.heads * width, width_factor=width, depth_factor=None),
                             down=False)
            self.spaces, big = plan.width, plan.big
        self.layers_small, self.layers_big = small.layers, small.layers * depth
        self.recipe = family.resize(recipe, big.replace(layers=self.layers_big))
        self.matrices = nn.ParameterDict()
        for space, grouping in (self.spaces or {}).items():
            owners = ["all"] if space == "hidden" else ["all", *map(str, range(small.layers))]
            for owner in owners:
                for mode in ("out", "in"):
                    self.matrices[f"{space}_{mode}_{owner}"] = nn.Parameter(_expansion(grouping.groups, mode))
        stack = torch.zeros(self.layers_big, self.layers_small)
        stack[torch.arange(self.layers_big), torch.arange(self.layers_big) % self.layers_small] = 1.0
        self.depth = nn.Parameter(stack)
        with torch.no_grad():
            self.skeleton = family.instantiate(self.recipe, self.parameters_of_large(), like=model)
        self.skeleton.requires_grad_(False)

    def _widen(self, x: torch.Tensor, roles: tuple, layer: int | None) -> torch.Tensor:
        if self.spaces is None:
            return x
        for d, role in enumerate(roles):
            if role is None:
                continue
            segs = role_segments(role)
            groupings = [grouping_for(self.spaces, s) for s in segs]
            parts = x.split([g.small * g.chunk for g in groupings], d) if len(segs) > 1 else (x,)
            mapped = []
            for part, seg, g in zip(parts, segs, groupings):
                space, mode, _ = role_info(seg)
                owner = "all" if space == "hidden" or layer is None else str(layer)
                m = self.matrices[f"{space}_{mode}_{owner}"]
                units = part.unflatten(d, (g.small, g.chunk)).movedim(d, -1)  # (..., chunk, ..., small units)
                mapped.append((units @ m.T).movedim(-1, d).flatten(d, d + 1))
            x = torch.cat(mapped, d) if len(mapped) > 1 else mapped[0]
        return x

    def parameters_of_large(self) -> dict[str, torch.Tensor]:
        """The large model's parameters under the operator as it stands (differentiable in it)."""
        out, blocks = {}, {}
        for name, x in self.small.items():
            where = self.where[name]
            if where.layer is None:
                out[name] = self._widen(x, where.roles, None)
            else:
                blocks.setdefault(where.rel, {})[where.layer] = self._widen(x, where.roles, where.layer)
        for rel, by_layer in blocks.items():
            stacked = torch.stack([by_layer[j] for j in range(self.layers_small)])  # (small layers, ...)
            mixed = torch.tensordot(self.depth, stacked, dims=1)  # (large layers, ...)
            for i in range(self.layers_big):
                out[self.family.layer_name(i, rel)] = mixed[i]
        return out

    def forward(self, *args, **kwargs):
        """The large model under the current operator (``skeleton``'s modules, these parameters)."""
        return functional_call(self.skeleton, self.parameters_of_large(), args, kwargs)

    def materialise(self) -> nn.Module:
        """The large model as a plain model of its family, its parameters those the operator gives."""
        with torch.no_grad():
            state = {n: t.detach().clone() for n, t in self.parameters_of_large().items()}
        model = self.family.instantiate(self.recipe, state, like=self.skeleton)
        return model.requires_grad_(True)


def fit(operator: LinearGrowth, loss_of, batches, lr: float) -> list[float]:
    """Train the operator's parameters with Adam on ``loss_of(operator, batch)`` for each batch of
    ``batches`` (the small model stays frozen); returns the loss before each step."""
    optimizer = torch.optim.Adam([p for p in operator.parameters() if p.requires_grad], lr=lr)
    operator.skeleton.train()
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(operator, batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses
