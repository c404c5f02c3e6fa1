"""Interpolation: merge the de-coalesced model into the model it came from.

``merged = (1 - alpha) * model + alpha * other``, parameter by parameter (``torch.lerp``, which
returns either endpoint exactly at alpha 0 and 1).

Adaptive interpolation (our precise definition of the authors' one-line description,
"normalise the parameters of the de-coalesced model to align with those of the original model,
then merge with ratio 0.5"): every tensor ``b`` of ``other`` is rescaled to the norm of the
matching tensor ``a`` of ``model`` before merging with alpha = 0.5 (unless alpha is given):

- ``adaptive="tensor"`` (``True``): ``b * ||a||_F / ||b||_F`` for the whole tensor;
- ``adaptive="row"``: the same for every slice along dim 0 (each output row of an nn.Linear,
  each token of an embedding); 1-D tensors are scaled as a whole.

A zero-norm ``b`` (or slice) is left as it is. Buffers are taken from ``model``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..families import family_of

ADAPTIVE_MODES = ("tensor", "row")


def _rescaled(b: torch.Tensor, a: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "row" and b.dim() >= 2:
        na, nb = a.flatten(1).norm(dim=1), b.flatten(1).norm(dim=1)
        scale = torch.where(nb > 0, na / nb.clamp_min(torch.finfo(nb.dtype).tiny), torch.ones_like(nb))
        return b * scale.view(-1, *([1] * (b.dim() - 1)))
    na, nb = a.norm(), b.norm()
    return b * (na / nb) if nb > 0 else b


def norm_ratios(model: nn.Module, other: nn.Module) -> dict[str, float]:
    """Per parameter, ``||a||_F / ||b||_F`` (``a`` of ``model``, ``b`` of ``other``): the factor by
    which adaptive interpolation rescales ``other``'s tensor as a whole (``inf`` for a zero ``b``,
    which it leaves as it is). Logged by the V-cycle's merge so a reader sees what "adaptive" did."""
    theirs = dict(other.named_parameters())
    ratios = {}
    with torch.no_grad():
        for name, a in model.named_parameters():
            nb = float(theirs[name].norm())
            ratios[name] = float(a.norm()) / nb if nb > 0 else float("inf")
    return ratios


def interpolate(
    model: nn.Module, other: nn.Module, alpha: float | None = None, adaptive: bool | str = False
) -> nn.Module:
    """A new model with ``(1 - alpha) * model + alpha * other``; neither input is modified."""
    mode = "tensor" if adaptive is True else (adaptive or None)
    if mode is not None and mode not in ADAPTIVE_MODES:
        raise ValueError(f"adaptive must be True, False or one of {ADAPTIVE_MODES}, got {adaptive!r}")
    if alpha is None:
        if mode is None:
            raise ValueError("interpolate needs alpha, or adaptive=True (which merges 0.5/0.5)")
        alpha = 0.5
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    family = family_of(model)
    if family_of(other) is not family:
        raise TypeError(f"cannot interpolate a {type(model).__name__} with a {type(other).__name__}")
    mine, theirs = dict(model.named_parameters()), dict(other.named_parameters())
    if mine.keys() != theirs.keys():
        raise ValueError(f"the models have different parameters: {sorted(set(mine) ^ set(theirs))[:5]}")
    bad = [f"{n}: {tuple(p.shape)} vs {tuple(theirs[n].shape)}" for n, p in mine.items() if p.shape != theirs[n].shape]
    if bad:
        raise ValueError(f"incompatible shapes, cannot interpolate: {bad[:5]}")
    state = {}
    with torch.no_grad():
        for name, a in mine.items():
            b = theirs[name].detach().to(a.dtype)
            if mode is not None:
                b = _rescaled(b, a.detach(), mode)
            state[name] = torch.lerp(a.detach(), b, alpha)
    return family.instantiate(family.recipe(model), state, like=model)
