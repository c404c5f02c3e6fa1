"""Staged training (Shen et al., ICML 2022): the config's model shrunk by ``staged.grow``, trained for
each stage's steps on the full model's LR schedule, grown x2 with the training state (width: the
block-diagonal operator; depth: identity blocks), the schedule re-entered at S_r = position /
constant_op through a ``rewarmup``, until ``train.steps``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...families import Sizes
from ...operators import grow_depth, grow_width
from ..config import ConfigError, MethodSettings, RunConfig, flag, method_settings, number, one_of, positive, tag
from ..models import model_sizes
from ..schedules import CONSTANT_OP
from ..trigger import THRESHOLDS
from ..phase import Phase
from .base import Context, Method, Plan, State, Step, grow, register, transition


@method_settings("staged")
@dataclass
class StagedSettings(MethodSettings):
    """The ``staged`` section: start from the config's model shrunk by the growths, train each stage
    for its ``steps``, grow x2 (``width`` or ``depth``, Adam state carried), and re-enter the full
    model's LR schedule at S_r = position / constant_op with a ``rewarmup``; the last stage runs to
    ``train.steps`` of that schedule."""

    grow: list = field(default_factory=lambda: ["width"])  # growths in order: width | depth
    steps: list = field(default_factory=list)  # steps of each stage before its growth
    rewarmup: int = 0  # W_r
    constant_op: list | None = None  # S_small / S_large at equal loss per growth (default: the paper's)
    depth_where: str = "alternate"  # new blocks: alternate (2i+1) or append
    trigger: bool = False  # grow when the loss curve says so (B.6); each stage's steps are then its most
    thresholds: list | None = None  # the trigger's slope threshold per growth (default: the paper's)
    tag: str = ""

    def validate(self, cfg: RunConfig) -> None:
        st = self
        if not isinstance(st.grow, list) or not st.grow or any(g not in ("width", "depth") for g in st.grow):
            raise ConfigError(f"staged.grow must be a non-empty list of 'width' / 'depth', got {st.grow!r}")
        if not isinstance(st.steps, list) or len(st.steps) != len(st.grow):
            raise ConfigError(f"staged.steps needs one entry per growth ({len(st.grow)}), got {st.steps!r}")
        for i, s in enumerate(st.steps):
            positive(s, f"staged.steps[{i}]")
        positive(st.rewarmup, "staged.rewarmup", zero_ok=True)
        if st.constant_op is not None:
            if not isinstance(st.constant_op, list) or len(st.constant_op) != len(st.grow):
                raise ConfigError(f"staged.constant_op needs one entry per growth, got {st.constant_op!r}")
            for i, c in enumerate(st.constant_op):
                number(c, f"staged.constant_op[{i}]", 0, low_open=True)
        flag(st.trigger, "staged.trigger")
        if st.thresholds is not None:
            if not isinstance(st.thresholds, list) or len(st.thresholds) != len(st.grow):
                raise ConfigError(f"staged.thresholds needs one slope per growth ({len(st.grow)}), got {st.thresholds!r}")
            for i, t in enumerate(st.thresholds):
                number(t, f"staged.thresholds[{i}]", float("-inf"), 0, high_open=True)
        one_of(st.depth_where, "staged.depth_where", ("alternate", "append"))
        tag(st.tag, "staged.tag")
        # The shapes (they must halve) and the budget are checked when the staged plan is built: they
        # involve the model and train sections, which a run of another method may change freely.


def staged_sizes(cfg: RunConfig) -> list[Sizes]:
    """The model's size in each stage of staged training: the config's model shrunk by every growth,
    then grown back one growth at a time (the last entry is the config's size)."""
    st, sizes = cfg.staged, [model_sizes(cfg)]
    for growth in reversed(st.grow):
        s = sizes[0]
        if growth == "width":
            if s.heads % 2 or s.kv_heads % 2 or s.hidden % 2 or s.ffn % 2:
                raise ConfigError(f"staged width growth needs an even number of heads, KV heads, hidden and FFN "
                                  f"units at every stage; {s} is not")
            sizes.insert(0, s.replace(heads=s.heads // 2, kv_heads=s.kv_heads // 2, hidden=s.hidden // 2,
                                      ffn=s.ffn // 2))
        else:
            if s.layers % 2:
                raise ConfigError(f"staged depth growth needs an even number of layers at every stage; {s} is not")
            sizes.insert(0, s.replace(layers=s.layers // 2))
    return sizes


def staged_schedule(cfg: RunConfig) -> list[tuple[int, int]]:
    """Per stage, (where it enters the full model's LR schedule, how many steps it trains): stage 0
    starts at 0; after a growth the schedule is re-entered at S_r = position / constant_op (B.5)."""
    st, out, position = cfg.staged, [], 0
    constants = st.constant_op or [CONSTANT_OP[g] for g in st.grow]
    for steps, c in zip(st.steps, constants):
        out.append((position, steps))
        position = int(round((position + steps) / c))
    out.append((position, cfg.train.steps - position))
    return out


@transition("grow_width")
def grow_width_step(run: Context, state: State, step: Step) -> None:
    """Width x2 the staged-training way (block-diagonal matrices; function kept)."""
    grow(run, state, step, "grow_width", lambda m, o: grow_width(m, o))


@transition("grow_depth")
def grow_depth_step(run: Context, state: State, step: Step) -> None:
    """Depth x2 with identity blocks (zero residual writers; function kept in pre-norm blocks)."""
    grow(run, state, step, "grow_depth", lambda m, o: grow_depth(m, o, where=step.option("where", "alternate")))


def _describe_staged(config: dict) -> dict:
    st = config["staged"]
    return {"levels": len(st["grow"]) + 1, "scheme": "grow " + "+".join(st["grow"]) +
            (" on trigger" if st.get("trigger") else ""), "optimizer": "carry", "budget": st.get("tag") or "preset"}


def plan(cfg: RunConfig) -> Plan:
    """The stages, growths and schedule positions (module docstring). With ``staged.trigger`` a stage grows
    as soon as its loss curve's slope passes the growth's threshold (B.6), its ``steps`` only a cap; the
    plan shows the schedule if no trigger fires."""
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
    items: Plan = [Step("new_model", 1, (("sizes", sizes[0]),))]
    for i, (start, steps) in enumerate(schedule):
        if i:
            growth = st.grow[i - 1]
            items.append(Step(f"grow_{growth}", i, (("where", st.depth_where),) if growth == "depth" else ()))
        items.append(Phase(f"stage{i}", i + 1, steps, t.lr, t.warmup, horizon=t.steps, start=start,
                           rewarmup=st.rewarmup if i else 0, sizes=sizes[i],
                           trigger=thresholds[i] if st.trigger and i < last else None,
                           reenter=constants[i - 1] if i else None, to_end=i == last))
    return items


METHOD = register(Method("staged", plan, title="staged training", reads=("staged",), describe=_describe_staged,
                         run_name=lambda cfg: f"staged-{'-'.join(cfg.staged.grow)}" +
                         (f"-{cfg.staged.tag}" if cfg.staged.tag else ""), marker="D",
                         summary="grow x2 in width or depth with the whole training state, re-entering the LR "
                                 "schedule (loss-preserving)",
                         preserves="yes: width exactly; depth in pre-norm models (identity blocks)",
                         costs="-"))
