"""G_stack (Du et al. 2024): 1/factor of the layers for ``stack.steps`` on the full model's schedule,
the whole stack copied ``factor`` times, then a fresh optimizer re-entering the schedule at that step
through ``rewarmup`` steps, to ``train.steps``."""

from __future__ import annotations

from dataclasses import dataclass

from ...operators import stack_layers, stack_layers_state
from ..config import ConfigError, MethodSettings, RunConfig, method_settings, positive, tag
from ..models import model_sizes
from ..phase import Phase
from .base import Context, Method, Plan, State, Step, grow, register, transition


@method_settings("stack")
@dataclass
class StackSettings(MethodSettings):
    """The ``stack`` section."""

    factor: int = 2
    steps: int = 0
    rewarmup: int = 0
    tag: str = ""

    def validate(self, cfg: RunConfig) -> None:
        positive(self.factor, "stack.factor")
        positive(self.steps, "stack.steps")
        positive(self.rewarmup, "stack.rewarmup", zero_ok=True)
        if self.factor < 2:
            raise ConfigError(f"stack.factor must be >= 2, got {self.factor}")
        tag(self.tag, "stack.tag")


@transition("stack")
def stack_step(run: Context, state: State, step: Step) -> None:
    """Copy the whole layer stack ``factor`` times; the optimizer starts afresh, or with ``carry``
    each copied layer takes its source layer's Adam state (progressive stacking that keeps it)."""
    factor = step.option("factor")
    if step.option("carry") and state.optimizer is not None:
        grow(run, state, step, "stack", lambda m, o: stack_layers_state(m, o, factor))
    else:
        grow(run, state, step, "stack", lambda m, o: (stack_layers(m, factor), None))


def plan(cfg: RunConfig) -> Plan:
    if cfg.stack is None:
        raise ConfigError("method 'stack' needs the config's stack section (factor, steps, rewarmup)")
    t, st, full = cfg.train, cfg.stack, model_sizes(cfg)
    if full.layers % st.factor:
        raise ConfigError(f"stack.factor {st.factor} does not divide model.layers {full.layers}")
    if st.steps >= t.steps:
        raise ConfigError(f"stack.steps {st.steps} leaves no steps of train.steps {t.steps} for the full model")
    small = full.replace(layers=full.layers // st.factor)
    return [Step("new_model", 1, (("sizes", small),)),
            Phase("stage0", 1, st.steps, t.lr, t.warmup, horizon=t.steps, sizes=small),
            Step("stack", 1, (("factor", st.factor),)),
            Phase("stage1", 2, t.steps - st.steps, t.lr, t.warmup, horizon=t.steps, start=st.steps,
                  rewarmup=st.rewarmup, sizes=full)]


def _describe(config: dict) -> dict:
    sk = config["stack"]
    return {"levels": 2, "scheme": f"G_stack x{sk['factor']}", "optimizer": "reset", "budget": sk.get("tag") or "preset"}


METHOD = register(Method("stack", plan, title="G_stack", reads=("stack",), describe=_describe, marker="s",
                         run_name=lambda cfg: f"stack-x{cfg.stack.factor}" + (f"-{cfg.stack.tag}" if cfg.stack.tag else ""),
                         summary="train 1/factor of the layers, copy the stack factor times, continue",
                         preserves="no (a copied stack computes something else)", costs="- (the optimizer restarts)"))
