"""Methods as plans: a method is a function from the config to a plan, an ordered list of training
phases and named transitions; one runner (:func:`execute`) carries one state through any plan.

A transition is a plain function ``fn(run, state, step)`` registered by name in
:data:`TRANSITIONS`; a method is a plain function ``fn(cfg) -> plan`` registered in
:data:`METHODS`. Adding either is one function and one decorator. The planned FLOPs
(:func:`planned_ledger`, ``mlresearch run --plan``) are read off the same plan the runner executes,
and every phase's ledger entry equals its planned FLOPs (a test checks it).

Resume needs nothing of its own: the runner replays the plan from the start, loading every phase
that its checkpoint says is done, and transitions are deterministic functions of the state, so
what they rebuild (partners, schemes, merged models) is what the killed run had.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..families import FAMILIES
from ..operators import (coalesce, coalesce_state, decoalesce, decoalesce_preserving, decoalesce_state,
                         interpolate, norm_ratios, stack_layers)
from ..tasks import task_of
from .config import ConfigError, RunConfig
from .models import level_sizes, model_sizes


@dataclass(frozen=True)
class Train:
    """Train the current model for ``steps`` (warm-up then decay) at peak ``lr``."""

    name: str
    level: int
    steps: int
    lr: float
    warmup: int
    horizon: int | None = None  # a longer schedule this phase runs part of (staged training)
    start: int = 0  # where in that schedule it begins
    rewarmup: int = 0  # linear re-warm-up into the schedule at ``start``
    sizes: Any = None  # the model's size when the method says it (else: the V-cycle's level size)
    trigger: float | None = None  # end early when the loss curve's log-log slope rises above this
    reenter: float | None = None  # start at (where the previous phase ended) / reenter, not at ``start``
    to_end: bool = False  # with ``reenter``: run to the end of the ``horizon``, not ``steps``
    kind: str | None = None  # the LR schedule's shape (linear | cosine | constant); default train.schedule

    def placed(self, position: int) -> "Train":
        """This phase after a previous one ended at schedule ``position`` (the plan's ``start`` and
        ``steps`` assume every phase ran its planned steps; a trigger may have ended one earlier)."""
        if self.reenter is None:
            return self
        start = int(round(position / self.reenter))
        return replace(self, start=start, steps=self.horizon - start if self.to_end else self.steps)


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


Plan = list  # of Train | Step


@dataclass
class State:
    """What a plan carries from item to item."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    partners: dict[int, torch.nn.Module] = field(default_factory=dict)  # M_k right before coalescing
    schemes: dict[int, Any] = field(default_factory=dict)  # the scheme that coalesced level k
    position: int = 0  # where in its LR schedule the last phase ended


TRANSITIONS: dict[str, Callable] = {}
COSTS: dict[str, Callable] = {}  # transitions that spend FLOPs: fn(cfg, step, model) -> (FLOPs, examples)
CHECKS: dict[str, Callable] = {}  # transitions that need something of the data: fn(cfg, step, data) raises
METHODS: dict[str, Callable[[RunConfig], Plan]] = {}
READS: dict[str, tuple[str, ...]] = {}  # the config's method sections each method reads
# How a results table names a run of each method: fn(config as saved beside the run) -> a subset of
# {levels, scheme, alpha, optimizer, budget} (the columns that tell one variant from another).
DESCRIBE: dict[str, Callable[[dict], dict]] = {}
RUN_NAMES: dict[str, Callable[[RunConfig], str]] = {}  # fn(cfg) -> a run's directory name, less "-seed<seed>"
TITLES: dict[str, str] = {}  # how tables, figures and the README name the method ("G_stack", "V-cycle")


def transition(name: str, cost: Callable | None = None, check: Callable | None = None):
    """Register ``fn(run, state, step)`` as transition ``name``. ``cost(cfg, step, model)``: the
    FLOPs and examples it spends (forward passes that choose something), which the plan counts and
    the ledger is charged; ``check(cfg, step, data)``: raises before anything is written if the
    data cannot serve it."""
    def register(fn):
        TRANSITIONS[name] = fn
        if cost:
            COSTS[name] = cost
        if check:
            CHECKS[name] = check
        return fn
    return register


def check_plan(cfg: RunConfig, plan: Plan, data) -> None:
    """Every transition of ``plan`` that needs something of the loaded data finds it."""
    for item in plan:
        if isinstance(item, Step) and item.op in CHECKS:
            CHECKS[item.op](cfg, item, data)


