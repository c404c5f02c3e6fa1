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
GPT-2's ``c_attn`` output (q, k, v) or timm's ``qkv``.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Grouping:
    """``groups[i]`` are the large-model units merged into small unit ``i``; each unit is
    ``chunk`` consecutive entries of the axis (a head's ``head_dim`` rows, say)."""

    groups: tuple[tuple[int, ...], ...]
    chunk: int

    @property
    def small(self) -> int:
        return len(self.groups)

    @property
    def size(self) -> int:
        return len(self.groups[0])

    @property
    def big(self) -> int:
        return self.small * self.size

    @cached_property
    def strided(self) -> bool:
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

    def reduce(self, x: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
        """Large -> small along ``dim``: mean (output mode) or sum (input mode) of each group."""
        if self.size == 1 and self.strided:
            return x
        if not self.strided:
            x = x.index_select(dim, self.gather_index.to(x.device))
        x = x.unflatten(dim, (self.size, self.small * self.chunk))
        return x.mean(dim) if mode == "out" else x.sum(dim)

    def expand(self, x: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
        """Small -> large along ``dim``: copy (output mode) or copy / g (input mode)."""
        if mode == "in" and self.size > 1:
            x = x * (1.0 / self.size)
        if self.size == 1 and self.strided:
            return x.clone() if mode == "out" else x
        if self.strided:
            return torch.cat([x] * self.size, dim)
        return x.index_select(dim, self.scatter_index.to(x.device))


def _segments(role: Role) -> tuple:
    return role if isinstance(role, tuple) else (role,)


def map_tensor(
    x: torch.Tensor, roles: tuple[Role, ...], width: dict[str, Grouping], down: bool, name: str = "?"
) -> torch.Tensor:
    """Apply the width map to every dimension of ``x`` according to its role.

    When expanding, input-mode dimensions go first so that their 1/g scaling touches the
    smaller tensor.
    """
    if len(roles) != x.dim():
        raise ValueError(f"parameter {name}: spec gives {len(roles)} axes, tensor has shape {tuple(x.shape)}")
    order = [d for d, r in enumerate(roles) if r is not None]
    if not down:
        order.sort(key=lambda d: ROLES[_segments(roles[d])[0]][1] != "in")
    for dim in order:
        role = roles[dim]
        segs = _segments(role)
        groupings = [(width[ROLES[s][0]], ROLES[s][1]) for s in segs]
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
    return x
