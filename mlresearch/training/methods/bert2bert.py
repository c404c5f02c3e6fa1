"""bert2BERT (Chen et al., ACL 2022): a small model of 1/width of the heads, hidden and FFN units and
1/depth of the layers trained for ``bert2bert.steps`` on the full model's LR schedule, widened to
the full width with the paper's **FPI** (function-preserving initialisation: every unit copied, the
inputs reading it divided by the number of copies; Net2Net for attention heads, FFN and hidden) or
**AKI** (advanced knowledge initialisation: as FPI, but the new units of every block below the top
one come from the block above, which breaks FPI's symmetry and does not keep the function), then
deepened to the full depth by stacking (the whole stack copied, as StackBERT), and trained to
``train.steps``, re-entering the schedule through ``rewarmup`` steps.

In the paper the small model is an already pre-trained one and the large model starts its own
training from the expanded weights, so its optimizer starts afresh: ``optimizer: reset`` is the
paper's, ``carry`` maps Adam's state with the weights (the new units take the moments of the
units they were copied from, the layer above's under AKI). The paper's two-stage pre-training
(sub-models of the large model trained first) is not implemented: this is bert2BERT's
initialisation inside the fair runner, with the other methods' small shape and schedule."""

from __future__ import annotations

from dataclasses import dataclass

from ...operators import grow_width
from ..config import ConfigError, MethodSettings, RunConfig, method_settings
from ..models import model_sizes
from ..phase import Phase
from .base import Context, Method, Plan, State, Step, check_small_then_grown, grow, register, shrunk, transition

INITS = {"fpi": "split", "aki": "aki"}  # bert2bert.init -> the width operator's init


@method_settings("bert2bert")
@dataclass
class Bert2BertSettings(MethodSettings):
    """The ``bert2bert`` section."""

    init: str = "aki"  # fpi | aki
    steps: int = 0  # steps of the small model before it is expanded
    width: int = 2  # the small model has 1/width of the heads, KV heads, hidden and FFN units (1: no widening)
    depth: int = 2  # and 1/depth of the layers, stacked back (1: no stacking)
    rewarmup: int = 0  # linear re-warm-up into the schedule after the expansion
    optimizer: str = "reset"  # reset (the paper's) | carry
    tag: str = ""

    def validate(self, cfg: RunConfig) -> None:
        if self.init not in INITS:
            raise ConfigError(f"bert2bert.init must be 'fpi' or 'aki', got {self.init!r}")
        check_small_then_grown("bert2bert", self)


@transition("expand_width")
def expand_width(run: Context, state: State, step: Step) -> None:
    """Widen by ``factor`` with bert2BERT's FPI or AKI; Adam's state mapped along with ``carry``."""
    factor, init, carry = step.option("factor"), INITS[step.option("init")], step.option("carry")
    # grow_width maps the optimizer it is given and returns None for None: a reset drops it
    grow(run, state, step, "expand_width", lambda m, o: grow_width(m, o if carry else None, factor=factor, init=init))


def plan(cfg: RunConfig) -> Plan:
    if cfg.bert2bert is None:
        raise ConfigError("method 'bert2bert' needs the config's bert2bert section (init, steps, width, depth)")
    t, b, full = cfg.train, cfg.bert2bert, model_sizes(cfg)
    if b.steps >= t.steps:
        raise ConfigError(f"bert2bert.steps {b.steps} leaves no steps of train.steps {t.steps} for the full model")
    w, small = b.width, shrunk(full, b.width, b.depth, "bert2bert")
    carry = (("carry", b.optimizer == "carry"),)
    items: Plan = [Step("new_model", 1, (("sizes", small),)),
                   Phase("stage0", 1, b.steps, t.lr, t.warmup, horizon=t.steps, sizes=small)]
    if w > 1:
        items.append(Step("expand_width", 1, (("init", b.init), ("factor", w)) + carry))
    if b.depth > 1:
        items.append(Step("stack", 1, (("factor", b.depth),) + carry))
    items.append(Phase("stage1", 2, t.steps - b.steps, t.lr, t.warmup, horizon=t.steps, start=b.steps,
                       rewarmup=b.rewarmup, sizes=full))
    return items


def _describe(config: dict) -> dict:
    b = config["bert2bert"]
    return {"levels": 2, "scheme": f"{b['init'].upper()} width x{b['width']}, stack x{b['depth']}",
            "optimizer": b["optimizer"], "budget": b.get("tag") or "preset"}


def _run_name(cfg: RunConfig) -> str:
    b = cfg.bert2bert
    return f"bert2bert-{b.init}-w{b.width}d{b.depth}-{b.optimizer}" + (f"-{b.tag}" if b.tag else "")


METHOD = register(Method("bert2bert", plan, title="bert2BERT", reads=("bert2bert",), describe=_describe,
                         run_name=_run_name, marker="X",
                         summary="train a narrower, shallower model, widen it (FPI: function kept; AKI: new units "
                                 "from the layer above), stack it to full depth, continue",
                         preserves="FPI: the widening exactly (AKI: no); the stacking: no",
                         costs="- (the optimizer restarts, or is carried)"))
