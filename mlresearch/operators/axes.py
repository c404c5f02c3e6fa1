"""The axis engine: width maps as grouped reductions and gathers along named tensor axes.

Every parameter dimension has a *role*: the space it indexes (``hidden``, ``heads``,
``kv_heads``, ``ffn``) and whether the dimension is an *output* of the layer (rows of a
Linear, an embedding's columns, a norm's vector) or an *input* (columns of a Linear).
With ``g`` large units merged into one small unit:

============  =========================  ===========================
mode          coalesce (large -> small)  de-coalesce (small -> large)
============  =========================  ===========================
output        mean over the group        copy to every member
input         sum over the group         copy divided by g (split)
============  =========================  ===========================

A de-coalesced model then sees every small activation duplicated ``g`` times and produces the
same outputs; ``coalesce(decoalesce(x)) == x`` exactly (mean of copies, sum of splits). These are
the reference code's F_out = [I/g ...]^T and T matrices, applied as reductions instead of dense
matrix products: each costs one read and one write of the tensor.

A role may also be a tuple of roles: a fused dimension made of equal-role segments, such as
GPT-2's ``c_attn`` output (q, k, v) or timm's ``qkv``. A role ``"heads:3"`` is the heads space in
units of three head-sized chunks: a fused per-head layout such as GPT-NeoX's ``query_key_value``
(head h's q, k and v rows together).

Each space has its own :class:`Grouping` (see :func:`mlresearch.operators.mapping.make_plan`):
heads as the scheme says, key/value heads as their query heads imply, hidden and FFN by the same
factor on their own, so no axis has to be a multiple of another's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Union

import torch

Role = Union[str, tuple, None]

# role name -> (space, mode)
ROLES: dict[str, tuple[str, str]] = {
    "hidden": ("hidden", "out"),
    "hidden_in": ("hidden", "in"),
    "heads": ("heads", "out"),
    "heads_in": ("heads", "in"),
    "kv_heads": ("kv_heads", "out"),
    "ffn": ("ffn", "out"),
    "ffn_in": ("ffn", "in"),
}


def role_info(segment: str) -> tuple[str, str, int]:
    """(space, mode, units per chunk) of a single role such as ``"ffn_in"`` or ``"heads:3"``."""
    base, _, mult = segment.partition(":")
    space, mode = ROLES[base]
    return space, mode, int(mult or 1)


def grouping_for(width: dict[str, "Grouping"], segment: str) -> "Grouping":
    space, _, mult = role_info(segment)
    return width[space] if mult == 1 else width[space].scaled(mult)


@dataclass(frozen=True)
class Grouping:
    """``groups[i]`` are the large-model units merged into small unit ``i``; each unit is
    ``chunk`` consecutive entries of the axis (a head's ``head_dim`` rows, say)."""

    groups: tuple[tuple[int, ...], ...]
    chunk: int

    @property
    def small(self) -> int:
        return len(self.groups)

    def scaled(self, mult: int) -> "Grouping":
        """The same groups over units ``mult`` times as long (fused per-unit layouts)."""
        return Grouping(self.groups, self.chunk * mult)

    @classmethod
    def strided(cls, n: int, factor: int) -> "Grouping":
        """Unit ``i`` with units ``i + k*n/factor`` over ``n`` single entries (the paper's
        "neuron i with neuron i + d/2", for any factor)."""
        small = n // factor
        return cls(tuple(tuple(i + k * small for k in range(factor)) for i in range(small)), 1)

    @property
    def size(self) -> int:
        return len(self.groups[0])

    @property
    def big(self) -> int:
        return self.small * self.size

    @cached_property
    def is_strided(self) -> bool:
        """True for the paper's pattern (unit i with i + k*small): a reshape, no gather."""
        return all(g[k] == i + k * self.small for i, g in enumerate(self.groups) for k in range(self.size))

    @cached_property
    def gather_index(self) -> torch.Tensor:
        """Large-axis positions ordered (member k, small unit i, offset t)."""
        members = torch.tensor(self.groups, dtype=torch.long).T  # (size, small)
        idx = members[..., None] * self.chunk + torch.arange(self.chunk)
        return idx.reshape(-1)

    @cached_property
    def scatter_index(self) -> torch.Tensor:
        """For every large-axis position, the small-axis position it copies."""
        owner = torch.empty(self.big, dtype=torch.long)
        for i, group in enumerate(self.groups):
            owner[list(group)] = i
        return (owner[:, None] * self.chunk + torch.arange(self.chunk)).reshape(-1)

    @cached_property
    def member_index(self) -> torch.Tensor:
        """For every large-axis position, which member of its group it is (0..size-1)."""
        member = torch.empty(self.big, dtype=torch.long)
        for group in self.groups:
            member[list(group)] = torch.arange(self.size)
        return member.repeat_interleave(self.chunk)

    def reduce(self, x: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
        """Large -> small along ``dim``: mean (output mode) or sum (input mode) of each group."""
        if self.size == 1 and self.is_strided:
            return x
        if not self.is_strided:
            x = x.index_select(dim, self.gather_index.to(x.device))
        x = x.unflatten(dim, (self.size, self.small * self.chunk))
        return x.mean(dim) if mode == "out" else x.sum(dim)

    def expand(self, x: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
        """Small -> large along ``dim``: copy (output mode) or copy / g (input mode)."""
        if mode == "in" and self.size > 1:
            x = x * (1.0 / self.size)
        if self.size == 1 and self.is_strided:
            return x.clone() if mode == "out" else x
        if self.is_strided:
            return torch.cat([x] * self.size, dim)
        return x.index_select(dim, self.scatter_index.to(x.device))


def role_segments(role: Role) -> tuple:
    return role if isinstance(role, tuple) else (role,)


def _modes(roles: tuple[Role, ...]) -> set[str]:
    return {role_info(s)[1] for r in roles if r is not None for s in role_segments(r)}


def grad_factor(roles: tuple[Role, ...], width: dict[str, Grouping]) -> float:
    """How a gradient scales from a small tensor to each entry of its widened copy.

    With every activation duplicated g times and consumed through split inputs, each copy of an
    activation receives 1/g of the original gradient; a tensor that writes such an activation
    (it has an output-mode axis) therefore gets 1/g of the original gradient in every entry,
    the zero off-diagonal blocks of a block-diagonal matrix included. A tensor with only
    input-mode axes (an untied head, the split norm before a tied head) writes a non-duplicated
    result and gets the full gradient. Untouched tensors get the full gradient too.
    """
    sizes = [grouping_for(width, s).size for r in roles if r is not None for s in role_segments(r) if role_info(s)[1] == "out"]
    return 1.0 / sizes[0] if sizes else 1.0


def new_units_mask(roles: tuple[Role, ...], width: dict[str, Grouping], shape) -> torch.Tensor:
    """True at every entry of a widened tensor that belongs to a new output unit (a group's member
    1.. g-1; member 0 is the unit's original position), False elsewhere, broadcast to ``shape``.
    Input axes mark nothing: an entry reading a new unit is still written by an original one."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for d, role in enumerate(roles):
        if role is None:
            continue
        parts, marked = [], False
        for seg in role_segments(role):
            g, mode = grouping_for(width, seg), role_info(seg)[1]
            members = g.member_index
            marked |= mode == "out" and g.size > 1
            parts.append(members > 0 if mode == "out" else torch.zeros_like(members, dtype=torch.bool))
        if not marked:
            continue
        axis = torch.cat(parts)
        if axis.numel() != shape[d]:
            raise ValueError(f"axis {d} has size {shape[d]}, but its role {role!r} implies {axis.numel()}")
        view = [1] * len(shape)
        view[d] = -1
        mask |= axis.view(view)
    return mask


HOWS = ("split", "block", "moment", "moment_sq")


def _strided_fast_path(x, roles, width, down, how):
    """All grouped axes single-segment and strided (the paper's pattern): one reshape-reduce or
    one ``repeat`` for the whole tensor, with the scaling applied to the small side."""
    if how == "block":
        return None
    if any(isinstance(r, tuple) for r in roles):
        return None
    dims = [(d, grouping_for(width, r), role_info(r)[1]) for d, r in enumerate(roles) if r is not None]
    if not dims or not all(g.is_strided for _, g, _ in dims):
        return None
    scale = 1.0
    for d, g, mode in dims:
        if g.chunk * (g.big if down else g.small) != x.shape[d]:
            return None  # let the general path raise its clear error
        if not how.startswith("moment") and mode == "out" and down:
            scale /= g.size
        if not how.startswith("moment") and mode == "in" and not down:
            scale /= g.size
    if how.startswith("moment"):
        factor = grad_factor(roles, width) ** (2 if how == "moment_sq" else 1)
        scale = 1.0 / factor if down else factor
        if down:
            scale /= math.prod(g.size for _, g, _ in dims)
    if down:  # one accumulation over every block of the strided grid: a single read of x
        blocks = [x]
        for d, grouping, _ in dims:
            g, n = grouping.size, x.shape[d] // grouping.size
            blocks = [b.narrow(d, k * n, n) for b in blocks for k in range(g)]
        y = blocks[0].clone() if len(blocks) == 1 else torch.add(blocks[0], blocks[1])
        for b in blocks[2:]:
            y += b
        return y.mul_(scale) if scale != 1.0 else y
    # Up: write the scaled, repeated tensor in one pass through a broadcast view.
    split_shape, src_shape, out_shape = [], [], []
    for d, n in enumerate(x.shape):
        g = grouping_for(width, roles[d]).size if roles[d] is not None else 1
        split_shape += [g, n]
        src_shape += [1, n]
        out_shape.append(g * n)
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    torch.mul(x.reshape(src_shape).expand(split_shape), scale, out=out.view(split_shape))
    return out


def map_tensor(
    x: torch.Tensor,
    roles: tuple[Role, ...],
    width: dict[str, Grouping],
    down: bool,
    name: str = "?",
    how: str = "split",
) -> torch.Tensor:
    """Apply the width map to every dimension of ``x`` according to its role.

    ``how`` says what ``x`` is:

    - ``"split"``: a parameter, mapped as in the module docstring (de-coalescing, coalescing);
    - ``"block"``: a parameter widened the staged-training way: a matrix with both an output and
      an input axis becomes block-diagonal (copies on the diagonal blocks, zeros elsewhere);
      other tensors as ``"split"``. Coalescing a block-diagonal matrix is not defined (``down``
      must be False);
    - ``"moment"`` / ``"moment_sq"``: a gradient-like optimizer state (Adam ``exp_avg``, SGD
      momentum) or its square (``exp_avg_sq``): copied along every axis and scaled by
      :func:`grad_factor` (squared), so the state equals what the widened model's gradients
      would have accumulated. Going down is the exact inverse: the mean of the copies, divided
      by the factor.
    """
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, got {how!r}")
    if len(roles) != x.dim():
        raise ValueError(f"parameter {name}: spec gives {len(roles)} axes, tensor has shape {tuple(x.shape)}")
    moment = how.startswith("moment")
    block = how == "block" and {"in", "out"} <= _modes(roles)
    if how == "block" and down:
        raise ValueError("block-diagonal widening has no coalescing inverse")
    fused = [d for d, r in enumerate(roles) if isinstance(r, tuple) and len(set(r)) == 1]
    if fused and x.shape[fused[0]] % len(roles[fused[0]]) == 0:
        # k equal segments (q, k, v) = one more untouched axis of size k in front of the role.
        d, k = fused[0], len(roles[fused[0]])
        y = map_tensor(x.unflatten(d, (k, -1)), roles[:d] + (None, roles[d][0]) + roles[d + 1:],
                       width, down, name, how)
        return y.flatten(d, d + 1)
    fast = _strided_fast_path(x, roles, width, down, how)
    if fast is not None:
        return fast
    order = [d for d, r in enumerate(roles) if r is not None]
    if not down:
        order.sort(key=lambda d: role_info(role_segments(roles[d])[0])[1] != "in")
    members = {}
    for dim in order:
        role = roles[dim]
        segs = role_segments(role)
        groupings = [(grouping_for(width, s), "out" if (moment or block) else role_info(s)[1]) for s in segs]
        have = x.shape[dim]
        per_seg = [(g.big if down else g.small) * g.chunk for g, _ in groupings]
        if sum(per_seg) != have:
            raise ValueError(
                f"parameter {name}: axis {dim} has size {have}, but its role {role!r} implies {sum(per_seg)}"
            )
        parts = x.split(per_seg, dim) if len(segs) > 1 else (x,)
        mapped = [
            (g.reduce(p, dim, mode) if down else g.expand(p, dim, mode)) for p, (g, mode) in zip(parts, groupings)
        ]
        x = torch.cat(mapped, dim) if len(mapped) > 1 else mapped[0]
        if block:
            members[dim] = torch.cat([g.member_index for g, _ in groupings])
    if block:
        (d0, m0), (d1, m1) = members.items()
        shape0, shape1 = [1] * x.dim(), [1] * x.dim()
        shape0[d0], shape1[d1] = -1, -1
        x = x * (m0.view(shape0) == m1.view(shape1)).to(device=x.device, dtype=x.dtype)  # (GPU, meta too)
    if moment:
        factor = grad_factor(roles, width) ** (2 if how == "moment_sq" else 1)
        if factor != 1.0:
            x = x * (1.0 / factor if down else factor)
    return x
