"""One phase of a plan: what a method asks for and what the engine trains (one type for both)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .schedules import Offset, Restart, WarmupDecay


@dataclass(frozen=True)
class Phase:
    """Train the current model for ``steps`` under warm-up + decay at peak ``lr``; by default the
    schedule spans the phase. A phase may instead run steps ``start .. start + steps`` of a longer
    schedule of ``horizon`` steps, entered at ``start`` through a linear re-warm-up of ``rewarmup``
    steps (staged training and G_stack after growth)."""

    name: str
    level: int
    steps: int
    lr: float
    warmup: int
    horizon: int | None = None  # a longer schedule this phase runs part of
    start: int = 0  # where in that schedule it begins
    rewarmup: int = 0  # linear re-warm-up into the schedule at ``start``
    trigger: float | None = None  # end early when the loss curve's log-log slope rises above this
    kind: str | None = None  # the LR schedule's shape (linear | cosine | constant); default train.schedule
    sizes: Any = None  # the model's size, for the planned FLOPs (default: the config's model)
    reenter: float | None = None  # start at (where the previous phase ended) / reenter, not at ``start``
    to_end: bool = False  # with ``reenter``: run to the end of the ``horizon``, not ``steps``
    teacher: tuple | None = None  # (alpha, steps, sizes): distil from the plan's teacher (Knowledge Inheritance)
    masks: Any = None  # masks on a grown model's new structures, ramped over the phase's first steps (MSG):
    # ``masks.attach(model)`` hooks them in, ``masks.value(step)`` is their value at a 0-based step, and
    # after ``masks.steps`` steps they are removed (``operators.msg.MaskRamp``)

    def teacher_weight(self, step: int) -> float:
        """The distillation term's weight at the phase's 0-based ``step``: ``alpha`` decayed linearly
        to 0 over ``steps`` (the loss is (1 - w) * task loss + w * KL(teacher || model)); 0 without a
        teacher. Steps of weight 0 run no teacher forward pass."""
        if self.teacher is None:
            return 0.0
        alpha, steps, _ = self.teacher
        return alpha * max(0.0, 1.0 - step / steps)

    def placed(self, position: int) -> "Phase":
        """This phase after a previous one ended at schedule ``position`` (the plan's ``start`` and
        ``steps`` assume every phase ran its planned steps; a trigger may have ended one earlier)."""
        if self.reenter is None:
            return self
        start = int(round(position / self.reenter))
        return replace(self, start=start, steps=self.horizon - start if self.to_end else self.steps)

    def schedule(self, kind: str, floor: float):
        base = WarmupDecay(self.warmup, self.horizon or self.steps, self.kind or kind, floor)
        if not self.start and not self.rewarmup:
            return base
        return Offset(Restart(base, self.start, self.rewarmup), self.start)
