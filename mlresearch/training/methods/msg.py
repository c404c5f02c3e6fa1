"""MSG, Masked Structural Growth (Yao et al., ICLR 2024): a model of 1/width of the heads, hidden and
FFN units and 1/depth of the layers (the other comparison methods' small shape) trained for
``msg.steps`` on the full model's LR schedule, grown to the full model with every new head, neuron,
hidden unit and block masked (:mod:`mlresearch.operators.msg`: strictly function-preserving at the
growth whatever the new weights are, LayerNorm included, pre- and post-norm), then trained on to
``train.steps`` on the same schedule (MSG's is continuous: ``rewarmup`` 0 by default) while the masks
ramp linearly from 0 to 1 over ``msg.ramp`` steps; after the ramp the model is the plain full model.

``optimizer: carry`` is the paper's (the old parameters keep Adam's moments and step, new entries
start at zero); ``reset`` starts afresh. The paper grows one dimension at a time on a schedule of
several stages; here every dimension grows at once, at the point the other methods grow, so that
the rows compare methods on one schedule. The masked units compute from the growth on, so the
ramp's steps cost the full model's FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

from ...families import family_of
from ...operators.msg import MaskRamp, masked_growth
from ..config import (
    ConfigError,
    MethodSettings,
    RunConfig,
    method_settings,
    positive,
)
from ..models import model_sizes
from ..phase import Phase
from .base import Context, Method, Plan, State, Step, check_small_then_grown, grow, register, shrunk, transition


@method_settings("msg")
@dataclass
class MSGSettings(MethodSettings):
    """The ``msg`` section."""

    steps: int = 0  # steps of the small model before it is grown
    width: int = 2  # the small model has 1/width of the heads, KV heads, hidden and FFN units
    depth: int = 2  # and 1/depth of the layers
    ramp: int = 100  # steps over which the masks rise from 0 to 1 after the growth
    rewarmup: int = 0
    optimizer: str = "carry"  # carry (the paper's) | reset
    tag: str = ""

    def validate(self, cfg: RunConfig) -> None:
        check_small_then_grown("msg", self)
        positive(self.ramp, "msg.ramp")


@transition("msg_grow")
def msg_grow(run: Context, state: State, step: Step) -> None:
    """Grow with every new structure masked; the validation loss after is read with the masks at 0."""
    width, depth, carry = step.option("width"), step.option("depth"), step.option("carry")
    ramp = MaskRamp(width, family_of(state.model).sizes(state.model).layers, step.option("ramp"))
    grow(run, state, step, "msg_grow",
         lambda m, o: masked_growth(m, o if carry else None, width=width, depth=depth, seed=run.cfg.seed),
         under=lambda model: ramp.attach(model).at(0.0))


def plan(cfg: RunConfig) -> Plan:
    if cfg.msg is None:
        raise ConfigError("method 'msg' needs the config's msg section (steps, width, depth, ramp)")
    t, m, full = cfg.train, cfg.msg, model_sizes(cfg)
    if m.steps >= t.steps:
        raise ConfigError(f"msg.steps {m.steps} leaves no steps of train.steps {t.steps} for the full model")
    if m.ramp > t.steps - m.steps:
        raise ConfigError(f"msg.ramp {m.ramp} is longer than the {t.steps - m.steps} steps after the growth")
    small = shrunk(full, m.width, m.depth, "msg")
    return [Step("new_model", 1, (("sizes", small),)),
            Phase("stage0", 1, m.steps, t.lr, t.warmup, horizon=t.steps, sizes=small),
            Step("msg_grow", 1, (("width", m.width), ("depth", m.depth), ("ramp", m.ramp),
                                 ("carry", m.optimizer == "carry"))),
            Phase("stage1", 2, t.steps - m.steps, t.lr, t.warmup, horizon=t.steps, start=m.steps,
                  rewarmup=m.rewarmup, sizes=full, masks=MaskRamp(m.width, small.layers, m.ramp))]


def _describe(config: dict) -> dict:
    m = config["msg"]
    return {"levels": 2, "scheme": f"width x{m['width']}, depth x{m['depth']}, ramp {m['ramp']}",
            "optimizer": m["optimizer"], "budget": m.get("tag") or "preset"}


def _run_name(cfg: RunConfig) -> str:
    m = cfg.msg
    return f"msg-w{m.width}d{m.depth}-r{m.ramp}-{m.optimizer}" + (f"-{m.tag}" if m.tag else "")


METHOD = register(Method("msg", plan, title="MSG", reads=("msg",), describe=_describe, run_name=_run_name,
                         marker="P",
                         summary="train a narrower, shallower model, grow it with every new unit and block masked, "
                                 "ramp the masks from 0 to 1 while training on",
                         preserves="yes, exactly, whatever the new weights (LayerNorm included, pre- and post-norm)",
                         costs="- (the masked units compute from the growth on)"))
