"""What every method is made of besides its training phases (``training.phase.Phase``): named
transitions (:class:`Step`), the state a plan carries (:class:`State`), and :class:`Method`, the one
object the rest of the code knows a method by. The registries live here; the method files fill them."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..config import RunConfig

# The optimizer at a transition that changes the model: a fresh one (reset) or the old one's state
# carried over to the new parameters (carry); every method with the choice validates it against this.
OPTIMIZER_CHOICES = ("reset", "carry")


@dataclass(frozen=True)
class Step:
    """A transition: the registered function ``op`` applied at ``level`` with ``options``."""

    op: str
    level: int
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    def describe(self) -> str:
        shown = ", ".join(f"{k} {f'{v.layers}L/{v.hidden}d/{v.heads}h' if hasattr(v, 'layers') else v}"
                          for k, v in self.options)
        return f"{self.op.replace('_', ' ')} (level {self.level}{'; ' + shown if shown else ''})"


Plan = list  # of Phase | Step


@dataclass
class State:
    """What a plan carries from item to item."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    partners: dict[int, torch.nn.Module] = field(default_factory=dict)  # M_k right before coalescing
    schemes: dict[int, Any] = field(default_factory=dict)  # the scheme that coalesced level k
    position: int = 0  # where in its LR schedule the last phase ended
    teacher: torch.nn.Module | None = None  # a trained model later phases distil from (Knowledge Inheritance)


class Context(Protocol):
    """What a transition may use of the run it is part of (``training.run.Run`` provides it): the
    config and the data, the metrics log, a fresh model, the operator wrapper (times it, logs it, a
    fault point after it), the ledger through :meth:`charge` alone, and a place to keep a model."""

    cfg: RunConfig
    data: Any
    log: Any

    @property
    def data_step(self) -> int: ...

    def new_model(self, sizes=None) -> torch.nn.Module: ...

    def operator(self, name: str, level: int, fn: Callable) -> Any: ...

    def charge(self, flops: float = 0.0, wall: float = 0.0, data_steps: int = 0) -> None: ...

    def keep(self, model: torch.nn.Module, name: str) -> None: ...

    def probe_batches(self, n: int = 2) -> list[dict]: ...


def _no_columns(config: dict) -> dict:
    return {}


@dataclass(frozen=True)
class Method:
    """Everything the code outside a method's file knows of it.

    ``plan(cfg)``: its phases and transitions; ``title``: how tables, figures and the README name it;
    ``summary``, ``preserves``, ``costs``: the README's methods list (what it does, whether its
    transitions keep the model's function, what it spends besides training steps); ``reads``: the config's method sections it depends on (its
    own settings, registered in its file with ``config.method_settings``, and any it borrows: the
    small control reads the V-cycle's), so a run is not told its config changed when another
    method's section did; ``describe(config as saved)``: the table columns that tell its variants
    apart (a subset of levels, scheme, alpha, optimizer, budget); ``run_name(cfg)``: its runs'
    directory name, less ``-seed<seed>``; ``marker``: its end points' marker in figures.
    """

    name: str
    plan: Callable[[RunConfig], Plan]
    title: str = ""
    summary: str = ""
    preserves: str = ""
    costs: str = ""
    reads: tuple[str, ...] = ()
    describe: Callable[[dict], dict] = _no_columns
    run_name: Callable[[RunConfig], str] | None = None
    marker: str = "^"

    def directory(self, cfg: RunConfig) -> str:
        """The run directory's name, less ``-seed<seed>``."""
        return self.run_name(cfg) if self.run_name else self.name

    def display(self) -> str:
        return self.title or self.name


METHODS: dict[str, Method] = {}  # by name, in the order tables list them
TRANSITIONS: dict[str, Callable] = {}
COSTS: dict[str, Callable] = {}  # transitions that spend FLOPs: fn(cfg, step, model) -> (FLOPs, examples)
CHECKS: dict[str, Callable] = {}  # transitions that need something of the data: fn(cfg, step, data) raises


