"""The multi-level V-cycle (Zou, Zhang, Deng, ICLR 2024, A.5.2): its settings (the ``vcycle``
section), the sizes and schemes of its levels, its transitions (keep the partner, choose a scheme,
coalesce, de-coalesce, merge, measure symmetry) and its plan."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...families import FAMILIES, Sizes
from ...operators import (Scheme, coalesce, coalesce_state, decoalesce, decoalesce_preserving, decoalesce_state,
                          interpolate, make_plan, norm_ratios)
from ...tasks import task_of
from ..config import ConfigError, MethodSettings, RunConfig, method_settings, number, one_of, positive, tag
from ..models import model_sizes
from ..phase import Phase
from ..schedules import SCHEDULE_KINDS
from .base import OPTIMIZER_CHOICES, Context, Method, Plan, State, Step, name_part, register, transition


@dataclass(frozen=True)
class Alpha:
    """``vcycle.alpha`` read once, by the validator and by the merge alike: a fixed weight on the
    de-coalesced model, ``adaptive`` (the partner's tensors scaled to the model's norms, then 0.5 / 0.5;
    ``adaptive-row`` per output row), or ``search`` (the grid's best on the tuning split)."""

    mode: str  # fixed | adaptive | search
    weight: float | None = None  # fixed: (1 - weight) partner + weight model
    norms: str | None = None  # adaptive: whose norms are matched, per "tensor" or per "row"

    NAMED = {"adaptive": ("adaptive", "tensor"), "adaptive-row": ("adaptive", "row"), "search": ("search", None)}

    @classmethod
    def parse(cls, value: Any) -> "Alpha":
        if isinstance(value, str):
            if value not in cls.NAMED:
                raise ConfigError(f"vcycle.alpha must be a number in [0, 1] or one of {', '.join(map(repr, cls.NAMED))}, "
                                  f"got {value!r}")
            mode, norms = cls.NAMED[value]
            return cls(mode, norms=norms)
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value <= 1):
            raise ConfigError(f"vcycle.alpha must lie in [0, 1], got {value!r}")
        return cls("fixed", weight=float(value))


