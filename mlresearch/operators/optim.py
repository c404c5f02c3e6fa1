"""Carry an optimizer across an operator: same type, same hyper-parameters, same parameter
groups, and state mapped with the operator's own :class:`~mlresearch.operators.mapping.Transfer`.

Supported: ``torch.optim.Adam``, ``torch.optim.AdamW`` and ``torch.optim.SGD``. Gradient-like
state (``exp_avg``, ``momentum_buffer``) is mapped like a gradient and squared state
(``exp_avg_sq``, ``max_exp_avg_sq``) like a squared gradient (``how="moment"`` /
``"moment_sq"`` in :func:`mlresearch.operators.axes.map_tensor`); ``step`` is kept.

One step after width growth, with this state, is derived in :func:`step_multipliers`.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim import SGD, Adam, AdamW, Optimizer

from ..errors import UnsupportedModelError
from .axes import grad_factor, grouping_for, role_info, role_segments

SUPPORTED = (Adam, AdamW, SGD)
STATE_KINDS = {"exp_avg": "moment", "momentum_buffer": "moment", "exp_avg_sq": "moment_sq", "max_exp_avg_sq": "moment_sq"}


class UnsupportedOptimizerError(UnsupportedModelError):
    """The optimizer's type (or a state entry of it) has no mapping rule."""


def check_optimizer(optimizer: Optimizer, model: nn.Module) -> None:
    if type(optimizer) not in SUPPORTED:
        raise UnsupportedOptimizerError(
            f"cannot map the state of {type(optimizer).__name__}; supported: "
            + ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED)
        )
    mine = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} parameters that are not the model's; "
                         "pass the optimizer that trains this model")


def _reads(roles: tuple, width) -> int:
    """How many widened copies of each entry the function sums (g for an input axis, else 1)."""
    return math.prod(grouping_for(width, s).size for r in roles if r is not None
                     for s in role_segments(r)[:1] if role_info(s)[1] == "in")


def step_multipliers(transfer, name: str, optimizer: Optimizer) -> dict[str, float]:
    """Hyper-parameter multipliers under which the grown model's next step equals the original's.

    Derivation (width factor g; every activation duplicated; ``c`` = :func:`grad_factor`, the
    gradient scale of the tensor's entries; ``r`` = g if the function sums g copies of each entry
    (the tensor has a widened input axis) else 1). An entry moving by ``d`` moves the function like
    the original entry moving by ``r * d``.

    - SGD, lr ``h``: entries move ``h * c * grad``, the function ``h * c * r * grad``: matrices
      (c = 1/g, r = g) move as before, widened vectors (biases, norms, embeddings; c = 1/g, r = 1)
      by 1/g, input-only tensors (untied head, split final norm; c = 1, r = g) by g. Matching
      needs ``lr * 1 / (c r)``.
    - Adam/AdamW with mapped state (m -> c m, v -> c^2 v): the update is ``m / (sqrt(v) + eps / c)``,
      i.e. the original update with eps scaled by 1/c; the function moves by ``r`` times it.
      Matching needs ``lr / r``, ``eps * c``, and (AdamW's decoupled decay ``lr * wd``)
      ``weight_decay * r``.

    Coupled weight decay (SGD, Adam) is not covered: a non-zero one raises.
    """
    width = transfer.plan.width
    move = transfer.moves[name]
    if width is None or move.new:
        return {}
    c, r = grad_factor(move.roles, width), _reads(move.roles, width)
    if isinstance(optimizer, AdamW):
        return {"lr": 1.0 / r, "eps": c, "weight_decay": float(r)}
    if any(g.get("weight_decay", 0) for g in optimizer.param_groups):
        raise ValueError(f"matching the first step under {type(optimizer).__name__}'s coupled weight decay "
                         "is not supported; use AdamW or weight_decay=0")
    if isinstance(optimizer, Adam):
        return {"lr": 1.0 / r, "eps": c}
    return {"lr": 1.0 / (c * r)}


def map_optimizer(
    optimizer: Optimizer, old_model: nn.Module, new_model: nn.Module, transfer, match_first_step: bool = False
) -> Optimizer:
    """A new optimizer of the same type over ``new_model``, its state mapped by ``transfer``.

    Every new parameter joins the group of the parameter it came from, so groups keep their
    membership, settings and order. With ``match_first_step`` a group is split by the
    multipliers of :func:`step_multipliers`.
    """
    check_optimizer(optimizer, old_model)
    old_params = dict(old_model.named_parameters())
    name_of = {id(p): n for n, p in old_params.items()}
    group_of = {name_of[id(p)]: gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    buckets: dict[tuple, list] = {(gi, ()): [] for gi in range(len(optimizer.param_groups))}
    new_params = dict(new_model.named_parameters())
    for name, param in new_params.items():
        gi = group_of.get(transfer.moves[name].sources[0])
        if gi is None:
            continue  # its source was not being optimised
        mult = tuple(sorted(step_multipliers(transfer, name, optimizer).items())) if match_first_step else ()
        buckets.setdefault((gi, mult), []).append(param)
    groups = []
    for (gi, mult), params in sorted(buckets.items(), key=lambda kv: kv[0][0]):
        if not params and mult == () and any(k[0] == gi and k[1] for k in buckets):
            continue  # every parameter of this group went to a multiplier bucket
        group = {k: v for k, v in optimizer.param_groups[gi].items() if k != "params"}
        for key, m in mult:
            group[key] = group[key] * m
        if mult:
            group["step_multipliers"] = dict(mult)
        groups.append(dict(group, params=params))
    new_optimizer = type(optimizer)(groups)  # every group carries all its settings explicitly
    new_optimizer.defaults = dict(optimizer.defaults)

    with torch.no_grad():
        for name, param in new_params.items():
            move = transfer.moves[name]
            states = [optimizer.state.get(old_params[s]) for s in move.sources]
            if not states[0]:
                continue
            new_state = {}
            for key, value in states[0].items():
                if key == "step":
                    new_state[key] = value.clone() if torch.is_tensor(value) else value
                elif key in STATE_KINDS:
                    if value is None:
                        new_state[key] = None
                        continue
                    old = {s: st[key] for s, st in zip(move.sources, states)}
                    new_state[key] = transfer.tensor(name, old, STATE_KINDS[key])
                else:
                    raise UnsupportedOptimizerError(f"no mapping rule for optimizer state {key!r}")
            new_optimizer.state[param] = new_state
    return new_optimizer


def clear_step_multipliers(optimizer: Optimizer) -> None:
    """Undo ``match_first_step``'s multipliers (call after the first step); groups stay split."""
    for group in optimizer.param_groups:
        for key, m in group.pop("step_multipliers", {}).items():
            group[key] = group[key] / m
