"""Learning-rate multipliers as small picklable callables (for ``torch.optim.lr_scheduler.LambdaLR``).

After growth (staged training, B.5) the schedule of the *large* model is re-positioned at step
``S_r`` (the large model's step count at the small model's loss) with a linear re-warm-up of
``W_r`` steps into it:

    mult(t) = (t - S_r) / W_r * base(S_r + W_r)    for S_r <= t < S_r + W_r
    mult(t) = base(t)                               otherwise

and ``S_r = S_small / constant_op`` (``constant_op``: 1.776 width, 1.412 depth, 2.455 both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


SCHEDULE_KINDS = ("linear", "cosine", "constant")  # train.schedule, vcycle.small_schedule
CONSTANT_OP = {"width": 1.776, "depth": 1.412, "depth_width": 2.455}


@dataclass(frozen=True)
class WarmupDecay:
    """Linear warm-up to 1 over ``warmup`` steps, then linear or cosine decay to ``floor`` at ``total``."""

    warmup: int
    total: int
    kind: str = "linear"
    floor: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"schedule kind must be linear, cosine or constant, got {self.kind!r}")
        if self.warmup < 0 or self.total <= 0 or self.warmup > self.total:
            raise ValueError(f"need 0 <= warmup <= total and total > 0, got warmup={self.warmup}, total={self.total}")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        shape = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.floor + (1.0 - self.floor) * shape


@dataclass(frozen=True)
class Restart:
    """``base`` re-entered at ``restart_step`` through a linear re-warm-up of ``rewarmup`` steps."""

    base: WarmupDecay
    restart_step: int
    rewarmup: int

    def __call__(self, step: int) -> float:
        if self.rewarmup > 0 and self.restart_step <= step < self.restart_step + self.rewarmup:
            return (step - self.restart_step) / self.rewarmup * self.base(self.restart_step + self.rewarmup)
        return self.base(step)


@dataclass(frozen=True)
class Offset:
    """Read ``schedule`` from global step ``start`` on (LambdaLR counts from 0)."""

    schedule: object
    start: int

    def __call__(self, step: int) -> float:
        return self.schedule(self.start + step)


def restart_step(small_steps: int, constant_op: float | str) -> int:
    """S_r = S_small / constant_op (the large model's step at the same loss)."""
    c = CONSTANT_OP[constant_op] if isinstance(constant_op, str) else float(constant_op)
    return int(round(small_steps / c))
