"""A run's record: what the run was (method, variant, experiment, task, seed, each phase's model
shape, the data's sources) and what it measured (FLOPs, tokens, wall time, final losses, tokens per
parameter of the full model), as one typed object. The study tables (and the notebooks, through
them), the frontier, ``downstream``, the regime check and the study runner read a run through
:meth:`RunRecord.read`: no run directory's name and no data-source string is parsed back.
(``compare``, the pairwise check of two runs, reads their metrics and configs themselves.)

On disk the record is the run's ``summary.json``, written once, when the run finishes (its presence
is what "finished" means; :func:`finished`). Summaries written before they carried the descriptive
fields (``task``, ``variant``, ``data_sources``, each phase's ``shape``, the parameter counts) get
them from the run's own ``config.yaml`` when read, so one reader serves every run in results/.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from ..checkpoint import read_structured
from ..errors import MLResearchError
from ..families.base import Sizes
from .config import load_config
from .engine import read_metrics
from .methods import describe_run, planned_ledger
from .models import parameter_counts

SUMMARY = "summary.json"


class RecordError(MLResearchError, ValueError):
    """A run directory without a readable record (unfinished, or its files damaged)."""


def finished(run: str | Path) -> bool:
    """The run wrote its record: it finished."""
    return (Path(run) / SUMMARY).is_file()


def data_sources(data: dict) -> list[str]:
    """What a run's data section trains on: its local ``path``, else its corpora (a name or a list)."""
    if data.get("path"):
        return [str(data["path"])]
    corpus = data.get("corpus") or []
    return [corpus] if isinstance(corpus, str) else [str(c) for c in corpus]


def describe(cfg, method: str, phase_shapes: dict, vocab_size: int | None = None) -> dict:
    """The descriptive fields a finishing run adds to its summary: its task, the choices that set
    its variant apart, the corpora it trained on, each phase's model shape, and the full model's
    parameter counts (all, and less the embeddings; ``vocab_size``: the data's, else the config's)."""
    params = parameter_counts(cfg, vocab_size)
    return {"task": cfg.task, "variant": describe_run(method, cfg.to_dict()), "data_sources": data_sources(asdict(cfg.data)),
            "phase_shapes": {name: asdict(sizes) for name, sizes in phase_shapes.items()},
            "full_model_parameters": params["parameters"],
            "full_model_non_embedding_parameters": params["non_embedding_parameters"]}


@dataclass(frozen=True)
class RunRecord:
    """One finished run. ``phases``: each phase's name, level, steps, FLOPs, examples, wall time and
    model ``shape`` (layers, heads, kv_heads, hidden, ffn, head_dim); ``test``: the final test
    metrics (``test_loss``, and ``test_acc`` for images); ``config``: the run's config as written.
    (For a summary from before the descriptive fields, the phase shapes and parameter counts are
    worked out from the config when first asked for: a table that refuses the run first never
    needs them.)"""

    run: Path
    method: str
    experiment: str
    task: str
    seed: int
    variant: dict
    data_sources: tuple
    data: dict
    flops: float
    tokens: float | None
    wall: float
    val_loss: float
    test: dict
    tune_loss: float | None
    config: dict
    summary: dict = field(repr=False)

    @cached_property
    def _described(self) -> dict:
        if "phase_shapes" in self.summary and "full_model_parameters" in self.summary:
            return self.summary
        cfg = load_config(self.run / "config.yaml")
        shapes = {p["phase"]: p["sizes"] for p in planned_ledger(cfg, self.method)["phases"]}
        return describe(cfg, self.method, shapes)

    @property
    def phases(self) -> tuple:
        shapes = self._described["phase_shapes"]
        return tuple({**{k: v for k, v in p.items() if k != "event"}, "shape": shapes.get(p["phase"])}
                     for p in self.summary["phases"])

    @property
    def smallest_shape(self) -> str:
        """The key (``Sizes.key``: 2L/64d/2h) of the smallest model the run trained, by its blocks'
        weights: the shape whose training alone is the run's small-model control (the V-cycle's
        coarsest level, staged training's first stage, G_stack's shallow model; the baseline's own)."""
        def weights(s: Sizes) -> int:  # attention (q, k, v, out) and MLP weights of every block
            return s.layers * (s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads) + 2 * s.hidden * s.ffn)

        shapes = [Sizes(**p["shape"]) for p in self.phases if p.get("shape")]
        return min(shapes, key=weights).key if shapes else ""

    @property
    def parameters(self) -> int:
        return int(self._described["full_model_parameters"])

    @property
    def non_embedding_parameters(self) -> int:
        return int(self._described["full_model_non_embedding_parameters"])

    @property
    def execution(self) -> dict:
        """Each phase's execution (``train.speed: auto``: "compiled+fused", ...); "eager" by default."""
        chosen = self.summary.get("execution") or {}
        return {p["phase"]: chosen.get(p["phase"], "eager") for p in self.summary["phases"]}

    @property
    def tokens_per_parameter(self) -> float:
        return math.nan if self.tokens is None else self.tokens / self.parameters

    @property
    def tokens_per_non_embedding_parameter(self) -> float:
        return math.nan if self.tokens is None else self.tokens / self.non_embedding_parameters

    @classmethod
    def read(cls, run: str | Path, error: type[Exception] = RecordError) -> "RunRecord":
        """The record of the finished run in ``run``; ``error`` (naming the file) when it has none
        or its summary or config is not readable."""
        run = Path(run)
        if not finished(run):
            raise error(f"{run} is not a finished run (no {SUMMARY}): finish it (--resume) first")
        summary = read_structured(run / SUMMARY, "run summary", error)
        config = read_structured(run / "config.yaml", "run config", error, fmt="yaml")
        if not isinstance(summary, dict) or not summary.get("kind") or not isinstance(config, dict):
            raise error(f"{run} does not hold a run's summary and config")
        method = summary["kind"]
        tokens = summary.get("tokens_total")
        if tokens is None:  # (summaries before the ledger's total: the last evaluation row has it)
            evals = [r for r in read_metrics(run) if "val_loss" in r and "event" not in r]
            tokens = evals[-1].get("tokens") if evals else None
        return cls(run=run, method=method, experiment=summary["experiment"], task=summary.get("task", config["task"]),
                   seed=int(summary["seed"]), variant=summary.get("variant") or describe_run(method, config),
                   data_sources=tuple(summary.get("data_sources") or data_sources(config.get("data") or {})),
                   data=summary.get("data") or {}, flops=float(summary["flops_total"]), tokens=tokens,
                   wall=float(summary["wall_total"]), val_loss=float(summary["final_full_val"]["val_loss"]),
                   test=summary["final_test"], tune_loss=(summary.get("final_tune") or {}).get("tune_loss"),
                   config=config, summary=summary)