def method(name: str, reads: tuple[str, ...] = (), describe: Callable[[dict], dict] | None = None,
           run_name: Callable[[RunConfig], str] | None = None, title: str | None = None):
    """Register ``fn(cfg) -> plan`` as method ``name``; ``reads``: the method sections of the config
    (``vcycle``, ``staged``) it depends on, so a run is not told its config changed when another
    method's section did; ``describe``: how a results table names its runs (see :data:`DESCRIBE`);
    ``run_name``: its runs' directory name, less the seed (default: the method and the V-cycle's
    shapes it depends on, as the small-model control's); ``title``: its name for a reader (default
    ``name``)."""
    def register(fn):
        METHODS[name] = fn
        TITLES[name] = title or name
        READS[name] = reads
        DESCRIBE[name] = describe or (lambda config: {})
        RUN_NAMES[name] = run_name or (lambda cfg: _shapes_name(name, cfg))
        return fn
    return register


def name_part(text: str) -> str:
    """A config value as a piece of a directory name (a scheme path becomes its file stem)."""
    if text.endswith(".json"):
        text = "scheme-" + Path(text).stem
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text)


def _shapes_name(name: str, cfg: RunConfig) -> str:
    v = cfg.vcycle
    return f"{name}-L{v.levels}-{name_part(v.scheme)}" if v else name


def describe_run(name: str, config: dict) -> dict:
    """The table columns levels, scheme, alpha, optimizer, budget of a run of method ``name`` with
    the saved ``config`` ("-" where the method has no such choice)."""
    row = {"levels": None, "scheme": "-", "alpha": "-", "optimizer": "-", "budget": "-"}
    return {**row, **DESCRIBE.get(name, lambda c: {})(config)}