def register(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` (a method file ends with ``METHOD = register(Method(...))``)."""
    METHODS[method.name] = method
    return method


def title_of(name: str) -> str:
    """How a reader sees method ``name`` (its name itself if it is not registered)."""
    return METHODS[name].display() if name in METHODS else name


def transition(name: str, cost: Callable | None = None, check: Callable | None = None):
    """Register ``fn(run, state, step)`` as transition ``name`` (``run``: the :class:`Context`). ``cost(cfg, step, model)``: the
    FLOPs and examples it spends (forward passes that choose something), which the plan counts and
    the ledger is charged; ``check(cfg, step, data)``: raises before anything is written if the
    data cannot serve it."""
    def register_fn(fn):
        TRANSITIONS[name] = fn
        if cost:
            COSTS[name] = cost
        if check:
            CHECKS[name] = check
        return fn
    return register_fn


def check_small_then_grown(section: str, settings) -> None:
    """The settings every method that trains a small model for ``steps`` and then grows it ``width``
    times wider and ``depth`` times deeper shares (bert2BERT, LiGO, MSG): positive whole numbers,
    something to grow, a re-warm-up of 0 or more, a tag fit for a directory name, and (where the
    method has one) ``optimizer`` reset or carry. Shapes and budgets are checked when the plan is built."""
    from ..config import ConfigError, one_of, positive, tag

    for key in ("steps", "width", "depth"):
        positive(getattr(settings, key), f"{section}.{key}")
    if settings.width == 1 and settings.depth == 1:
        raise ConfigError(f"{section}: width 1 and depth 1 grow nothing; make one of them >= 2")
    positive(settings.rewarmup, f"{section}.rewarmup", zero_ok=True)
    if hasattr(settings, "optimizer"):
        one_of(settings.optimizer, f"{section}.optimizer", OPTIMIZER_CHOICES)
    tag(settings.tag, f"{section}.tag")


def shrunk(full, width: int, depth: int, method: str):
    """The model of 1/width of ``full``'s heads, KV heads, hidden and FFN units and 1/depth of its
    layers (the small shape of bert2BERT, KI and LiGO; the V-cycle's halving one for 2 and 2)."""
    from ..config import ConfigError

    if width == 1 and depth == 1:
        raise ConfigError(f"{method}: width 1 and depth 1 leave the full model; make one of them >= 2")
    if any(n % width for n in (full.heads, full.kv_heads, full.hidden, full.ffn)) or full.layers % depth:
        raise ConfigError(f"{method}: width {width} and depth {depth} must divide the model's heads, KV heads, hidden, "
                          f"FFN units and layers ({full.heads}, {full.kv_heads}, {full.hidden}, {full.ffn}, "
                          f"{full.layers})")
    return full.replace(heads=full.heads // width, kv_heads=full.kv_heads // width, hidden=full.hidden // width,
                        ffn=full.ffn // width, layers=full.layers // depth)


def name_part(text: str) -> str:
    """A config value as a piece of a directory name (a scheme path becomes its file stem)."""
    if text.endswith(".json"):
        text = "scheme-" + Path(text).stem
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text)


# ----------------------------------------------------------------------------- transitions every method may use
@transition("new_model")
def new_model(run: Context, state: State, step: Step) -> None:
    """A freshly initialised model of the ``sizes`` the step gives (default: the config's)."""
    state.model, state.optimizer = run.new_model(step.option("sizes")), None


def grow(run: Context, state: State, step: Step, name: str, fn, under=None) -> None:
    """Grow with ``fn(model, optimizer) -> (model, optimizer)`` (the growth operators map Adam's
    moments and keep the step; G_stack returns no optimizer); log the validation loss before and
    after (equal for the loss-preserving operators), the latter read inside ``under(model)`` if given
    (a context: MSG's masks at 0)."""
    from ..engine import evaluate

    before = evaluate(state.model, run.data, run.cfg)["val_loss"]
    state.model, state.optimizer = run.operator(name, step.level, lambda: fn(state.model, state.optimizer))
    state.model.train()
    with under(state.model) if under else contextlib.nullcontext():
        after = evaluate(state.model, run.data, run.cfg)["val_loss"]
    run.log.write({"event": "grown", "op": name, "level": step.level, "val_loss_before": before,
                   "val_loss_after": after})