@method_settings("vcycle")
@dataclass
class VCycleSettings(MethodSettings):
    """The ``vcycle`` section: K levels, the scheme that coalesces each, alpha, the optimizer across
    transitions, and each phase's steps, LR and warm-up (E_a down, the small model, the way up)."""

    levels: int = 2
    scheme: str = "halving"  # halving | halving-stack | width-only | depth-only | similarity | a scheme JSON
    alpha: Any = 0.25  # a number in [0, 1], "adaptive" / "adaptive-row", or "search" (over alpha_grid)
    alpha_grid: list = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # alpha: search tries these
    search_batches: int = 4  # alpha: search scores each alpha on this many batches of the tuning split
    optimizer: str = "reset"  # reset (the paper) | carry (moments mapped by the growth operators)
    down_steps: list = field(default_factory=list)  # E_a for levels 1..K-1
    small_steps: int = 0  # the smallest model's steps
    up_steps: list = field(default_factory=list)  # continued steps for levels K-1..1 (last = level 1)
    lr: list | None = None  # peak LR per level 1..K (default: train.lr at every level)
    down_warmup: list | None = None  # warm-up steps of each E_a phase (default: the whole phase)
    small_warmup: int = 0
    small_schedule: str | None = None  # the small phase's LR shape (linear | cosine | constant); default train.schedule
    up_warmup: list | None = None
    tag: str = ""  # names a budget/LR variant: the run directory gets "-<tag>" (tuning runs)
    up_path: str = "copy"  # copy: depth de-coalescing copies layers (the paper); identity: new layers start as identity
    tie_break: float = 0.0  # noise (x each tensor's std) added to the de-coalesced model, to break duplicate units
    # A saved model ("{seed}" is the run's seed) merged with at level 1 instead of M1 after E_a: what the public
    # example script does (it merges with the fully trained baseline), to measure that leak; never the method.
    partner: str = ""

    def validate(self, cfg: RunConfig) -> None:
        v = self
        if isinstance(v.levels, bool) or v.levels not in (2, 3, 4):
            raise ConfigError(f"vcycle.levels must be 2, 3 or 4, got {v.levels}")
        k = v.levels - 1
        for name in ("down_steps", "up_steps"):
            seq = getattr(v, name)
            if not isinstance(seq, list) or len(seq) != k:
                raise ConfigError(f"vcycle.{name} needs one entry per level above the smallest ({k}), got {seq!r}")
            for i, s in enumerate(seq):
                positive(s, f"vcycle.{name}[{i}]", zero_ok=name == "down_steps")
        positive(v.small_steps, "vcycle.small_steps")
        for name, n in (("lr", v.levels), ("down_warmup", k), ("up_warmup", k)):
            seq = getattr(v, name)
            if seq is not None and (not isinstance(seq, list) or len(seq) != n):
                raise ConfigError(f"vcycle.{name} needs {n} entries, got {seq!r}")
        for i, lr in enumerate(v.lr or []):
            number(lr, f"vcycle.lr[{i}]", 0, low_open=True)
        for name in ("down_warmup", "up_warmup"):
            for i, w in enumerate(getattr(v, name) or []):
                positive(w, f"vcycle.{name}[{i}]", zero_ok=True)
        positive(v.small_warmup, "vcycle.small_warmup", zero_ok=True)
        if v.small_warmup > v.small_steps:
            raise ConfigError(f"vcycle.small_warmup {v.small_warmup} exceeds vcycle.small_steps {v.small_steps}")
        if not isinstance(v.partner, str):
            raise ConfigError(f"vcycle.partner must be a model directory (or empty), got {v.partner!r}")
        one_of(v.small_schedule, "vcycle.small_schedule", SCHEDULE_KINDS, unset="train.schedule")
        if v.down_warmup and any(w > s for w, s in zip(v.down_warmup, v.down_steps)):
            raise ConfigError("vcycle.down_warmup exceeds its phase's down_steps")
        if v.up_warmup and any(w > s for w, s in zip(v.up_warmup, v.up_steps)):
            raise ConfigError("vcycle.up_warmup exceeds its phase's up_steps")
        if not isinstance(v.tag, str) or not isinstance(v.scheme, str):
            raise ConfigError(f"vcycle.tag and vcycle.scheme must be strings, got {v.tag!r} and {v.scheme!r}")
        tag(v.tag, "vcycle.tag")
        one_of(v.up_path, "vcycle.up_path", ("copy", "identity"))
        number(v.tie_break, "vcycle.tie_break", 0)
        one_of(v.optimizer, "vcycle.optimizer", OPTIMIZER_CHOICES)
        if Alpha.parse(v.alpha).mode == "search" and not cfg.data.tune_fraction:
            raise ConfigError("vcycle.alpha: search chooses alpha on a tuning split held out of training and of the "
                              "validation split; set data.tune_fraction > 0 (e.g. 0.02)")
        if not isinstance(v.alpha_grid, list) or not v.alpha_grid:
            raise ConfigError(f"vcycle.alpha_grid must be a non-empty list of numbers in [0, 1], got {v.alpha_grid!r}")
        for i, a in enumerate(v.alpha_grid):
            number(a, f"vcycle.alpha_grid[{i}]", 0, 1)
        positive(v.search_batches, "vcycle.search_batches")
        named = ("halving", "halving-stack", "width-only", "depth-only", "similarity")
        if v.scheme not in named and Path(v.scheme).suffix != ".json":
            raise ConfigError(f"vcycle.scheme must be one of {named} or a .json path, got {v.scheme!r}")
        # Whether the scheme fits every level (it involves the model section) and the budget (train.steps)
        # are checked when a plan that reads this section is built (below): a baseline run may
        # change the model or its steps without the V-cycle's settings standing in its way.

    def full_model_lr(self, lr: float) -> list[str]:
        """Level 1 follows a tuned LR; the smaller levels keep theirs."""
        return ["vcycle.lr=[" + ",".join(f"{x:g}" for x in [lr, *self.lr[1:]]) + "]"] if self.lr else []