def build_plan(cfg: RunConfig, name: str) -> Plan:
    """The plan of method ``name`` for ``cfg``; unknown methods and transitions are config errors."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    plan = METHODS[name](cfg)
    unknown = sorted({item.op for item in plan if isinstance(item, Step) and item.op not in TRANSITIONS})
    if unknown:
        raise ConfigError(f"method {name!r} plans unknown transition(s) {unknown}; known: {sorted(TRANSITIONS)}")
    return plan


def execute(run, plan: Plan) -> torch.nn.Module:
    """Run ``plan`` over one state: phases through ``run.train``, transitions through the registry."""
    from .engine import Phase

    state = State()
    for item in plan:
        if isinstance(item, Train):
            item = item.placed(state.position)
            phase = Phase(item.name, item.level, item.steps, item.lr, item.warmup, item.horizon, item.start,
                          item.rewarmup, item.trigger, item.kind)
            state.model, state.optimizer = run.train(state.model, state.optimizer, phase)
            state.position = item.start + run.phases[-1]["steps"]
        else:
            TRANSITIONS[item.op](run, state, item)
    return state.model


# ----------------------------------------------------------------------------- transitions
@transition("new_model")
def new_model(run, state: State, step: Step) -> None:
    """A freshly initialised model of level ``step.level``'s size (level 1: the config's), or of the
    ``sizes`` the step gives."""
    state.model, state.optimizer = run.new_model(step.level, step.option("sizes")), None


def _check_external_partner(cfg: RunConfig, step: Step, data) -> None:
    """``vcycle.partner`` names a saved model of the config's own family and shape (one of another
    shape cannot be interpolated with M1), checked before anything is written."""
    from ..checkpoint import load_model

    path = step.option("external", "")
    if not path:
        return
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"vcycle.partner {path}: no saved model there (train the run it names, keeping its "
                          "final model, first)")
    model, family = load_model(path), FAMILIES[cfg.model.family]
    if not family.matches(model) or family.sizes(model) != model_sizes(cfg):
        raise ConfigError(f"vcycle.partner {path} is not a {cfg.model.family} model of the config's shape "
                          f"{model_sizes(cfg)}")


@transition("keep_partner", check=_check_external_partner)
def keep_partner(run, state: State, step: Step) -> None:
    """Keep M_k as it is now: the interpolation partner when the cycle comes back up (at level 1
    with ``vcycle.partner``: that saved model instead, the public example script's leak)."""
    from ..checkpoint import load_model, save_model

    external = step.option("external", "")
    state.partners[step.level] = load_model(external) if external else copy.deepcopy(state.model)
    if run.accelerator.is_main_process:
        save_model(state.partners[step.level], run.ckpt / f"partner{step.level}", overwrite=True)


@transition("choose_scheme")
def choose_scheme(run, state: State, step: Step) -> None:
    """The scheme that coalesces this level (measured on fixed validation batches for ``similarity``)."""
    from .models import scheme_for

    if run.cfg.vcycle.scheme == "similarity":
        state.schemes[step.level] = scheme_for(run.cfg, state.model, batches=run.probe_batches())
        run.log.write({"event": "scheme", "level": step.level, **state.schemes[step.level].to_dict()})
    else:
        state.schemes[step.level] = scheme_for(run.cfg, state.model)


def _map(run, state: State, step: Step, name: str, plain, with_optimizer) -> None:
    """Apply ``plain(model, scheme)``, or with ``carry`` ``with_optimizer(model, optimizer, scheme)``
    (Adam's moments mapped along); without ``carry`` the optimizer is dropped (a fresh one follows)."""
    scheme = state.schemes[step.level]
    if step.option("carry") and state.optimizer is not None:
        state.model, state.optimizer = run.operator(
            name, step.level, lambda: with_optimizer(state.model, state.optimizer, scheme))
    else:
        state.model, state.optimizer = run.operator(name, step.level, lambda: plain(state.model, scheme)), None
    state.model.train()


@transition("coalesce")
def coalesce_step(run, state: State, step: Step) -> None:
    """Coalesce with the level's scheme."""
    _map(run, state, step, "coalesce", coalesce, coalesce_state)


@transition("decoalesce")
def decoalesce_step(run, state: State, step: Step) -> None:
    """De-coalesce with the level's scheme: ``path`` copy (the paper: layers copied) or identity (new
    layers start as identity blocks, so a pre-norm model computes what the small one did);
    ``tie_break`` > 0 adds that much noise (x each tensor's std) to break the duplicated units."""
    if step.option("path", "copy") == "identity":
        _map(run, state, step, "decoalesce", lambda m, s: decoalesce_preserving(m, None, s)[0],
             decoalesce_preserving)
    else:
        _map(run, state, step, "decoalesce", decoalesce, decoalesce_state)
    noise = step.option("tie_break", 0.0)
    if noise:
        g = torch.Generator().manual_seed(run.cfg.seed * 1000 + step.level)
        with torch.no_grad():
            for p in state.model.parameters():
                if p.numel() > 1:
                    p.add_(torch.randn(p.shape, generator=g).to(p) * (noise * p.std()))


@transition("measure_symmetry")
def measure_symmetry(run, state: State, step: Step) -> None:
    """How far the model is from one whose width-duplicated units are equal: the largest entry of
    ``m - decoalesce(coalesce(m))`` under the level's width scheme, relative to the largest entry of
    ``m`` (0 right after plain de-coalescing; it grows only if something breaks the tie)."""
    from ..operators import Scheme

    scheme = state.schemes[step.level]
    if scheme.width is None:
        return
    width = Scheme(width=scheme.width, kv_heads=scheme.kv_heads, ffn=scheme.ffn)
    with torch.no_grad():
        sym = decoalesce(coalesce(state.model, width), width)
        diffs = [(a - b).abs().max().item() / max(a.abs().max().item(), 1e-30)
                 for (_, a), b in zip(state.model.named_parameters(), sym.parameters())]
    run.log.write({"event": "symmetry", "level": step.level, "when": step.option("when"),
                   "max_rel_diff": max(diffs)})


def _grow(run, state: State, step: Step, name: str, fn) -> None:
    """Grow with ``fn(model, optimizer) -> (model, optimizer)`` (the growth operators map Adam's
    moments and keep the step; G_stack returns no optimizer); log the validation loss before and
    after (equal for the loss-preserving operators)."""
    from .engine import evaluate

    before = evaluate(state.model, run.data, run.cfg)["val_loss"]
    state.model, state.optimizer = run.operator(name, step.level, lambda: fn(state.model, state.optimizer))
    state.model.train()
    run.log.write({"event": "grown", "op": name, "level": step.level, "val_loss_before": before,
                   "val_loss_after": evaluate(state.model, run.data, run.cfg)["val_loss"]})


@transition("grow_width")
def grow_width_step(run, state: State, step: Step) -> None:
    """Width x2 the staged-training way (block-diagonal matrices; function kept)."""
    from ..operators import grow_width

    _grow(run, state, step, "grow_width", lambda m, o: grow_width(m, o))


@transition("grow_depth")
def grow_depth_step(run, state: State, step: Step) -> None:
    """Depth x2 with identity blocks (zero residual writers; function kept in pre-norm blocks)."""
    from ..operators import grow_depth

    _grow(run, state, step, "grow_depth", lambda m, o: grow_depth(m, o, where=step.option("where", "alternate")))


def _search_examples(cfg: RunConfig, step: Step) -> int:
    return step.option("batches", 0) * cfg.train.batch_size


def merge_cost(cfg: RunConfig, step: Step, model) -> tuple[float, int]:
    """Searched alpha: one forward pass of the merged model per grid point over the tuning batches."""
    from .flops import eval_flops_per_example

    if step.option("alpha") != "search":
        return 0.0, 0
    n = len(step.option("grid")) * _search_examples(cfg, step)
    return n * eval_flops_per_example(model, task_of(cfg.task).seq_len(cfg)), n


def merge_check(cfg: RunConfig, step: Step, data) -> None:
    if step.option("alpha") == "search":
        need, have = _search_examples(cfg, step), len(data.split("tune")[0])
        if have < need:
            raise ConfigError(f"vcycle.search_batches {step.option('batches')} x train.batch_size {cfg.train.batch_size}"
                              f" = {need} tuning examples, but the tuning split has {have}; raise data.tune_fraction "
                              "or lower vcycle.search_batches")


def search_alpha(run, partner, big, step: Step) -> float:
    """The alpha of ``step``'s grid whose merge scores the lowest loss on the tuning batches (held
    out of training and of the validation split that defines the target); the grid, the choice and
    its cost are logged and charged to the ledger."""
    import time

    from .engine import evaluate

    grid, batches, k = step.option("grid"), step.option("batches"), step.level
    tick = time.perf_counter()
    scores = [evaluate(interpolate(partner, big, alpha=float(a)), run.data, run.cfg, "tune", batches)["tune_loss"]
              for a in grid]
    choice = grid[min(range(len(grid)), key=scores.__getitem__)]  # the first of equal scores
    seconds = time.perf_counter() - tick
    flops, examples = merge_cost(run.cfg, step, big)  # merge_check made sure the tuning split has them all
    run.ledger.flops += flops
    run.ledger.wall += seconds
    run.log.write({"event": "alpha_search", "level": k, "grid": [[float(a), s] for a, s in zip(grid, scores)],
                   "alpha": float(choice), "examples": examples, "flops": flops, "seconds": seconds})
    return float(choice)


@transition("merge", cost=merge_cost, check=merge_check)
def merge(run, state: State, step: Step) -> None:
    """Interpolate the partner with the de-coalesced model: ``(1-alpha) partner + alpha model``,
    adaptive (norms matched, then 0.5/0.5), or ``search`` (the grid's best on the tuning split);
    logs what each ingredient scores on validation."""
    from ..checkpoint import save_model
    from .engine import evaluate

    alpha, cfg, k = step.option("alpha"), run.cfg, step.level
    big, partner = state.model, state.partners[k]
    if alpha == "search":
        alpha = search_alpha(run, partner, big, step)
    adaptive = {"adaptive": "tensor", "adaptive-row": "row"}.get(alpha, False) if isinstance(alpha, str) else False
    if adaptive:
        every = norm_ratios(partner, big).values()
        ratios = sorted(r for r in every if r != float("inf")) or [None]  # zero tensors are left as they are
        run.log.write({"event": "adaptive_scale", "level": k, "mode": adaptive, "tensors": len(every),
                       "zero_norm_tensors": sum(r == float("inf") for r in every), "norm_ratio_min": ratios[0],
                       "norm_ratio_median": ratios[len(ratios) // 2], "norm_ratio_max": ratios[-1]})
    merged = run.operator("interpolate", k, lambda: interpolate(
        partner, big, alpha=None if adaptive else float(alpha), adaptive=adaptive))
    run.log.write({"event": "interpolated", "level": k,
                   "partner_val_loss": evaluate(partner, run.data, cfg)["val_loss"],
                   "decoalesced_val_loss": evaluate(big, run.data, cfg)["val_loss"],
                   "merged_val_loss": evaluate(merged, run.data, cfg)["val_loss"]})
    if state.optimizer is not None:  # carried moments belong to `big`; move them onto `merged` by name
        state.optimizer = _rebind(state.optimizer, big, merged)
    merged.train()
    if run.accelerator.is_main_process:
        save_model(merged, run.ckpt / f"merged{k}", overwrite=True)
    state.model = merged


def _rebind(optimizer, old_model, new_model):
    """The same optimizer (groups, state) over ``new_model``'s parameters of the same names."""
    by_name = dict(new_model.named_parameters())
    name_of = {id(p): n for n, p in old_model.named_parameters()}
    groups = [dict(g, params=[by_name[name_of[id(p)]] for p in g["params"]]) for g in optimizer.param_groups]
    new = type(optimizer)(groups)
    for p in old_model.parameters():
        if p in optimizer.state:
            new.state[by_name[name_of[id(p)]]] = optimizer.state[p]
    return new


# ----------------------------------------------------------------------------- methods
@method("baseline", run_name=lambda cfg: "baseline", title="baseline")
def baseline(cfg: RunConfig) -> Plan:
    """The full model from scratch for the config's budget."""
    t = cfg.train
    return [Step("new_model", 1), Train("baseline", 1, t.steps, t.lr, t.warmup)]


def _needs_vcycle(cfg: RunConfig, name: str) -> None:
    """The vcycle section is there and its scheme fits every level of the model (the models are
    sized on the meta device)."""
    if cfg.vcycle is None:
        raise ConfigError(f"method {name!r} needs the config's vcycle section (levels, scheme, budgets)")
    level_sizes(cfg)


def _describe_small(config: dict) -> dict:
    v = config.get("vcycle") or {}
    return {"levels": v.get("levels"), "scheme": v.get("scheme", "-"), "budget": f"{config['train']['steps']} steps"}


@method("small", reads=("vcycle",), describe=_describe_small, title="small shape alone")
def small(cfg: RunConfig) -> Plan:
    """The control every growth method must beat: the coalesced shape (the V-cycle's smallest level)
    trained from scratch with the same data, steps and batch as the baseline, at the smallest
    level's learning rate."""
    _needs_vcycle(cfg, "small")
    v, t, K = cfg.vcycle, cfg.train, cfg.vcycle.levels
    lr = v.lr[K - 1] if v.lr else t.lr
    return [Step("new_model", K), Train("small", K, t.steps, lr, t.warmup)]


def _describe_vcycle(config: dict) -> dict:
    v = config["vcycle"]
    alpha = str(v["alpha"]) + (f" up {v['up_path']}" if v.get("up_path", "copy") != "copy" else "") + \
        (f" tie {v['tie_break']}" if v.get("tie_break") else "")
    return {"levels": v["levels"], "scheme": v["scheme"], "alpha": alpha, "optimizer": v["optimizer"],
            "budget": (v.get("tag") or "preset") + (f", small LR {v['small_schedule']}" if v.get("small_schedule") else "")
            + (", partner: a saved model (leak)" if v.get("partner") else "")}


def _vcycle_name(cfg: RunConfig) -> str:
    v = cfg.vcycle
    variant = ("-up_identity" if v.up_path == "identity" else "") + (f"-tie{v.tie_break}" if v.tie_break else "") + \
        (f"-small_{v.small_schedule}" if v.small_schedule else "") + ("-external_partner" if v.partner else "")
    return f"vcycle-L{v.levels}-{name_part(v.scheme)}-a{v.alpha}-{v.optimizer}{variant}" + (f"-{v.tag}" if v.tag else "")


@method("vcycle", reads=("vcycle",), describe=_describe_vcycle, run_name=_vcycle_name, title="V-cycle")
def vcycle(cfg: RunConfig) -> Plan:
    """The multi-level V-cycle (Zou et al., A.5.2) with K levels::

        for k = 1 .. K-1:  train M_k (E_a); keep M_k as partner_k; M_{k+1} = coalesce(M_k)
        train M_K
        for k = K-1 .. 1:  M_k = interpolate(partner_k, decoalesce(M_{k+1}), alpha); train M_k

    The partner of level k is M_k right before it was coalesced (the reference GPT-2 script used
    the fully trained baseline, a bug not reproduced here). ``optimizer: carry`` maps Adam's
    moments down and up; ``reset`` starts each phase with a fresh AdamW (the paper).
    """
    _needs_vcycle(cfg, "vcycle")
    v, t, K = cfg.vcycle, cfg.train, cfg.vcycle.levels
    if v.down_steps[0] + v.up_steps[-1] > t.steps:  # checked here: only the V-cycle spends this budget
        raise ConfigError(f"budgets do not add up: the V-cycle trains the full model for {v.down_steps[0]} + "
                          f"{v.up_steps[-1]} = {v.down_steps[0] + v.up_steps[-1]} steps, more than the baseline's "
                          f"train.steps {t.steps}")
    lrs = v.lr or [t.lr] * K
    carry = (("carry", v.optimizer == "carry"),)
    plan: Plan = [Step("new_model", 1)]
    for k in range(1, K):
        if v.down_steps[k - 1] > 0:
            warm = v.down_warmup[k - 1] if v.down_warmup else v.down_steps[k - 1]
            plan.append(Train(f"down{k}", k, v.down_steps[k - 1], lrs[k - 1], warm))
        external = (("external", v.partner.format(seed=cfg.seed)),) if v.partner and k == 1 else ()
        plan += [Step("keep_partner", k, external), Step("choose_scheme", k), Step("coalesce", k, carry)]
    plan.append(Train("small", K, v.small_steps, lrs[K - 1], v.small_warmup, kind=v.small_schedule))
    up = carry + (("path", v.up_path),) + ((("tie_break", v.tie_break),) if v.tie_break else ())
    for k in range(K - 1, 0, -1):
        i = K - 1 - k
        merge_options = (("alpha", v.alpha),) + ((("grid", tuple(v.alpha_grid)), ("batches", v.search_batches))
                                                  if v.alpha == "search" else ())
        plan += [Step("decoalesce", k, up), Step("merge", k, merge_options),
                 Step("measure_symmetry", k, (("when", "merged"),)),
                 Train(f"up{k}", k, v.up_steps[i], lrs[k - 1], v.up_warmup[i] if v.up_warmup else 0),
                 Step("measure_symmetry", k, (("when", f"after up{k}"),))]
    return plan


def _describe_staged(config: dict) -> dict:
    st = config["staged"]
    return {"levels": len(st["grow"]) + 1, "scheme": "grow " + "+".join(st["grow"]) +
            (" on trigger" if st.get("trigger") else ""), "optimizer": "carry", "budget": st.get("tag") or "preset"}


@method("staged", reads=("staged",), describe=_describe_staged,
        run_name=lambda cfg: f"staged-{'-'.join(cfg.staged.grow)}" + (f"-{cfg.staged.tag}" if cfg.staged.tag else ""),
        title="staged training")
def staged(cfg: RunConfig) -> Plan:
    """Staged training (Shen et al. 2022): the config's model shrunk by ``staged.grow``, trained for
    each stage's steps on the full model's LR schedule, grown x2 with the training state, the schedule
    re-entered at S_r = position / constant_op through a ``rewarmup``, until ``train.steps``. With
    ``staged.trigger`` a stage grows as soon as its loss curve's slope passes the growth's threshold
    (B.6), its ``steps`` only a cap; the plan shows the schedule if no trigger fires."""
    from .models import staged_schedule, staged_sizes
    from .schedules import CONSTANT_OP
    from .trigger import THRESHOLDS

    if cfg.staged is None:
        raise ConfigError("method 'staged' needs the config's staged section (grow, steps, rewarmup)")
    t, st = cfg.train, cfg.staged
    sizes, schedule = staged_sizes(cfg), staged_schedule(cfg)
    if schedule[-1][0] >= t.steps:
        raise ConfigError(f"staged: the full model would re-enter the schedule at step {schedule[-1][0]}, not before "
                          f"train.steps {t.steps}; shorten staged.steps")
    constants = st.constant_op or [CONSTANT_OP[g] for g in st.grow]
    thresholds = st.thresholds or [THRESHOLDS[g] for g in st.grow]
    last = len(schedule) - 1
    plan: Plan = [Step("new_model", 1, (("sizes", sizes[0]),))]
    for i, (start, steps) in enumerate(schedule):
        if i:
            grow = st.grow[i - 1]
            plan.append(Step(f"grow_{grow}", i, (("where", st.depth_where),) if grow == "depth" else ()))
        plan.append(Train(f"stage{i}", i + 1, steps, t.lr, t.warmup, horizon=t.steps, start=start,
                          rewarmup=st.rewarmup if i else 0, sizes=sizes[i],
                          trigger=thresholds[i] if st.trigger and i < last else None,
                          reenter=constants[i - 1] if i else None, to_end=i == last))
    return plan


@transition("stack")
def stack_step(run, state: State, step: Step) -> None:
    """G_stack: copy the whole layer stack ``factor`` times; the optimizer starts afresh."""
    factor = step.option("factor")
    _grow(run, state, step, "stack", lambda m, o: (stack_layers(m, factor), None))


def _describe_stack(config: dict) -> dict:
    sk = config["stack"]
    return {"levels": 2, "scheme": f"G_stack x{sk['factor']}", "optimizer": "reset", "budget": sk.get("tag") or "preset"}


@method("stack", reads=("stack",), describe=_describe_stack,
        run_name=lambda cfg: f"stack-x{cfg.stack.factor}" + (f"-{cfg.stack.tag}" if cfg.stack.tag else ""),
        title="G_stack")
def stack(cfg: RunConfig) -> Plan:
    """G_stack (Du et al. 2024): 1/factor of the layers for ``stack.steps`` on the full schedule, the
    stack copied ``factor`` times, a fresh optimizer re-entering the schedule through ``rewarmup``."""
    from .models import model_sizes

    if cfg.stack is None:
        raise ConfigError("method 'stack' needs the config's stack section (factor, steps, rewarmup)")
    t, st, full = cfg.train, cfg.stack, model_sizes(cfg)
    if full.layers % st.factor:
        raise ConfigError(f"stack.factor {st.factor} does not divide model.layers {full.layers}")
    if st.steps >= t.steps:
        raise ConfigError(f"stack.steps {st.steps} leaves no steps of train.steps {t.steps} for the full model")
    small = full.replace(layers=full.layers // st.factor)
    return [Step("new_model", 1, (("sizes", small),)),
            Train("stage0", 1, st.steps, t.lr, t.warmup, horizon=t.steps, sizes=small),
            Step("stack", 1, (("factor", st.factor),)),
            Train("stage1", 2, t.steps - st.steps, t.lr, t.warmup, horizon=t.steps, start=st.steps,
                  rewarmup=st.rewarmup, sizes=full)]


# ----------------------------------------------------------------------------- planned FLOPs
def planned_ledger(cfg: RunConfig, name: str) -> dict:
    """The FLOPs, examples and tokens each phase of method ``name`` plans to spend (models built on
    the meta device), from the plan the runner executes."""
    from ..families import FAMILIES
    from .flops import train_flops_per_example
    from .models import level_sizes, model_options, model_sizes

    plan = build_plan(cfg, name)
    vocab = 50257 if cfg.data.tokenizer == "gpt2" else cfg.data.vocab_size
    family = FAMILIES[cfg.model.family]
    seq = task_of(cfg.task).seq_len(cfg)
    level = level_sizes(cfg) if cfg.vcycle else [model_sizes(cfg)]
    models: dict = {}

    def model_of(sizes):
        if sizes not in models:
            with torch.device("meta"), family.skip_init():
                models[sizes] = family.new(sizes, **model_options(cfg, vocab))
            family.tie(models[sizes])  # (skipped initialisation leaves a tied head untied)
        return models[sizes]

    b = cfg.train.batch_size
    phases, transitions = [], []
    for i, item in enumerate(plan):
        if isinstance(item, Train):
            sizes = item.sizes or level[item.level - 1]
            model = model_of(sizes)
            phases.append({"phase": item.name, "level": item.level, "steps": item.steps,
                           "examples": item.steps * b, "tokens": item.steps * b * (seq or 1),
                           "flops": item.steps * b * train_flops_per_example(model, seq),
                           "params": sum(p.numel() for p in model.parameters()), "sizes": sizes})
        elif item.op in COSTS:
            flops, examples = COSTS[item.op](cfg, item, model_of(level[item.level - 1]))
            if flops:
                transitions.append({"item": i, "op": item.op, "level": item.level, "flops": flops,
                                    "examples": examples})
    total = sum(p["flops"] for p in phases) + sum(t["flops"] for t in transitions)
    return {"method": name, "plan": plan, "phases": phases, "transitions": transitions, "flops": total}


def format_plan(cfg: RunConfig, name: str) -> str:
    """What ``mlresearch run CONFIG --method NAME --plan`` prints."""
    ledger = planned_ledger(cfg, name)
    base = planned_ledger(cfg, "baseline")["flops"]
    phases = iter(ledger["phases"])
    lines = [f"plan of {name} for {cfg.experiment} (seed {cfg.seed}), {cfg.train.batch_size} examples per step",
             f"{'':3}{'item':34} {'model':28} {'steps':>7} {'tokens':>14} {'FLOPs':>10}"]
    for i, item in enumerate(ledger["plan"], 1):
        if isinstance(item, Train):
            p = next(phases)
            s = p["sizes"]
            model = f"{s.layers}L/{s.hidden}d/{s.heads}h, {p['params'] / 1e6:.2f}M"
            lines.append(f"{i:<3}{'train ' + item.name + f' (level {item.level})':34} {model:28} {p['steps']:>7,} "
                         f"{p['tokens']:>14,} {p['flops']:>10.3e}")
        else:
            spent = [t for t in ledger["transitions"] if t["item"] == i - 1]
            cost = f"  [{spent[0]['examples']:,} examples evaluated, {spent[0]['flops']:.3e} FLOPs]" if spent else ""
            lines.append(f"{i:<3}{item.describe()}{cost}")
    if any(isinstance(item, Train) and item.trigger is not None for item in ledger["plan"]):
        lines.append("(a stage with a trigger ends early when it fires; the numbers assume it does not)")
    lines.append(f"total: {ledger['flops']:.3e} FLOPs = {ledger['flops'] / base:.3f} x the baseline's {base:.3e}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- cost before a GPU-hour
H100_BF16_DENSE_TFLOPS = 989.0  # NVIDIA's dense bf16 peak of an H100 SXM (the default --peak-tflops)


def format_cost(cfg: RunConfig, gpus: int = 8, peak_tflops: float = H100_BF16_DENSE_TFLOPS, mfu: float = 0.4) -> str:
    """What ``mlresearch plan CONFIG`` prints: each method the config can plan, its phases with
    tokens, FLOPs and estimated GPU-hours (FLOPs / (peak x MFU)), beside the baseline, and the saving
    each method's plan implies if it reaches the baseline's final loss at its own end."""
    if gpus < 1 or peak_tflops <= 0 or not 0 < mfu <= 1:
        raise ConfigError(f"--gpus must be >= 1, --peak-tflops > 0 and --mfu in (0, 1]; got {gpus}, {peak_tflops}, {mfu}")
    per_gpu_hour = peak_tflops * 1e12 * mfu * 3600

    def hours(flops: float) -> float:
        return flops / per_gpu_hour

    names = ["baseline"] + sorted(n for n in METHODS if n != "baseline")
    ledgers = {}
    for name in names:
        try:
            ledgers[name] = planned_ledger(cfg, name)
        except ConfigError:  # a method this config cannot plan (no vcycle section, say)
            continue
    base = ledgers["baseline"]["flops"]
    lines = [f"cost plan for {cfg.experiment}: {gpus} GPU(s) at {peak_tflops:g} TFLOP/s peak, MFU {mfu:g} "
             f"({gpus * peak_tflops * mfu:g} TFLOP/s sustained); {cfg.train.batch_size} examples per step"]
    for name, ledger in ledgers.items():
        lines.append(f"\n{name}:")
        lines.append(f"  {'phase':12} {'model':26} {'steps':>9} {'tokens':>16} {'FLOPs':>10} {'GPU-hours':>10}")
        for p in ledger["phases"]:
            s = p["sizes"]
            model = f"{s.layers}L/{s.hidden}d/{s.heads}h, {p['params'] / 1e6:.1f}M"
            lines.append(f"  {p['phase']:12} {model:26} {p['steps']:>9,} {p['tokens']:>16,} {p['flops']:>10.3e} "
                         f"{hours(p['flops']):>10,.1f}")
        for t in ledger["transitions"]:
            lines.append(f"  {t['op'] + str(t['level']):12} {'(forward passes)':26} {'':>9} {'':>16} {t['flops']:>10.3e} "
                         f"{hours(t['flops']):>10,.1f}")
        total = ledger["flops"]
        lines.append(f"  {'total':12} {'':26} {'':>9} {sum(p['tokens'] for p in ledger['phases']):>16,} "
                     f"{total:>10.3e} {hours(total):>10,.1f}  ({hours(total) / gpus:,.1f} h on {gpus} GPU(s))")
    lines.append("\nif a method reaches the baseline's final validation loss at the end of its plan:")
    for name, ledger in ledgers.items():
        if name != "baseline":
            lines.append(f"  {name}: {100 * (1 - ledger['flops'] / base):.1f}% of the baseline's FLOPs saved, "
                         f"{hours(base) - hours(ledger['flops']):,.1f} GPU-hours")
    return "\n".join(lines)
