"""StackBERT, progressive stacking (Gong et al., ICML 2019): start with 1/2^k of the layers, train
each stage for its ``steps`` on the full model's LR schedule, then double the depth by stacking the
whole stack on top of itself (layer i + L starts as a copy of layer i), k times, and finish the
schedule with the full model. G_stack (``stack``) is its one-stage case with a fresh optimizer;
here the optimizer is ``reset`` at each stacking or ``carry``-ed with the layers (the copies take
their source layers' Adam moments and step). Not function-preserving."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ConfigError, MethodSettings, RunConfig, method_settings, one_of, positive, tag
from ..models import model_sizes
from ..phase import Phase
from .base import OPTIMIZER_CHOICES, Method, Plan, Step, register


@method_settings("stackbert")
@dataclass
class StackBERTSettings(MethodSettings):
    """The ``stackbert`` section: one entry of ``steps`` per doubling (the stage trained before it)."""

    steps: list = field(default_factory=list)  # steps of each stage before its stacking (k stages: 1/2^k of the layers)
    rewarmup: int = 0  # linear re-warm-up into the schedule after each stacking
    optimizer: str = "reset"  # reset | carry
    tag: str = ""

    def validate(self, cfg: RunConfig) -> None:
        if not isinstance(self.steps, list) or not self.steps:
            raise ConfigError(f"stackbert.steps needs one entry per doubling of the depth, got {self.steps!r}")
        for i, s in enumerate(self.steps):
            positive(s, f"stackbert.steps[{i}]")
        positive(self.rewarmup, "stackbert.rewarmup", zero_ok=True)
        one_of(self.optimizer, "stackbert.optimizer", OPTIMIZER_CHOICES)
        tag(self.tag, "stackbert.tag")
        # The layers (divisible by 2^k) and the budget are checked when the plan is built.


def plan(cfg: RunConfig) -> Plan:
    if cfg.stackbert is None:
        raise ConfigError("method 'stackbert' needs the config's stackbert section (steps, rewarmup, optimizer)")
    t, st, full = cfg.train, cfg.stackbert, model_sizes(cfg)
    k = len(st.steps)
    if full.layers % 2 ** k:
        raise ConfigError(f"stackbert: {k} doublings need model.layers divisible by {2 ** k}, got {full.layers}")
    if sum(st.steps) >= t.steps:
        raise ConfigError(f"stackbert.steps add up to {sum(st.steps)}, leaving no steps of train.steps {t.steps} "
                          "for the full model")
    carry = (("carry", st.optimizer == "carry"),)
    sizes = [full.replace(layers=full.layers // 2 ** (k - i)) for i in range(k + 1)]  # stage i's model
    items: Plan = [Step("new_model", 1, (("sizes", sizes[0]),))]
    start = 0
    for i in range(k + 1):
        if i:
            items.append(Step("stack", i, (("factor", 2),) + carry))
        steps = st.steps[i] if i < k else t.steps - start
        items.append(Phase(f"stage{i}", i + 1, steps, t.lr, t.warmup, horizon=t.steps, start=start,
                           rewarmup=st.rewarmup if i else 0, sizes=sizes[i]))
        start += steps
    return items


def _describe(config: dict) -> dict:
    st = config["stackbert"]
    doublings = len(st["steps"])
    return {"levels": doublings + 1, "scheme": f"{doublings} doubling" + "s" * (doublings > 1),
            "optimizer": st["optimizer"], "budget": st.get("tag") or "preset"}


def _run_name(cfg: RunConfig) -> str:
    st = cfg.stackbert
    return f"stackbert-{len(st.steps)}x-{st.optimizer}" + (f"-{st.tag}" if st.tag else "")


METHOD = register(Method("stackbert", plan, title="StackBERT", reads=("stackbert",), describe=_describe,
                         run_name=_run_name, marker="P",
                         summary="progressive stacking: double the depth by stacking, k times, optimizer reset or "
                                 "carried",
                         preserves="no (each stacking changes the function)", costs="-"))