# ----------------------------------------------------------------------------- levels
def scheme_for(cfg: RunConfig, model: nn.Module | None = None, sizes: Sizes | None = None,
               batches: list[dict] | None = None) -> Scheme:
    """The scheme that coalesces a model of this level (the fixed halving patterns adapt to size;
    ``similarity`` measures the model on ``batches``; without a model it stands in for halving,
    which gives the same sizes)."""
    name = cfg.vcycle.scheme
    kw = {"heads": sizes.heads, "layers": sizes.layers} if model is None else {}
    if name == "similarity":
        if model is None:
            return Scheme.halving(**kw)
        from ...analysis.schemes import scheme_from_similarity  # analysis sits above training: no cycle

        return scheme_from_similarity(model, batches or [])
    if name == "halving":
        return Scheme.halving(model, **kw)
    if name == "halving-stack":
        return Scheme.halving(model, depth="stack", **kw)
    if name == "width-only":
        return Scheme.halving(model, depth=None, **kw)
    if name == "depth-only":
        return Scheme.halving(model, width=False, **kw)
    if cfg.vcycle.levels != 2:
        raise ConfigError("a scheme file fits one model size; use it with vcycle.levels: 2")
    return Scheme.from_json(name)


def level_sizes(cfg: RunConfig) -> list[Sizes]:
    """Sizes of the models at levels 1..K (raises if the scheme does not fit a level)."""
    from ...errors import SchemeError

    sizes = [model_sizes(cfg)]
    for level in range(1, cfg.vcycle.levels):
        try:
            scheme = scheme_for(cfg, sizes=sizes[-1])
            sizes.append(make_plan(sizes[-1], scheme, down=True).small)
        except SchemeError as exc:
            raise ConfigError(f"vcycle.scheme does not fit the level-{level} model {sizes[-1]}: {exc}") from exc
    return sizes


def needs_vcycle(cfg: RunConfig, name: str) -> list[Sizes]:
    """The sizes of levels 1..K, once the vcycle section is there and its scheme fits every level."""
    if cfg.vcycle is None:
        raise ConfigError(f"method {name!r} needs the config's vcycle section (levels, scheme, budgets)")
    return level_sizes(cfg)


# ----------------------------------------------------------------------------- transitions
def _check_external_partner(cfg: RunConfig, step: Step, data) -> None:
    """``vcycle.partner`` names a saved model of the config's own family and shape (one of another
    shape cannot be interpolated with M1), checked before anything is written."""
    from ...checkpoint import load_model

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
def keep_partner(run: Context, state: State, step: Step) -> None:
    """Keep M_k as it is now: the interpolation partner when the cycle comes back up (at level 1
    with ``vcycle.partner``: that saved model instead, the public example script's leak)."""
    from ...checkpoint import load_model

    external = step.option("external", "")
    state.partners[step.level] = load_model(external) if external else copy.deepcopy(state.model)
    run.keep(state.partners[step.level], f"partner{step.level}")


@transition("choose_scheme")
def choose_scheme(run: Context, state: State, step: Step) -> None:
    """The scheme that coalesces this level (measured on fixed validation batches for ``similarity``)."""
    if run.cfg.vcycle.scheme == "similarity":
        state.schemes[step.level] = scheme_for(run.cfg, state.model, batches=run.probe_batches())
        run.log.write({"event": "scheme", "level": step.level, **state.schemes[step.level].to_dict()})
    else:
        state.schemes[step.level] = scheme_for(run.cfg, state.model)


def _map(run: Context, state: State, step: Step, name: str, plain, with_optimizer) -> None:
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
def coalesce_step(run: Context, state: State, step: Step) -> None:
    """Coalesce with the level's scheme."""
    _map(run, state, step, "coalesce", coalesce, coalesce_state)


