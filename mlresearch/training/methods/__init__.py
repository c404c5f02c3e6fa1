"""Methods as plans: a method is a function from the config to a plan, an ordered list of training
phases and named transitions; one runner (:func:`execute`) carries one state through any plan.

**A method is one file** in this package: its plan function, its settings (a ``MethodSettings``
dataclass registered with ``config.method_settings("<name>")``, with its own ``validate``; the YAML
section of that name), the transitions only it uses (``@transition``), and at its end
``METHOD = register(Method(name, plan, title=..., summary=..., preserves=..., costs=..., reads=...,
describe=..., run_name=...))``: its name, how tables, figures and the README's methods list call it, the config sections it reads, the table columns that tell
its variants apart and its run directory's name. Adding one is that file plus its import line below;
``tests/test_methods.py`` then runs it end to end on the smoke preset and checks its ledger equals its
plan. Nothing outside its file names it.

Resume needs nothing of its own: the runner replays the plan from the start, loading every phase
that its checkpoint says is done, and transitions are deterministic functions of the state, so
what they rebuild (partners, schemes, merged models) is what the killed run had.
"""

from __future__ import annotations

# The registry: each import adds one method (in the order tables and `mlresearch plan` list them).
from . import baseline, vcycle, small, staged, stack, stackbert, bert2bert, ki, ligo, msg  # noqa: F401,I001 (this order: the config's sections)
from ..phase import Phase
from .base import METHODS, TRANSITIONS, Context, Method, Plan, State, Step, register, title_of, transition
from .planning import (H100_BF16_DENSE_TFLOPS, build_plan, check_plan, describe_run, execute, format_cost,
                       format_plan, methods_markdown, planned_ledger)

__all__ = ["H100_BF16_DENSE_TFLOPS", "METHODS", "TRANSITIONS", "Context", "Method", "Phase", "Plan", "State", "Step", "build_plan",
           "check_plan",
           "describe_run", "execute", "format_cost", "format_plan", "methods_markdown", "planned_ledger", "register", "title_of",
           "transition"]
