"""The baseline: the full model from scratch for the config's budget (the ``train`` section)."""

from __future__ import annotations

from ..config import RunConfig
from ..phase import Phase
from .base import Method, Plan, Step, register


def plan(cfg: RunConfig) -> Plan:
    t = cfg.train
    return [Step("new_model", 1), Phase("baseline", 1, t.steps, t.lr, t.warmup)]


METHOD = register(Method("baseline", plan, title="baseline",
                         summary="the full model from scratch, its LR schedule decayed at the end of its budget",
                         preserves="-", costs="- (the frontier is one such run per budget)"))