@transition("decoalesce")
def decoalesce_step(run: Context, state: State, step: Step) -> None:
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
def measure_symmetry(run: Context, state: State, step: Step) -> None:
    """How far the model is from one whose width-duplicated units are equal: the largest entry of
    ``m - decoalesce(coalesce(m))`` under the level's width scheme, relative to the largest entry of
    ``m`` (0 right after plain de-coalescing; it grows only if something breaks the tie)."""
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


def _search_examples(cfg: RunConfig, step: Step) -> int:
    return step.option("batches", 0) * cfg.train.batch_size


def merge_cost(cfg: RunConfig, step: Step, model) -> tuple[float, int]:
    """Searched alpha: one forward pass of the merged model per grid point over the tuning batches."""
    from ..flops import eval_flops_per_example

    if Alpha.parse(step.option("alpha")).mode != "search":
        return 0.0, 0
    n = len(step.option("grid")) * _search_examples(cfg, step)
    return n * eval_flops_per_example(model, task_of(cfg.task).seq_len(cfg)), n


def merge_check(cfg: RunConfig, step: Step, data) -> None:
    if Alpha.parse(step.option("alpha")).mode == "search":
        need, have = _search_examples(cfg, step), len(data.split("tune")[0])
        if have < need:
            raise ConfigError(f"vcycle.search_batches {step.option('batches')} x train.batch_size {cfg.train.batch_size}"
                              f" = {need} tuning examples, but the tuning split has {have}; raise data.tune_fraction "
                              "or lower vcycle.search_batches")


def search_alpha(run: Context, partner, big, step: Step) -> float:
    """The alpha of ``step``'s grid whose merge scores the lowest loss on the tuning batches (held
    out of training and of the validation split that defines the target); the grid, the choice and
    its cost are logged and charged to the ledger."""
    import time

    from ..engine import evaluate

    grid, batches, k = step.option("grid"), step.option("batches"), step.level
    tick = time.perf_counter()
    scores = [evaluate(interpolate(partner, big, alpha=float(a)), run.data, run.cfg, "tune", batches)["tune_loss"]
              for a in grid]
    choice = grid[min(range(len(grid)), key=scores.__getitem__)]  # the first of equal scores
    seconds = time.perf_counter() - tick
    flops, examples = merge_cost(run.cfg, step, big)  # merge_check made sure the tuning split has them all
    run.charge(flops=flops, wall=seconds)
    run.log.write({"event": "alpha_search", "level": k, "grid": [[float(a), s] for a, s in zip(grid, scores)],
                   "alpha": float(choice), "examples": examples, "flops": flops, "seconds": seconds})
    return float(choice)


