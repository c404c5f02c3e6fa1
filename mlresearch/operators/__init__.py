"""Operators on transformer training states: coalesce, de-coalesce, interpolate."""

from .interpolation import interpolate
from .mapping import coalesce, decoalesce, make_plan
from .scheme import Scheme

__all__ = ["Scheme", "coalesce", "decoalesce", "interpolate", "make_plan"]
