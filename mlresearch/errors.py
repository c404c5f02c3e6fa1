"""Errors that name the problem, so a user can fix their input rather than read a traceback."""


class MLResearchError(Exception):
    """Base class of every error this suite raises on purpose."""


class SchemeError(MLResearchError, ValueError):
    """A coalescing scheme does not fit the model it is applied to."""


class UnsupportedModelError(MLResearchError, TypeError):
    """The model's class has no family spec, or uses a feature the spec does not cover."""


class CheckpointError(MLResearchError, OSError):
    """A checkpoint directory is missing, incomplete or corrupt."""
