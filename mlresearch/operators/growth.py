"""Staged-training growth operators (Shen et al., ICML 2022) on the same axis engine.

Width growth is de-coalescing under the strided scheme (large head ``i + k*H`` copies small head
``i``), with the staged-training initialisation by default: every matrix that reads and writes
widened axes becomes block-diagonal (``init="block"``); ``init="split"`` gives the de-coalescing
initialisation (rows copied, columns divided by the factor). Both preserve the function exactly.

Depth growth is depth de-coalescing with the ``alternate`` (2i, 2i+1) or ``append`` (i, i+L)
pattern; with ``init="identity"`` the residual writers (attention output and MLP down projection,
weights and biases) of every new block are zero, which makes a pre-norm block ``x + f(norm(x))``
the identity. A post-norm block (BERT: ``LN(x + f(x))``) still re-normalises ``x``, so identity
growth is not loss-preserving there; neither is ``init="copy"`` anywhere. Those cases raise a
:class:`NotLossPreservingWarning`.

Gradients right after width growth (every activation duplicated ``g`` times): a tensor with a
widened output axis receives ``1/g`` of the original gradient in every entry, including the zero
off-diagonal blocks of a block-diagonal matrix (they see the same inputs and output gradients as
the diagonal blocks); a tensor with only input axes (untied head, the halved final norm in front
of a tied head) receives the full gradient. Optimizer moments are mapped the same way (see
:func:`mlresearch.operators.optim.map_optimizer`): ``exp_avg`` like the gradient, ``exp_avg_sq``
like its square (1/4 for g = 2), ``step`` kept; new identity blocks start from zero moments.
"""

from __future__ import annotations

import warnings

from torch import nn
from torch.optim import Optimizer

from ..families import family_of
from .mapping import Transfer, plan_transfer
from .optim import check_optimizer, map_optimizer
from .scheme import Scheme


class NotLossPreservingWarning(UserWarning):
    """A growth operator was applied in a form that changes the model's function."""


WIDTH_INITS = ("block", "split", "aki")


def width_growth(model: nn.Module, factor: int = 2, init: str = "block") -> Transfer:
    """The transfer that widens ``model`` by ``factor`` (heads, hidden and FFN; head_dim kept).

    ``init``: ``"block"`` (staged training's block-diagonal matrices), ``"split"`` (de-coalescing,
    which is also bert2BERT's function-preserving initialisation, FPI: every unit copied ``factor``
    times, the inputs reading it divided by ``factor``; uniform copies keep LayerNorm's mean and
    variance, so the function is kept exactly), or ``"aki"`` (bert2BERT's advanced knowledge
    initialisation: FPI, except that in every block below the top one the new output units are the
    block above's, so the widened model computes something else).
    """
    if not isinstance(factor, int) or factor < 2:
        raise ValueError(f"growth factor must be an integer >= 2, got {factor!r}")
    if init not in WIDTH_INITS:
        raise ValueError(f"width init must be one of {', '.join(WIDTH_INITS)}, got {init!r}")
    sizes = family_of(model).sizes(model)
    scheme = Scheme.uniform(heads=sizes.heads * factor, width_factor=factor, depth_factor=None)
    if init == "aki":
        return plan_transfer(model, scheme, down=False, width_init="split", upper_units=True)
    return plan_transfer(model, scheme, down=False, width_init=init)


def depth_growth(model: nn.Module, where: str = "alternate", init: str = "identity") -> Transfer:
    """The transfer that doubles ``model``'s depth; ``where`` places the new blocks."""
    if where not in ("alternate", "append"):
        raise ValueError(f"where must be 'alternate' or 'append', got {where!r}")
    if init not in ("identity", "copy"):
        raise ValueError(f"depth init must be 'identity' or 'copy', got {init!r}")
    family = family_of(model)
    layers = family.sizes(model).layers
    pattern = "adjacent" if where == "alternate" else "stack"
    scheme = Scheme.uniform(layers=2 * layers, width_factor=None, depth_factor=2, depth=pattern)
    new_layers = frozenset(g[1] for g in scheme.depth)
    if init == "copy":
        warnings.warn("depth growth with init='copy' duplicates blocks and changes the function",
                      NotLossPreservingWarning, stacklevel=3)
    elif family.norm_position != "pre":
        warnings.warn(f"{family.name} blocks are post-norm (LN(x + f(x))): zero residual writers still "
                      "re-normalise x, so identity depth growth is not loss-preserving",
                      NotLossPreservingWarning, stacklevel=3)
    return plan_transfer(model, scheme, down=False, identity_layers=new_layers if init == "identity" else frozenset())


