"""Notebooks run top to bottom against the committed results (no training inside); they are
committed with their outputs, which must equal a fresh execution's, and the numbers they show equal
ones recomputed here from the runs' metrics files alone."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
# A cell the test appends to notebooks whose table is built from `runs`: it prints what they show.
DUMP = ("print('RUNS-JSON', runs[['experiment', 'run', 'seed', 'reached', 'flops_saving_pct']]"
        ".to_json(orient='records'))")


def _evals(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "val_loss" in r and "event" not in r]


def recomputed_saving(experiment: str, run: str, seed: int) -> float | None:
    """FLOPs saving at the baseline's final validation loss, from metrics.jsonl alone (None: not reached)."""
    base = _evals(REPO / "results" / experiment / f"baseline-seed{seed}")
    target = base[-1]["val_loss"]
    first_base = next(r for r in base if r["val_loss"] <= target)
    runs = _evals(REPO / "results" / experiment / run)
    final_phase = runs[-1]["phase"]
    hit = next((r for r in runs if r["phase"] == final_phase and r["val_loss"] <= target), None)
    return None if hit is None else 100 * (1 - hit["flops"] / first_base["flops"])


def text_outputs(nb) -> list[list[str]]:
    """Per code cell, what it printed and the plain-text form of what it displayed (figures aside)."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        shown = []
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                shown.append(o["text"])
            elif "text/plain" in o.get("data", {}) and "image/png" not in o["data"]:
                shown.append(o["data"]["text/plain"])
        cells.append(shown)
    return cells


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_and_shows_the_results(path):
    nb = nbformat.read(path, as_version=4)
    committed = text_outputs(nb)
    assert any(committed), f"{path.name} is committed without outputs: run python experiments/run_notebooks.py"
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    shows_runs = any("runs = study.collect" in c.source for c in nb.cells if c.cell_type == "code")
    if shows_runs:
        nb.cells.append(nbformat.v4.new_code_cell(DUMP))
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert [o for o in outputs if "image/png" in o.get("data", {})], "the notebook should show figures"
    fresh = text_outputs(nb)[:len(committed)]  # (the dump cell appended here is not committed)
    assert fresh == committed, (f"{path.name}: its committed outputs disagree with results/ now; "
                                "run python experiments/run_notebooks.py")
    if not shows_runs:
        return
    (dump,) = [o["text"] for o in outputs if o.get("name") == "stdout" and o["text"].startswith("RUNS-JSON")]
    shown = json.loads(dump.split(" ", 1)[1])
    only_vcycle = any('runs.method == "vcycle"' in c.source for c in nb.cells if c.cell_type == "code")
    summaries = [(p.parent.parent, json.loads(p.read_text())) for p in (REPO / "results").glob("*/*/summary.json")]
    baselines = Counter((d, s.get("seed")) for d, s in summaries if s.get("kind") == "baseline")
    with_baseline = {key for key, n in baselines.items() if n == 1}  # a frontier or tuning grid has several: out
    kinds = [s.get("kind") for d, s in summaries if (d, s.get("seed")) in with_baseline]  # records beside no baseline: out
    assert len(shown) == len([k for k in kinds if (k == "vcycle" if only_vcycle else k not in ("baseline", None))]) > 0
    for row in shown:
        expected = recomputed_saving(row["experiment"], row["run"], row["seed"])
        assert bool(row["reached"]) == (expected is not None), row
        if expected is not None:
            assert row["flops_saving_pct"] == pytest.approx(expected, abs=1e-9), row


def test_the_study_notebooks_are_there():
    assert {p.name for p in NOTEBOOKS} >= {"similarity_maps.ipynb", "flops_saving.ipynb",
                                           "adaptive_vs_fixed_alpha.ipynb"}
