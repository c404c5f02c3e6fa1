"""The control every growth method must beat: the V-cycle's smallest level trained alone from scratch
with the same data, steps and batch as the baseline, at the smallest level's LR. It has no settings
of its own; it reads the ``vcycle`` section for the shape."""

from __future__ import annotations

from ..config import RunConfig
from ..phase import Phase
from .base import Method, Plan, Step, name_part, register
from .vcycle import needs_vcycle


def plan(cfg: RunConfig) -> Plan:
    sizes = needs_vcycle(cfg, "small")
    v, t, K = cfg.vcycle, cfg.train, cfg.vcycle.levels
    lr = v.lr[K - 1] if v.lr else t.lr
    return [Step("new_model", K, (("sizes", sizes[K - 1]),)),
            Phase("small", K, t.steps, lr, t.warmup, sizes=sizes[K - 1])]


def _describe(config: dict) -> dict:
    v = config.get("vcycle") or {}
    return {"levels": v.get("levels"), "scheme": v.get("scheme", "-"), "budget": f"{config['train']['steps']} steps"}


def _run_name(cfg: RunConfig) -> str:
    v = cfg.vcycle
    return f"small-L{v.levels}-{name_part(v.scheme)}" if v else "small"


METHOD = register(Method("small", plan, title="small shape alone", reads=("vcycle",), describe=_describe,
                         run_name=_run_name, marker="v",
                         summary="the V-cycle's smallest shape trained alone (the control growth must beat)",
                         preserves="-", costs="-"))
