"""LiGO (Wang et al., ICLR 2023): a model of 1/width of the units and 1/depth of the layers trained for
``ligo.steps`` on the full model's LR schedule, then grown by a learned linear operator
(:mod:`mlresearch.operators.ligo`: width expansion matrices per space and mode, the hidden space's
shared by every block, depth a learned mix of the small model's blocks), initialised to FPI +
stacking and fitted for ``ligo.fit_steps`` Adam steps at ``ligo.fit_lr`` on the large model's loss
over training batches (the small model frozen), then the materialised large model trained to
``train.steps``, re-entering the schedule through ``rewarmup`` steps with a fresh optimizer (the
paper carries no optimizer state). Each fitting step is charged one training step of the large
model (its forward and backward; the operator's own products are not counted), in ``--plan`` and
the ledger alike; the fitting batches advance the data stream. Not function-preserving once fitted."""

from __future__ import annotations

from dataclasses import dataclass

from ...data.datasets import batch_indices, make_batch
from ...operators.ligo import LinearGrowth, fit
from ...tasks import task_of
from ..config import ConfigError, MethodSettings, RunConfig, method_settings, number, positive
from ..flops import train_flops_per_example
from ..models import model_sizes
from ..phase import Phase
from .base import Context, Method, Plan, State, Step, check_small_then_grown, grow, register, shrunk, transition


@method_settings("ligo")
@dataclass
class LiGOSettings(MethodSettings):
    """The ``ligo`` section."""

    steps: int = 0  # steps of the small model before it is grown
    width: int = 2  # the small model has 1/width of the heads, KV heads, hidden and FFN units
    depth: int = 2  # and 1/depth of the layers
    fit_steps: int = 100  # Adam steps fitting the operator on the large model's loss (the paper's 100)
    fit_lr: float = 1e-3  # their learning rate
    rewarmup: int = 0
    tag: str = ""

    def validate(self, cfg: RunConfig) -> None:
        check_small_then_grown("ligo", self)
        positive(self.fit_steps, "ligo.fit_steps")
        number(self.fit_lr, "ligo.fit_lr", 0, low_open=True)


def fit_cost(cfg: RunConfig, step: Step, model) -> tuple[float, int]:
    """One training step of the large model (``model``, the step's level) per fitting step."""
    n = step.option("fit_steps") * cfg.train.batch_size
    return n * train_flops_per_example(model, task_of(cfg.task).seq_len(cfg)), n


@transition("ligo", cost=fit_cost)
def ligo_step(run: Context, state: State, step: Step) -> None:
    """Fit the growth operator on training batches, charge it, and continue with the large model."""
    cfg, data, fit_steps = run.cfg, run.data, step.option("fit_steps")

    def grow_with_ligo(model, optimizer):
        operator = LinearGrowth(model, step.option("width"), step.option("depth"))
        device, start, b = next(model.parameters()).device, run.data_step, cfg.train.batch_size
        operator.to(device)

        def batch(i):  # the training stream's next batches, as the next phase would have drawn them
            idx = batch_indices(len(data.train), b, start + i, cfg.seed)
            return {k: v.to(device) for k, v in make_batch(data, "train", idx, start + i, cfg.seed).items()}

        losses = fit(operator, lambda op, inputs: task_of(data.task).loss(op, inputs)[0],
                     (batch(i) for i in range(fit_steps)), step.option("lr"))
        flops, examples = fit_cost(cfg, step, operator.skeleton)
        run.charge(flops=flops, data_steps=fit_steps)
        run.log.write({"event": "ligo_fit", "level": step.level, "steps": fit_steps, "examples": examples,
                       "flops": flops, "loss_first": losses[0], "loss_last": losses[-1]})
        return operator.materialise(), None

    grow(run, state, step, "ligo", grow_with_ligo)


def plan(cfg: RunConfig) -> Plan:
    if cfg.ligo is None:
        raise ConfigError("method 'ligo' needs the config's ligo section (steps, width, depth, fit_steps)")
    t, g, full = cfg.train, cfg.ligo, model_sizes(cfg)
    if g.steps >= t.steps:
        raise ConfigError(f"ligo.steps {g.steps} leaves no steps of train.steps {t.steps} for the full model")
    small = shrunk(full, g.width, g.depth, "ligo")
    return [Step("new_model", 1, (("sizes", small),)),
            Phase("stage0", 1, g.steps, t.lr, t.warmup, horizon=t.steps, sizes=small),
            Step("ligo", 2, (("width", g.width), ("depth", g.depth), ("fit_steps", g.fit_steps), ("lr", g.fit_lr))),
            Phase("stage1", 2, t.steps - g.steps, t.lr, t.warmup, horizon=t.steps, start=g.steps,
                  rewarmup=g.rewarmup, sizes=full)]


def _describe(config: dict) -> dict:
    g = config["ligo"]
    return {"levels": 2, "scheme": f"LiGO width x{g['width']}, depth x{g['depth']}, fit {g['fit_steps']}",
            "optimizer": "reset", "budget": g.get("tag") or "preset"}


METHOD = register(Method("ligo", plan, title="LiGO", reads=("ligo",), describe=_describe, marker="h",
                         run_name=lambda cfg: f"ligo-w{cfg.ligo.width}d{cfg.ligo.depth}-fit{cfg.ligo.fit_steps}" +
                         (f"-{cfg.ligo.tag}" if cfg.ligo.tag else ""),
                         summary="train a narrower, shallower model, grow it by a learned linear operator fitted "
                                 "on the large model's loss, continue",
                         preserves="no (FPI + stacking before fitting; the fit changes it)",
                         costs="the fitting steps, one large-model training step each (charged)"))
