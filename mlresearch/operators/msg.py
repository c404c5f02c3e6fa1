"""Masked Structural Growth (MSG; Yao et al., ICLR 2024): grow a model in width and depth so that,
whatever the new weights are, the grown model computes exactly what the old one did, by masking
every new structure with a value ``c`` that a schedule ramps from 0 to 1 while training goes on.

Growth (:func:`masked_growth`): the large model is a freshly initialised one of ``width`` times the
heads, key/value heads, hidden and FFN units and ``depth`` times the layers, with the old model's
tensors written over its entries at the old units' positions (the leading ``1/width`` of every unit
axis: the strided layout de-coalescing uses, so GQA's query heads keep their key/value heads) and in
its first blocks; the new blocks sit on top. Every other entry keeps its random initialisation: the
masks, not the weights, keep the function, so any initialisation would do (an all-zero one would
never learn, its gradients being zero).

Masks (:class:`MaskRamp`, attached with forward hooks, a norm's forward swapped for its masked
one, all removed once ``c`` reaches 1):

- a new head's output, before the attention output projection, and a new FFN neuron's activation,
  before the down projection, are multiplied by ``c``;
- hidden units: every norm (LayerNorm or RMSNorm) takes its statistics with weight ``m_i`` per unit
  (1 on an old unit, ``c`` on a new one), ``mu = sum(m x) / sum(m)``, ``var = sum(m (x - mu)^2) /
  sum(m)``, and its output is multiplied by ``m``. Every read of the residual stream in these families
  goes through a norm (pre-norm: each sublayer and the head; post-norm BERT: the norm that follows
  every residual sum), so at ``c = 0`` the new hidden units' content is never read and the old units'
  statistics are the old model's; at ``c = 1`` the norm is the ordinary one;
- a new block computes ``x + c (block(x) - x)``: the identity at ``c = 0``, pre- and post-norm alike,
  the block itself at ``c = 1``. (MSG's paper masks a post-norm block's sublayers one by one,
  ``c LN(x + f(x)) + (1 - c) x``; this is the same form over the whole block, equal to it at both ends.)

Optimizer (MSG keeps the old parameters' state): Adam's moments are written at the old entries and
are zero on the new ones, ``step`` kept; the parameters of new blocks start without state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer

from ..families import family_of
from .axes import grouping_for, role_info, role_segments
from .mapping import make_plan
from .optim import STATE_KINDS, UnsupportedOptimizerError, check_optimizer
from .scheme import Scheme


def widening(small, width: int):
    """The groupings of a ``width``-times wider model of ``small``'s sizes (None for width 1)."""
    if width == 1:
        return None
    scheme = Scheme.uniform(heads=small.heads * width, width_factor=width, depth_factor=None)
    return make_plan(small, scheme, down=False).width


def _old_positions(segments, width) -> tuple[torch.Tensor, bool]:
    """The large axis's positions of the old units, in the old axis's order, and whether the axis widens."""
    parts, offset, widened = [], 0, False
    for seg in segments:
        g = grouping_for(width, seg)
        widened |= g.size > 1
        first = torch.tensor([group[0] for group in g.groups], dtype=torch.long)
        parts.append(offset + (first[:, None] * g.chunk + torch.arange(g.chunk)).reshape(-1))
        offset += g.big * g.chunk
    return torch.cat(parts), widened


