"""Operators on transformer training states: coalesce, de-coalesce, interpolate, growth."""

from .growth import (
    NotLossPreservingWarning,
    coalesce_state,
    decoalesce_preserving,
    decoalesce_state,
    depth_growth,
    grow_depth,
    grow_width,
    stack_layers,
    stack_layers_state,
    width_growth,
)
from .interpolation import interpolate, norm_ratios
from .mapping import Transfer, coalesce, decoalesce, make_plan, plan_transfer
from .optim import UnsupportedOptimizerError, map_optimizer, step_multipliers
from .scheme import Scheme

__all__ = [
    "NotLossPreservingWarning",
    "Scheme",
    "Transfer",
    "UnsupportedOptimizerError",
    "coalesce",
    "coalesce_state",
    "decoalesce_preserving",
    "decoalesce",
    "decoalesce_state",
    "depth_growth",
    "grow_depth",
    "grow_width",
    "interpolate",
    "norm_ratios",
    "make_plan",
    "map_optimizer",
    "plan_transfer",
    "step_multipliers",
    "stack_layers",
    "stack_layers_state",
    "width_growth",
]
