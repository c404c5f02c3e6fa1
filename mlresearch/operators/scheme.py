"""Coalescing schemes: which heads (width) and which layers (depth) of the large model merge.

A scheme is plain data and direction-free: ``width[i]`` lists the large model's heads merged
into the small model's head ``i``; ``depth[i]`` lists the large model's layers merged into the
small model's layer ``i``. Coalescing and de-coalescing read the same object.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SchemeError

Groups = tuple[tuple[int, ...], ...]

# Keys of the reference implementation's JSON format (map_tools/config/*.json) that we accept.
_JSON_KEYS = {"width_scheme", "depth_scheme", "ffn_scheme", "reserved_heads", "reserved_layers", "kv_heads"}


def _as_groups(value: Any, what: str) -> Groups | None:
    if value is None:
        return None
    # Integers only: int() would turn 1.7 into 1, True into 1 and "0" into 0 without a word.
    def is_index(i: Any) -> bool:
        return isinstance(i, numbers.Integral) and not isinstance(i, bool)

    if not isinstance(value, (list, tuple)) or not all(
            isinstance(group, (list, tuple)) and all(is_index(i) for i in group) for group in value):
        raise SchemeError(f"{what} must be a list of lists of integers, got {value!r}")
    groups = tuple(tuple(int(i) for i in group) for group in value)
    if not groups or any(len(g) == 0 for g in groups):
        raise SchemeError(f"{what} must be a non-empty list of non-empty groups, got {value!r}")
    return groups


def _check_structure(groups: Groups, what: str, equal_sizes: bool) -> set[int]:
    flat = [i for g in groups for i in g]
    seen, repeated = set(), set()
    for i in flat:
        (repeated if i in seen else seen).add(i)
    if repeated:
        raise SchemeError(f"{what}: indices {sorted(repeated)} appear in more than one group")
    sizes = {len(g) for g in groups}
    if equal_sizes and len(sizes) > 1:
        raise SchemeError(
            f"{what}: groups must all have the same size (got sizes {sorted(sizes)}); "
            "unequal width groups would change LayerNorm/RMSNorm statistics"
        )
    return seen


def check_partition(groups: Groups, n: int, what: str, equal_sizes: bool) -> None:
    """Groups must cover 0..n-1 exactly once (and, for width, all have the same size)."""
    bad = sorted({i for g in groups for i in g if not 0 <= i < n})
    if bad:
        raise SchemeError(f"{what}: indices {bad} are out of range for a model with {n}")
    missing = sorted(set(range(n)) - _check_structure(groups, what, equal_sizes))
    if missing:
        raise SchemeError(f"{what}: indices {missing} of the model's {n} are in no group")


@dataclass(frozen=True)
class Scheme:
    """Which heads and layers merge. ``None`` for an axis means that axis is left alone.

    ``kv_heads`` (optional) is the large model's number of key/value heads (GQA). It is only
    needed to de-coalesce a GQA model whose query/kv ratio changes under the scheme.
    ``ffn`` (optional) groups the FFN neurons explicitly (each group as many neurons as a width
    group has heads); without it the FFN axis follows the heads or the strided pattern.
    """

    width: Groups | None = None
    depth: Groups | None = None
    kv_heads: int | None = None
    ffn: Groups | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "width", _as_groups(self.width, "width scheme"))
        object.__setattr__(self, "depth", _as_groups(self.depth, "depth scheme"))
        object.__setattr__(self, "ffn", _as_groups(self.ffn, "FFN scheme"))
        if self.width is None and self.depth is None:
            raise SchemeError("a scheme needs a width scheme, a depth scheme, or both")
        if self.ffn is not None:
            if self.width is None:
                raise SchemeError("an FFN scheme needs a width scheme (it says how many neurons merge)")
            _check_structure(self.ffn, "FFN scheme", True)
        # Structure only here; whether the indices cover a model's heads/layers is checked
        # against that model when the scheme is applied.
        for groups, what, equal in ((self.width, "width scheme", True), (self.depth, "depth scheme", False)):
            if groups is not None:
                _check_structure(groups, what, equal)

    # ----------------------------------------------------------------- constructors
    @classmethod
    def uniform(
        cls,
        model: Any = None,
        *,
        heads: int | None = None,
        layers: int | None = None,
        width_factor: int | None = 2,
        depth_factor: int | None = 2,
        depth: str = "adjacent",
    ) -> "Scheme":
        """Merge ``width_factor`` heads and ``depth_factor`` layers into one.

        Width: head ``i`` with heads ``i + k*H/f`` (the paper's F_out = [I/f, ..., I/f]^T).
        Depth ``"adjacent"``: layers ``f*i .. f*i+f-1`` (the paper); ``"stack"``: layers
        ``i + k*L/f`` (the reference's shipped L6-H6.json). A factor of ``None`` or 1 leaves
        that axis alone.
        """
        for name, f in (("width_factor", width_factor), ("depth_factor", depth_factor)):
            if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 1):
                raise SchemeError(f"{name} must be a whole number >= 1 (1 or None leaves that axis alone), got {f!r}")
        kv_heads = None
        if model is not None:
            from ..families import family_of

            sizes = family_of(model).sizes(model)
            heads = sizes.heads if heads is None else heads
            layers = sizes.layers if layers is None else layers
            kv_heads = sizes.kv_heads if sizes.kv_heads != sizes.heads else None
        width = depth_groups = None
        if width_factor not in (None, 1):
            if heads is None or heads % width_factor:
                raise SchemeError(f"cannot merge {width_factor} heads into one: the model has {heads} heads")
            n = heads // width_factor
            width = [[i + k * n for k in range(width_factor)] for i in range(n)]
        if depth_factor not in (None, 1):
            if layers is None or layers % depth_factor:
                raise SchemeError(f"cannot merge {depth_factor} layers into one: the model has {layers} layers")
            n = layers // depth_factor
            if depth == "adjacent":
                depth_groups = [[depth_factor * i + k for k in range(depth_factor)] for i in range(n)]
            elif depth == "stack":
                depth_groups = [[i + k * n for k in range(depth_factor)] for i in range(n)]
            else:
                raise SchemeError(f"depth pattern must be 'adjacent' or 'stack', got {depth!r}")
        return cls(width=width, depth=depth_groups, kv_heads=kv_heads)

    @classmethod
    def halving(cls, model: Any = None, *, width: bool = True, depth: str | None = "adjacent", **sizes: int) -> "Scheme":
        """The paper's default: head i with head i+H/2, layers (2i, 2i+1); ``depth="stack"``
        pairs layers (i, i+L/2); ``depth=None`` or ``width=False`` keeps that axis."""
        return cls.uniform(
            model,
            width_factor=2 if width else None,
            depth_factor=2 if depth else None,
            depth=depth or "adjacent",
            **sizes,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Scheme":
        if not isinstance(data, dict):
            raise SchemeError(f"a scheme must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - _JSON_KEYS
        if unknown:
            raise SchemeError(f"unknown scheme keys {sorted(unknown)}; allowed: {sorted(_JSON_KEYS)}")
        for key in ("reserved_heads", "reserved_layers"):
            if data.get(key):
                raise SchemeError(f"{key} is not supported (the reference code ignores it too); leave it empty")
        kv = data.get("kv_heads")
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 1):
            raise SchemeError(f"kv_heads must be a positive integer, got {kv!r}")
        return cls(width=data.get("width_scheme"), depth=data.get("depth_scheme"), kv_heads=kv,
                   ffn=data.get("ffn_scheme"))

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Scheme":
        from ..checkpoint import read_structured

        return cls.from_dict(read_structured(path, "scheme file", SchemeError))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.width is not None:
            out["width_scheme"] = [list(g) for g in self.width]
        if self.depth is not None:
            out["depth_scheme"] = [list(g) for g in self.depth]
        if self.kv_heads is not None:
            out["kv_heads"] = self.kv_heads
        if self.ffn is not None:
            out["ffn_scheme"] = [list(g) for g in self.ffn]
        return out

    def to_json(self, path: str | os.PathLike) -> None:
        from ..checkpoint import atomic_write_text

        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @property
    def width_factor(self) -> int:
        return len(self.width[0]) if self.width else 1