def _apply(transfer: Transfer, model: nn.Module, optimizer: Optimizer | None, match_first_step: bool):
    if optimizer is not None:
        check_optimizer(optimizer, model)
    new_model = transfer.build(model)
    new_optimizer = None
    if optimizer is not None:
        new_optimizer = map_optimizer(optimizer, model, new_model, transfer, match_first_step=match_first_step)
    return new_model, new_optimizer


def grow_width(
    model: nn.Module,
    optimizer: Optimizer | None = None,
    factor: int = 2,
    init: str = "block",
    match_first_step: bool = False,
):
    """Widen ``model`` (and map ``optimizer``'s state). Returns ``(new_model, new_optimizer)``.

    ``match_first_step=True`` gives every mapped tensor the learning-rate, eps and weight-decay
    multipliers (:func:`mlresearch.operators.optim.step_multipliers`) under which the grown
    model's next step moves its function exactly as the original model's step would.
    """
    return _apply(width_growth(model, factor, init), model, optimizer, match_first_step)


def grow_depth(
    model: nn.Module,
    optimizer: Optimizer | None = None,
    where: str = "alternate",
    init: str = "identity",
):
    """Double ``model``'s depth (and map ``optimizer``). Returns ``(new_model, new_optimizer)``."""
    return _apply(depth_growth(model, where, init), model, optimizer, False)


def decoalesce_state(model: nn.Module, optimizer: Optimizer, scheme: Scheme):
    """De-coalesce ``model`` and carry ``optimizer`` up with it (moments mapped like gradients)."""
    return _apply(plan_transfer(model, scheme, down=False), model, optimizer, False)


def coalesce_state(model: nn.Module, optimizer: Optimizer, scheme: Scheme):
    """Coalesce ``model`` and carry ``optimizer`` down: the exact inverse of :func:`decoalesce_state`
    on the moments (mean of the copies, divided by the gradient factor)."""
    return _apply(plan_transfer(model, scheme, down=True), model, optimizer, False)


def decoalesce_preserving(model: nn.Module, optimizer: Optimizer | None, scheme: Scheme):
    """De-coalesce so that the result computes what ``model`` computes (pre-norm families): width is
    de-coalesced as usual (exact), and in depth each small layer goes to the first layer of its group
    while the group's other layers start as identity blocks (zero residual writers, zero moments)
    instead of copies. Post-norm blocks (BERT) re-normalise even a zero update, so there only the
    width part is exact. Returns ``(new_model, new_optimizer)`` (the optimizer may be None)."""
    if scheme.width is not None:
        width = Scheme(width=scheme.width, kv_heads=scheme.kv_heads, ffn=scheme.ffn)
        model, optimizer = _apply(plan_transfer(model, width, down=False), model, optimizer, False)
    if scheme.depth is not None:
        new_layers = frozenset(i for group in scheme.depth for i in group[1:])
        transfer = plan_transfer(model, Scheme(depth=scheme.depth), down=False, identity_layers=new_layers)
        model, optimizer = _apply(transfer, model, optimizer, False)
    return model, optimizer


def _stack_scheme(model: nn.Module, factor: int) -> Scheme:
    layers = family_of(model).sizes(model).layers
    return Scheme.uniform(layers=layers * factor, width_factor=None, depth_factor=factor, depth="stack")


def stack_layers(model: nn.Module, factor: int):
    """G_stack (Du et al. 2024): the whole layer stack copied ``factor`` times (layer i of the result
    is layer i mod L of ``model``). Not function-preserving; the optimizer starts afresh."""
    return plan_transfer(model, _stack_scheme(model, factor), down=False).build(model)


def stack_layers_state(model: nn.Module, optimizer: Optimizer, factor: int):
    """:func:`stack_layers` with the optimizer carried: each copied layer takes its source layer's
    Adam moments and step (progressive stacking that keeps the training state)."""
    return decoalesce_state(model, optimizer, _stack_scheme(model, factor))
