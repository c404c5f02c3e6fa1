"""Knowledge Inheritance (Qin et al., NAACL 2022): a smaller teacher (1/width of the units, 1/depth of
the layers: the other methods' small shape) trained for ``ki.teacher_steps`` on its own LR schedule,
decayed to its end, then the full model trained from scratch for ``train.steps`` with the loss
(1 - w) * task loss + w * KL(teacher || model), the inheritance weight w decayed linearly from
``ki.alpha`` to 0 over ``ki.steps`` steps (the paper's linear decay of the inheritance rate). Each
step of weight above 0 runs the teacher's forward pass and is charged its FLOPs; after ``ki.steps``
the teacher is not run. The student's ``train_loss`` rows are that objective; its validation loss is
the task's alone. Nothing is copied between the models, so no function is kept: the teacher
guides the student through the loss alone."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, MethodSettings, RunConfig, method_settings, number, positive, tag
from ..models import model_sizes
from ..phase import Phase
from .base import Context, Method, Plan, State, Step, register, shrunk, transition


@method_settings("ki")
@dataclass
class KISettings(MethodSettings):
    """The ``ki`` section."""

    teacher_steps: int = 0  # the teacher's own training, its schedule decayed at its end
    alpha: float = 0.5  # the distillation term's weight at the student's first step
    steps: int = 0  # student steps over which the weight decays linearly to 0
    width: int = 2  # the teacher has 1/width of the heads, KV heads, hidden and FFN units
    depth: int = 2  # and 1/depth of the layers
    tag: str = ""

    def validate(self, cfg: RunConfig) -> None:
        positive(self.teacher_steps, "ki.teacher_steps")
        number(self.alpha, "ki.alpha", 0, 1, low_open=True)
        positive(self.steps, "ki.steps")
        positive(self.width, "ki.width")
        positive(self.depth, "ki.depth")
        tag(self.tag, "ki.tag")
        # The teacher's shape (divisible by width and depth) is checked when the plan is built.


@transition("keep_teacher")
def keep_teacher(run: Context, state: State, step: Step) -> None:
    """The trained model becomes the teacher (no gradients, evaluation mode); the next model starts afresh."""
    state.teacher = run.operator("keep_teacher", step.level, lambda: state.model.eval().requires_grad_(False))
    state.model, state.optimizer = None, None


def plan(cfg: RunConfig) -> Plan:
    if cfg.ki is None:
        raise ConfigError("method 'ki' needs the config's ki section (teacher_steps, alpha, steps)")
    t, k, full = cfg.train, cfg.ki, model_sizes(cfg)
    small = shrunk(full, k.width, k.depth, "ki")
    return [Step("new_model", 1, (("sizes", small),)),
            Phase("teacher", 1, k.teacher_steps, t.lr, min(t.warmup, k.teacher_steps // 2), sizes=small),
            Step("keep_teacher", 1),
            Step("new_model", 2, (("sizes", full),)),
            Phase("student", 2, t.steps, t.lr, t.warmup, sizes=full, teacher=(k.alpha, k.steps, small))]


def _describe(config: dict) -> dict:
    k = config["ki"]
    return {"levels": 2, "scheme": f"teacher 1/{k['width']} width, 1/{k['depth']} depth, {k['teacher_steps']} steps",
            "alpha": f"{k['alpha']} to 0 over {k['steps']}", "budget": k.get("tag") or "preset"}


METHOD = register(Method("ki", plan, title="Knowledge Inheritance", reads=("ki",), describe=_describe, marker="*",
                         run_name=lambda cfg: f"ki-a{cfg.ki.alpha}-s{cfg.ki.steps}" + (f"-{cfg.ki.tag}" if cfg.ki.tag
                                                                                        else ""),
                         summary="train a small teacher, then the full model from scratch with a distillation term "
                                 "from it, its weight decayed to 0",
                         preserves="- (nothing is copied)",
                         costs="the teacher's training and its forward pass on every distilling step (charged)"))
