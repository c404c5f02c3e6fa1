"""Training: run configs, methods as plans, the runner, LR schedules, the FLOPs ledger.

Importing the package registers every method, and with it every method's config section, so a
config is parsed the same way whichever module is imported first."""

from . import methods  # noqa: F401