def embed(small: torch.Tensor, roles: tuple, width, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``small`` written at the old units' positions of a tensor shaped ``like``; zero elsewhere.
    Returns (that tensor, the boolean mask of the written entries)."""
    if width is None:
        return small.clone(), torch.ones_like(small, dtype=torch.bool)
    out, mask = small, torch.ones_like(small, dtype=torch.bool)
    for dim, role in enumerate(roles):
        if role is None:
            continue
        where, widened = _old_positions(role_segments(role), width)
        if not widened:
            continue
        shape = list(out.shape)
        shape[dim] = like.shape[dim]
        where = where.to(out.device)
        out = out.new_zeros(shape).index_copy_(dim, where, out)
        mask = mask.new_zeros(shape).index_copy_(dim, where, mask)
    if tuple(out.shape) != tuple(like.shape):
        raise ValueError(f"embedding a {tuple(small.shape)} tensor of roles {roles} gives {tuple(out.shape)}, "
                         f"not the grown model's {tuple(like.shape)}")
    return out, mask


def masked_growth(model: nn.Module, optimizer: Optimizer | None = None, width: int = 2, depth: int = 1,
                  seed: int = 0) -> tuple[nn.Module, Optimizer | None]:
    """The grown model (``width`` x units, ``depth`` x layers; new entries and blocks freshly
    initialised from ``seed``, the global RNG untouched) and, given ``optimizer``, its optimizer with
    the old state kept (see the module docstring). Without its masks the grown model computes
    something else: attach :meth:`MaskRamp.attach` and train with the ramp."""
    for name, f in (("width", width), ("depth", depth)):
        if isinstance(f, bool) or not isinstance(f, int) or f < 1:
            raise ValueError(f"MSG {name} factor must be a whole number >= 1, got {f!r}")
    if width == 1 and depth == 1:
        raise ValueError("MSG with width 1 and depth 1 grows nothing")
    family = family_of(model)
    if optimizer is not None:
        check_optimizer(optimizer, model)
    small = family.sizes(model)
    plan = widening(small, width)
    big = small.replace(heads=small.heads * width, kv_heads=small.kv_heads * width, hidden=small.hidden * width,
                        ffn=small.ffn * width, layers=small.layers * depth)
    recipe = family.resize(family.recipe(model), big)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        grown = family.build(recipe)
    family.tie(grown)
    grown.train(model.training)
    old = dict(model.named_parameters())
    tied = family.head_tied(model)
    source: dict[str, str | None] = {}
    with torch.no_grad():
        for name, param in grown.named_parameters():
            where = family.locate(name, tied)
            if where.layer is not None and where.layer >= small.layers:
                source[name] = None  # a new block: its fresh initialisation throughout
                continue
            source[name] = name
            values, written = embed(old[name].detach(), where.roles, plan, param)
            param.copy_(torch.where(written, values.to(param.dtype), param))
    if optimizer is None:
        return grown, None
    return grown, _carried_optimizer(optimizer, model, grown, family, small.layers, source, plan, tied)


def _carried_optimizer(optimizer, model, grown, family, layers, source, plan, tied) -> Optimizer:
    """A new optimizer of ``optimizer``'s type and groups over ``grown``: each parameter in the
    group of the one it came from (a new block's: the same parameter of the block it stands
    above), the old state written at the old entries, zero elsewhere, ``step`` kept."""
    old = dict(model.named_parameters())
    name_of = {id(p): n for n, p in old.items()}
    group_of = {name_of[id(p)]: gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    members: list[list] = [[] for _ in optimizer.param_groups]
    for name, param in grown.named_parameters():
        where = family.locate(name, tied)
        like = name if source[name] else family.layer_name(where.layer % layers, where.rel)
        if like in group_of:
            members[group_of[like]].append(param)
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=ps)
              for g, ps in zip(optimizer.param_groups, members) if ps]
    carried = type(optimizer)(groups)
    carried.defaults = dict(optimizer.defaults)
    with torch.no_grad():
        for name, param in grown.named_parameters():
            state = optimizer.state.get(old[name]) if source[name] else None
            if not state:
                continue  # a new block, or a parameter not stepped yet: Adam starts it afresh
            roles = family.locate(name, tied).roles
            new_state = {}
            for key, value in state.items():
                if key == "step":
                    new_state[key] = value.clone() if torch.is_tensor(value) else value
                elif key in STATE_KINDS:
                    new_state[key] = None if value is None else embed(value, roles, plan, param)[0]
                else:
                    raise UnsupportedOptimizerError(f"no mapping rule for optimizer state {key!r}")
            carried.state[param] = new_state
    return carried


# ----------------------------------------------------------------------------- the masks
def _masked_norm(module: nn.Module, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """LayerNorm or RMSNorm of ``x`` with unit weights ``m`` in its statistics, its output times ``m``."""
    rms = "RMS" in type(module).__name__
    eps = getattr(module, "eps", None)
    eps = getattr(module, "variance_epsilon", 1e-6) if eps is None else eps
    w = (m / m.sum()).float()
    xf = x.float()
    if rms:
        y = xf * torch.rsqrt((xf.pow(2) * w).sum(-1, keepdim=True) + eps)
    else:
        centred = xf - (xf * w).sum(-1, keepdim=True)
        y = centred * torch.rsqrt((centred.pow(2) * w).sum(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    if getattr(module, "weight", None) is not None:
        y = module.weight * y
    if getattr(module, "bias", None) is not None:
        y = y + module.bias
    return y * m.to(y.dtype)


class _ForwardSwap:
    """``module.forward`` replaced by ``forward`` on the instance; :meth:`remove` puts back what was there."""

    def __init__(self, module: nn.Module, forward) -> None:
        self.module, self.previous = module, module.__dict__.get("forward")
        module.forward = forward

    def remove(self) -> None:
        if self.previous is None:
            del self.module.forward
        else:
            self.module.forward = self.previous


class Masks:
    """The hooks that mask a grown model's new structures; :meth:`set` the mask value, :meth:`remove` them."""

    def __init__(self, model: nn.Module, width: int, layers: int) -> None:
        family = family_of(model)
        sizes = family.sizes(model)
        if sizes.layers % layers or (width > 1 and sizes.hidden % width):
            raise ValueError(f"a {sizes.layers}-layer model is no MSG growth of {layers} layers at width x{width}")
        small = sizes.replace(heads=sizes.heads // width, kv_heads=sizes.kv_heads // width,
                              hidden=sizes.hidden // width, ffn=sizes.ffn // width, layers=layers)
        plan = widening(small, width)
        self.value = 0.0
        self._old: dict[str, torch.Tensor] = {}  # space -> True on old units, along the activation
        if plan is not None:
            for space in ("hidden", "heads", "ffn"):
                where, _ = _old_positions((space,), plan)
                old = torch.zeros(grouping_for(plan, space).big * grouping_for(plan, space).chunk, dtype=torch.bool)
                self._old[space] = old.index_fill_(0, where, True)
        self._cache: dict[tuple, torch.Tensor] = {}
        self._handles = []
        tied = family.head_tied(model)
        modules = dict(model.named_modules())
        for name, param in model.named_parameters():
            where = family.locate(name, tied)
            owner = name.rsplit(".", 1)[0]
            if plan is None or not name.endswith("weight"):
                continue
            segments = [role_info(s)[:2] for r in where.roles if r is not None for s in role_segments(r)]
            if param.dim() == 1 and segments and segments[0][0] == "hidden":
                self._replace_norm(modules[owner])
            elif where.layer is not None and where.layer < layers and ("heads", "in") in segments:
                self._hook_input(modules[owner], "heads")
            elif where.layer is not None and where.layer < layers and ("ffn", "in") in segments:
                self._hook_input(modules[owner], "ffn")
        blocks = modules[family.layers]
        for index in range(layers, sizes.layers):
            self._handles.append(blocks[index].register_forward_hook(self._mix_block, with_kwargs=True))

    def mask(self, space: str, x: torch.Tensor) -> torch.Tensor:
        """1 on the old units of ``space``, the mask value on the new ones, on ``x``'s device and dtype."""
        key = (space, x.device, x.dtype, self.value)
        if key not in self._cache:
            old = self._old[space].to(x.device)
            self._cache = {k: v for k, v in self._cache.items() if k[3] == self.value}
            self._cache[key] = torch.where(old, 1.0, self.value).to(x.dtype)
        return self._cache[key]

    def _replace_norm(self, module) -> None:
        """The masked norm in place of the module's own forward until :meth:`remove` (a forward hook
        would compute the plain norm too, then throw it away)."""
        self._handles.append(_ForwardSwap(module, lambda x, *rest: _masked_norm(module, x, self.mask("hidden", x))))

    def _hook_input(self, module, space: str) -> None:
        self._handles.append(module.register_forward_pre_hook(
            lambda mod, args: (args[0] * self.mask(space, args[0]),) + tuple(args[1:])))

    def _mix_block(self, module, args, kwargs, out):
        x = args[0] if args else kwargs["hidden_states"]
        c = self.value
        if isinstance(out, tuple):
            return (x + c * (out[0] - x),) + out[1:]
        return x + c * (out - x)

    def set(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"a mask value is in [0, 1], got {value}")
        self.value = float(value)

    @contextlib.contextmanager
    def at(self, value: float):
        """The masks at ``value`` for the block's duration, then removed."""
        self.set(value)
        try:
            yield self
        finally:
            self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclass(frozen=True)
class MaskRamp:
    """A training phase's masks: ``c`` rises linearly to 1 over ``steps`` steps (step s trains at
    ``(s + 1) / steps``); the hooks are removed after the last of them."""

    width: int
    layers: int  # the old model's layer count: blocks from this index on are new
    steps: int

    def value(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)

    def attach(self, model: nn.Module) -> Masks:
        return Masks(model, self.width, self.layers)
