"""Coalescing and de-coalescing (Zou et al., ICLR 2024) on top of the axis engine.

Width: every width space gets its own grouping by the scheme's factor g. Heads as the scheme
says; GQA key/value heads in the groups their query heads imply; the hidden and FFN axes in the
head groups over H equal chunks when H divides them (the paper's "same pattern over equal
chunks"; for the strided halving scheme this is "neuron i with neuron i + d/2"), otherwise on
their own in the strided pattern of factor g, or in the FFN groups a scheme gives explicitly. Depth: small layer i is the mean of the
large layers in ``depth[i]``; de-coalescing copies it back to each of them. Width and depth act on
different axes and commute; we apply width, then depth.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import reduce

import torch
from torch import nn

from ..errors import SchemeError
from ..families import Sizes, family_of
from .axes import Grouping, map_tensor, new_units_mask
from .scheme import Groups, Scheme, check_partition


@dataclass(frozen=True)
class Plan:
    big: Sizes
    small: Sizes
    width: dict[str, Grouping] | None
    depth: Groups | None


def _kv_groups(big: Sizes, groups: Groups) -> Groups:
    """Key/value head groups implied by query head groups (HF's repeat_kv layout).

    Small query head i must share one small kv head with the large query heads it merges;
    kv heads linked through any merged query head merge together. Those components must be
    contiguous runs of equal length over the small query heads, and of equal size.
    """
    if big.kv_heads == big.heads:
        return groups
    if big.heads % big.kv_heads:
        raise SchemeError(f"{big.heads} query heads are not a multiple of {big.kv_heads} key/value heads")
    ratio = big.heads // big.kv_heads
    parent = list(range(big.kv_heads))

    def find(k: int) -> int:
        while parent[k] != k:
            k = parent[k]
        return k

    kv_of_small = [sorted({h // ratio for h in g}) for g in groups]
    for kvs in kv_of_small:
        for k in kvs[1:]:
            parent[find(k)] = find(kvs[0])
    order: dict[int, int] = {}
    small_kv = [order.setdefault(find(kvs[0]), len(order)) for kvs in kv_of_small]
    n_small_kv = len(order)
    per = len(groups) // n_small_kv
    members = [sorted(k for k in range(big.kv_heads) if order.get(find(k)) == c) for c in range(n_small_kv)]
    if len(groups) % n_small_kv or small_kv != [i // per for i in range(len(groups))] or len({len(m) for m in members}) != 1:
        raise SchemeError(
            f"width scheme {list(map(list, groups))} would split the model's {big.kv_heads} key/value heads "
            f"inconsistently (query heads per kv head: {ratio}); merged query heads must map to one kv head "
            "each, in contiguous runs of equal length"
        )
    return tuple(tuple(m) for m in members)


def _axis_grouping(what: str, n: int, head_groups: Groups, explicit: Groups | None) -> Grouping:
    """The grouping of a hidden or FFN axis of size ``n`` (see the module docstring)."""
    g, heads = len(head_groups[0]), len(head_groups) * len(head_groups[0])
    if explicit is not None:
        check_partition(explicit, n, f"{what} scheme", equal_sizes=True)
        if len(explicit[0]) != g:
            raise SchemeError(f"{what} scheme merges {len(explicit[0])} units into one, the width scheme {g}")
        return Grouping(explicit, 1)
    if n % heads == 0:
        return Grouping(head_groups, n // heads)
    if n % g:
        raise SchemeError(f"{what} {n} is not divisible by the width factor {g}")
    return Grouping.strided(n, g)


def _large_sizes(small: Sizes, scheme: Scheme) -> Sizes:
    """The size of the model a scheme de-coalesces ``small`` into."""
    sizes = small
    if scheme.width is not None:
        if len(scheme.width) != small.heads:
            raise SchemeError(f"width scheme has {len(scheme.width)} groups but the model has {small.heads} heads")
        g = scheme.width_factor
        kv = scheme.kv_heads if scheme.kv_heads is not None else small.kv_heads * g
        sizes = sizes.replace(heads=small.heads * g, hidden=small.hidden * g, ffn=small.ffn * g, kv_heads=kv)
    if scheme.depth is not None:
        if len(scheme.depth) != small.layers:
            raise SchemeError(f"depth scheme has {len(scheme.depth)} groups but the model has {small.layers} layers")
        sizes = sizes.replace(layers=sum(map(len, scheme.depth)))
    return sizes


def make_plan(sizes: Sizes, scheme: Scheme, down: bool) -> Plan:
    """Check ``scheme`` against a model of ``sizes`` and work out both ends of the map."""
    if not isinstance(scheme, Scheme):
        raise TypeError(f"expected a Scheme, got {type(scheme).__name__}")
    big = sizes if down else _large_sizes(sizes, scheme)
    small, width = big, None
    if scheme.width is not None:
        groups = scheme.width
        check_partition(groups, big.heads, "width scheme (heads)", equal_sizes=True)
        g = len(groups[0])
        if scheme.kv_heads is not None and scheme.kv_heads != big.kv_heads:
            raise SchemeError(f"scheme says the large model has {scheme.kv_heads} kv heads, it has {big.kv_heads}")
        kv = _kv_groups(big, groups)
        width = {
            "heads": Grouping(groups, big.head_dim),
            "hidden": _axis_grouping("hidden size", big.hidden, groups, None),
            "ffn": _axis_grouping("FFN size", big.ffn, groups, scheme.ffn),
            "kv_heads": Grouping(kv, big.head_dim),
        }
        small = small.replace(heads=len(groups), hidden=big.hidden // g, ffn=big.ffn // g, kv_heads=len(kv))
    if scheme.depth is not None:
        check_partition(scheme.depth, big.layers, "depth scheme (layers)", equal_sizes=False)
        small = small.replace(layers=len(scheme.depth))
    if not down and small != sizes:
        raise SchemeError(
            f"the scheme maps a model of {big} to {small}, not to this model's {sizes}; "
            "for GQA set the scheme's kv_heads to the large model's key/value head count"
        )
    return Plan(big, small, width, scheme.depth)


@dataclass(frozen=True)
class Move:
    """Where one parameter of the new model comes from."""

    sources: tuple[str, ...]  # old parameter names (averaged when several: depth coalescing)
    roles: tuple  # axis roles, for the width map
    new: bool = False  # a parameter of an identity-initialised new block (its moments start at 0)
    zero: bool = False  # a residual writer of such a block
    upper: bool = False  # bert2BERT's AKI: sources are (this layer, the layer above); the widened
    # tensor keeps this layer's entries on every original unit and takes the layer above's on the new ones


@dataclass
class Transfer:
    """The whole map from an old model to a new one, reusable for any per-parameter tensor
    (the parameters themselves, gradients, optimizer moments)."""

    family: object
    recipe: object  # the new model's recipe
    plan: Plan
    down: bool
    width_init: str  # "split" (de-coalescing) or "block" (staged-training width growth)
    moves: dict[str, Move]

    def tensor(self, name: str, old: dict[str, torch.Tensor], kind: str = "param") -> torch.Tensor:
        """The new model's ``name`` tensor of ``kind`` ("param", "moment", "moment_sq")."""
        move = self.moves[name]
        how = self.width_init if kind == "param" else kind
        mapped = []
        for source in move.sources:
            t = old[source].detach()
            if self.plan.width is not None:
                t = map_tensor(t, move.roles, self.plan.width, self.down, source, how)
            mapped.append(t)
        if move.upper:
            t = torch.where(new_units_mask(move.roles, self.plan.width, mapped[0].shape).to(mapped[0].device),
                            mapped[1], mapped[0])
        else:
            t = mapped[0] if len(mapped) == 1 else reduce(torch.add, mapped) / len(mapped)
        if move.zero or (move.new and kind != "param"):
            return torch.zeros_like(t)
        if any(t.data_ptr() == old[s].data_ptr() for s in move.sources):
            t = t.clone()
        return t

    def build(self, old_model: nn.Module) -> nn.Module:
        old = dict(old_model.named_parameters())
        with torch.no_grad():
            state = {name: self.tensor(name, old) for name in self.moves}
        return self.family.instantiate(self.recipe, state, like=old_model)


def plan_transfer(
    model: nn.Module,
    scheme: Scheme,
    down: bool,
    width_init: str = "split",
    identity_layers: frozenset[int] = frozenset(),
    upper_units: bool = False,
) -> Transfer:
    """Work out, for every parameter of the mapped model, its sources and axis roles.

    ``identity_layers`` (going up only) are new layers whose residual writers start at zero.
    ``upper_units`` (widening only, bert2BERT's advanced knowledge initialisation): the new output
    units of every block but the top one are taken from the block above it instead of copied from
    its own (:class:`Move` ``upper``); the top block and everything outside the blocks widen as usual.
    """
    if upper_units and (down or scheme.depth is not None or scheme.width is None):
        raise SchemeError("upper_units is a widening of the width alone (no coalescing, no depth map)")
    family = family_of(model)
    recipe = family.recipe(model)
    plan = make_plan(family.sizes(recipe), scheme, down)
    tied = family.head_tied(model)
    moves: dict[str, Move] = {}
    blocks: dict[int, dict[str, tuple]] = defaultdict(dict)
    for name, _ in model.named_parameters():
        where = family.locate(name, tied)
        if where.layer is None:
            moves[name] = Move((name,), where.roles)
        else:
            blocks[where.layer][where.rel] = where.roles
    if plan.depth is None:
        layer_sources = {i: (i,) for i in blocks}
    elif down:
        layer_sources = {i: tuple(group) for i, group in enumerate(plan.depth)}
    else:
        layer_sources = {j: (i,) for i, group in enumerate(plan.depth) for j in group}
    for new_layer, old_layers in sorted(layer_sources.items()):
        zero_here = new_layer in identity_layers
        for rel, roles in blocks[old_layers[0]].items():
            sources = tuple(family.layer_name(i, rel) for i in old_layers)
            zero = zero_here and family.writes_residual(rel)
            if upper_units and new_layer + 1 in blocks:
                sources += (family.layer_name(new_layer + 1, rel),)
            moves[family.layer_name(new_layer, rel)] = Move(sources, roles, zero_here, zero,
                                                            upper=upper_units and len(sources) == 2)
    target = plan.small if down else plan.big
    return Transfer(family, family.resize(recipe, target), plan, down, width_init, moves)


def coalesce(model: nn.Module, scheme: Scheme) -> nn.Module:
    """A new, smaller native model: merged heads/neurons (width) and layers (depth).

    Outputs of a layer are averaged over each group, inputs summed; ``model`` is not modified.
    """
    return plan_transfer(model, scheme, down=True).build(model)


def decoalesce(model: nn.Module, scheme: Scheme) -> nn.Module:
    """Map a coalesced model back to the size ``scheme`` came from.

    Outputs are copied to every group member and inputs split evenly, so width de-coalescing
    preserves the function exactly (also with a tied head); depth de-coalescing copies layers.
    ``coalesce(decoalesce(m, s), s)`` returns ``m``'s parameters.
    """
    return plan_transfer(model, scheme, down=False).build(model)