@transition("merge", cost=merge_cost, check=merge_check)
def merge(run: Context, state: State, step: Step) -> None:
    """Interpolate the partner with the de-coalesced model: ``(1-alpha) partner + alpha model``,
    adaptive (norms matched, then 0.5/0.5), or ``search`` (the grid's best on the tuning split);
    logs what each ingredient scores on validation."""
    from ..engine import evaluate

    alpha, cfg, k = Alpha.parse(step.option("alpha")), run.cfg, step.level
    big, partner = state.model, state.partners[k]
    weight = search_alpha(run, partner, big, step) if alpha.mode == "search" else alpha.weight
    adaptive = alpha.norms or False
    if adaptive:
        every = norm_ratios(partner, big).values()
        ratios = sorted(r for r in every if r != float("inf")) or [None]  # zero tensors are left as they are
        run.log.write({"event": "adaptive_scale", "level": k, "mode": adaptive, "tensors": len(every),
                       "zero_norm_tensors": sum(r == float("inf") for r in every), "norm_ratio_min": ratios[0],
                       "norm_ratio_median": ratios[len(ratios) // 2], "norm_ratio_max": ratios[-1]})
    merged = run.operator("interpolate", k, lambda: interpolate(
        partner, big, alpha=weight, adaptive=adaptive))
    run.log.write({"event": "interpolated", "level": k,
                   "partner_val_loss": evaluate(partner, run.data, cfg)["val_loss"],
                   "decoalesced_val_loss": evaluate(big, run.data, cfg)["val_loss"],
                   "merged_val_loss": evaluate(merged, run.data, cfg)["val_loss"]})
    if state.optimizer is not None:  # carried moments belong to `big`; move them onto `merged` by name
        state.optimizer = _rebind(state.optimizer, big, merged)
    merged.train()
    run.keep(merged, f"merged{k}")
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


# ----------------------------------------------------------------------------- the method
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


def plan(cfg: RunConfig) -> Plan:
    """The multi-level V-cycle (Zou et al., A.5.2) with K levels::

        for k = 1 .. K-1:  train M_k (E_a); keep M_k as partner_k; M_{k+1} = coalesce(M_k)
        train M_K
        for k = K-1 .. 1:  M_k = interpolate(partner_k, decoalesce(M_{k+1}), alpha); train M_k

    The partner of level k is M_k right before it was coalesced (the reference GPT-2 script used
    the fully trained baseline, a bug not reproduced here). ``optimizer: carry`` maps Adam's
    moments down and up; ``reset`` starts each phase with a fresh AdamW (the paper).
    """
    sizes = needs_vcycle(cfg, "vcycle")
    v, t, K = cfg.vcycle, cfg.train, cfg.vcycle.levels
    if v.down_steps[0] + v.up_steps[-1] > t.steps:  # checked here: only the V-cycle spends this budget
        raise ConfigError(f"budgets do not add up: the V-cycle trains the full model for {v.down_steps[0]} + "
                          f"{v.up_steps[-1]} = {v.down_steps[0] + v.up_steps[-1]} steps, more than the baseline's "
                          f"train.steps {t.steps}")
    lrs = v.lr or [t.lr] * K
    carry = (("carry", v.optimizer == "carry"),)
    items: Plan = [Step("new_model", 1)]
    for k in range(1, K):
        if v.down_steps[k - 1] > 0:
            warm = v.down_warmup[k - 1] if v.down_warmup else v.down_steps[k - 1]
            items.append(Phase(f"down{k}", k, v.down_steps[k - 1], lrs[k - 1], warm, sizes=sizes[k - 1]))
        external = (("external", v.partner.format(seed=cfg.seed)),) if v.partner and k == 1 else ()
        items += [Step("keep_partner", k, external), Step("choose_scheme", k), Step("coalesce", k, carry)]
    items.append(Phase("small", K, v.small_steps, lrs[K - 1], v.small_warmup, sizes=sizes[K - 1],
                      kind=v.small_schedule))
    up = carry + (("path", v.up_path),) + ((("tie_break", v.tie_break),) if v.tie_break else ())
    for k in range(K - 1, 0, -1):
        i = K - 1 - k
        merge_options = (("alpha", v.alpha),) + ((("grid", tuple(v.alpha_grid)), ("batches", v.search_batches))
                                                  if Alpha.parse(v.alpha).mode == "search" else ())
        items += [Step("decoalesce", k, up), Step("merge", k, merge_options),
                 Step("measure_symmetry", k, (("when", "merged"),)),
                 Phase(f"up{k}", k, v.up_steps[i], lrs[k - 1], v.up_warmup[i] if v.up_warmup else 0,
                       sizes=sizes[k - 1]),
                 Step("measure_symmetry", k, (("when", f"after up{k}"),))]
    return items


METHOD = register(Method("vcycle", plan, title="V-cycle", reads=("vcycle",), describe=_describe_vcycle,
                         run_name=_vcycle_name, marker="o",
                         summary="coalesce after E_a, train the small model, de-coalesce and interpolate with the "
                                 "partner, continue (K levels)",
                         preserves="de-coalescing in width (copy up-path), not the interpolation",
                         costs="M_k kept in memory beside the small model; a searched alpha's forward passes (charged)"))
