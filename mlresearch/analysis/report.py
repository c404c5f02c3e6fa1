"""``mlresearch similarity``: the frame (CSV) and figures (PNG) for a run or a model."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..checkpoint import atomic_dir, load_model
from ..overwrite import REPORT, check_overwrite
from ..data.datasets import load_data, make_batch
from ..results import provenance, write_json
from . import plots
from .over_training import matrix_from_frame, similarity_frame, similarity_over_training, summary_over_training
from .similarity import metric_of


def probe_batch(config_path: str | Path, examples: int = 16) -> dict:
    """The first ``examples`` validation examples of a config's data (model inputs only)."""
    from ..training.config import load_config, preset_path
    from ..training.models import data_settings

    cfg = load_config(preset_path(config_path))
    data = load_data(cfg.task, data_settings(cfg), cfg.seed)
    idx = np.arange(min(examples, len(data.val)))
    return {k: v for k, v in make_batch(data, "val", idx, 10**9, cfg.seed).items() if k != "labels"}


def _when(row) -> str:
    """A snapshot as a reader names it: "step 50" (of its phase, when the run has several), or "final"."""
    if row.step < 0:
        return "final"
    return f"step {int(row.step)}" if row.phase in ("baseline", "model") else f"{row.phase} step {int(row.step)}"


def _subject(run, model_dir) -> str:
    """What the maps are of: the run's experiment and model shape, or the model directory's name."""
    if run is None:
        return Path(model_dir).name
    from ..training.config import load_config

    cfg = load_config(Path(run) / "config.yaml")
    m = cfg.model
    return f"{cfg.experiment} ({m.family} {m.layers}L/{m.hidden}d/{m.heads}h)"


def similarity_report(out: str | Path, run: str | Path | None = None, model_dir: str | Path | None = None,
                      data: str | Path | None = None, metric: str = "cka", examples: int = 16,
                      overwrite: bool = False) -> Path:
    if (run is None) == (model_dir is None):
        raise ValueError("give exactly one of --run or --model")
    metric_of(metric)  # an unknown metric is one line, before anything is read
    if overwrite:
        check_overwrite(out, REPORT)  # before any work: only a report this project wrote is replaced
    elif Path(out).exists():
        raise FileExistsError(f"--out {out} already exists (pass --overwrite to replace a similarity report there)")
    import matplotlib

    matplotlib.use("Agg")  # files only
    if data is None:
        if run is None:
            raise ValueError("--model needs --data CONFIG (whose validation split is the probe)")
        data = Path(run) / "config.yaml"
    batch = probe_batch(data, examples)
    if run is not None:
        frame = similarity_over_training(run, batch, metric)
    else:
        model = load_model(model_dir)
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embeddings is not None and "input_ids" in batch and int(batch["input_ids"].max()) >= embeddings.num_embeddings:
            raise ValueError(f"--model {model_dir} has a vocabulary of {embeddings.num_embeddings} tokens, but --data "
                             f"{data}'s tokenizer gives ids up to {int(batch['input_ids'].max())}: probe it with the "
                             "data it was trained on")
        try:
            frame = similarity_frame(model, batch, metric, {"snapshot": Path(model_dir).name, "phase": "model",
                                                            "step": -1})
        except (AssertionError, RuntimeError, IndexError) as exc:  # the model cannot read this probe
            raise ValueError(f"--model {model_dir} cannot read --data {data}'s probe batch ({type(exc).__name__}: "
                             f"{exc}); probe it with the data it was trained on") from None
    name = frame.metric.iloc[0]
    with atomic_dir(out, overwrite) as tmp:
        write_json(tmp / "provenance.json", provenance(
            {"run": str(run) if run else None, "model": str(model_dir) if model_dir else None, "data": str(data),
             "metric": metric, "examples": examples}, seed=-1))
        frame.to_csv(tmp / "similarity.csv", index=False)
        last = frame[frame.snapshot == frame.snapshot.iloc[-1]]
        rows_of_attention = metric_of(metric).on_attention_rows
        layer_kind = "attention" if rows_of_attention else "layers"
        subject = _subject(run, model_dir)
        snaps = frame.drop_duplicates("snapshot")
        plots.save(plots.small_multiples({_when(r): matrix_from_frame(frame[frame.snapshot == r.snapshot], layer_kind)
                                          for r in snaps.itertuples()},
                                         f"{subject}: inter-layer similarity ({name}) over training", "layer", name),
                   tmp / "layers.png")
        heads = {f"layer {int(l)}": matrix_from_frame(last, "heads", l) for l in sorted(last.layer.dropna().unique())}
        plots.save(plots.small_multiples(heads, f"{subject}: head similarity within each layer ({name}), "
                                         f"{_when(next(last.itertuples()))}", "head", name), tmp / "heads.png")
        if not rows_of_attention and frame.snapshot.nunique() > 1:
            summary = summary_over_training(frame)
            summary.to_csv(tmp / "summary.csv", index=False)
            plots.save(plots.trend(summary, f"{subject}: mean similarity ({name}) over training"), tmp / "trend.png")
    return Path(out)
