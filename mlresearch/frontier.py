"""The saving at matched loss, read against an annealed baseline frontier.

A method's saving means something only against a baseline trained *for the method's budget* with
its LR schedule fully decayed at its end (Kaddour et al., "No Train No Gain", NeurIPS 2023): a
baseline read part-way through one long schedule has not finished decaying and flatters every
method that stops early. The study trains the baseline at several budgets, each annealed
(``frontier`` in a study spec, :mod:`mlresearch.study_runner`); each run is one *point* (its total
FLOPs, its final validation loss on the full split), and one seed's points make its *frontier*.

For a method's run ending (annealed) at loss ``L_m`` after ``C_m`` FLOPs, on the same seed:

- ``C_base(L_m)``: the frontier's FLOPs to reach ``L_m``, read by monotone interpolation in log FLOPs
  between its points. A point that ends no lower than a smaller budget's is not a point of the
  frontier: with more compute the baseline can always do at least as well (stop where the smaller
  budget did), so such a run was mistuned for its length (its LR, tuned at another budget) and says
  nothing of what its budget reaches. Dropping it, rather than flattening the frontier out to it,
  never lends a method a saving: in between, the frontier comes down no later than a flat stretch
  would, and past the best point nothing is claimed (see the bounds below);
- **saved** = ``1 - C_m / C_base(L_m)`` (negative: the method spent more for the same loss);
- **speedup** = ``C_base(L_m) / C_m - 1`` (what papers such as G_stack's report: a 54.6% speedup
  is a 35% saving);
- **loss gap at equal FLOPs** = ``L_m`` minus the frontier's loss at ``C_m``.

A loss or a budget outside the frontier's points is reported as such (``below``/``above`` the
frontier's range), never extrapolated. For a loss outside it the saving is still bounded, by the same
premise that makes the frontier decreasing (more compute never has to do worse): a loss below the
frontier's best point needs more than that point's budget ``C_max`` (the largest budget that did
better than every smaller one), so the run saved *more* than ``1 - C_m / C_max``; one above the
smallest budget's needs less than it, so the run saved *less* than ``1 - C_m / C_min``.
Tables state that bound for the seeds outside the range, never a point value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .errors import MLResearchError
from .training.record import RunRecord


BUDGET_TOLERANCE = 1e-3
"""Relative distance from a frontier's end point within which a run's FLOPs count as that budget
(rounding to whole steps; far below the spacing of any frontier's budgets)."""


class FrontierError(MLResearchError, ValueError):
    """A frontier that cannot be read (fewer than two points, non-finite values, mixed seeds)."""


def frontier_row(run: str | Path, root: str | Path, budget: float) -> dict:
    """One frontier point, from a finished run's record and provenance: the row ``frontier.csv``
    holds (nothing is parsed from the directory's name)."""
    r = RunRecord.read(run, FrontierError)
    provenance = json.loads((r.run / "provenance.json").read_text())
    train = r.config["train"]
    return {"experiment": r.experiment, "method": r.method, "seed": r.seed,
            "budget": budget, "lr": train["lr"], "warmup": train["warmup"],
            "steps": train["steps"], "schedule": train["schedule"],
            "flops": r.flops, "val_loss": r.val_loss, "tune_loss": r.tune_loss,
            "tokens": r.tokens, "shape": r.smallest_shape, "full_model_parameters": r.parameters,
            "full_model_non_embedding_parameters": r.non_embedding_parameters,
            "tokens_per_parameter": None if r.tokens is None else r.tokens_per_parameter,
            "run": str(r.run.resolve().relative_to(Path(root).resolve())),
            "copied_from": provenance.get("copied_from"), "git_commit": provenance.get("git_commit")}


def dominated(losses: list[float]) -> list[bool]:
    """For one seed's points in order of FLOPs: which end no lower than some cheaper point."""
    best, out = math.inf, []
    for v in losses:
        out.append(v >= best)
        best = min(best, v)
    return out


@dataclass(frozen=True)
class Frontier:
    """One seed's annealed end points, as (FLOPs, loss), decreasing in loss."""

    flops: tuple[float, ...]
    loss: tuple[float, ...]

    @classmethod
    def of(cls, points) -> "Frontier":
        """From (FLOPs, loss) pairs in any order; a point no better than one with less compute is
        dropped (:func:`dominated`: mistuned for its length, not what its budget reaches)."""
        points = sorted((float(c), float(v)) for c, v in points)
        if len(points) < 2:
            raise FrontierError(f"a frontier needs at least two budgets, got {len(points)}")
        if not all(math.isfinite(c) and c > 0 and math.isfinite(v) for c, v in points):
            raise FrontierError(f"frontier points must have positive finite FLOPs and finite losses, got {points}")
        if len({c for c, _ in points}) != len(points):
            raise FrontierError(f"two frontier points share a budget: {points}")
        kept = [p for p, off in zip(points, dominated([v for _, v in points])) if not off]
        return cls(tuple(c for c, _ in kept), tuple(v for _, v in kept))

    def flops_to(self, loss: float) -> tuple[float | None, str]:
        """(FLOPs at which the frontier comes down to ``loss``, "in range"), or (None, "below") for
        a loss better than its best point's, (None, "above") for one worse than its
        smallest budget's."""
        if loss > self.loss[0]:
            return None, "above"
        if loss < self.loss[-1]:
            return None, "below"
        for i in range(len(self.loss)):
            if self.loss[i] <= loss:
                if i == 0 or self.loss[i] == loss:
                    return self.flops[i], "in range"
                share = (self.loss[i - 1] - loss) / (self.loss[i - 1] - self.loss[i])
                lo, hi = math.log(self.flops[i - 1]), math.log(self.flops[i])
                return math.exp(lo + share * (hi - lo)), "in range"
        raise AssertionError("unreachable: loss is within [min, max] of the frontier")

    def loss_at(self, flops: float) -> tuple[float | None, str]:
        """(The frontier's loss at ``flops``, "in range"), or (None, "below"/"above") for a budget
        smaller than its smallest point or larger than its largest. A budget within
        ``BUDGET_TOLERANCE`` of an end point is read at that point: the small shape's equal-FLOPs
        control rounds its steps up, so it spends a few millionths more than the 1.0x baseline."""
        if flops < self.flops[0] * (1 - BUDGET_TOLERANCE):
            return None, "below"
        if flops > self.flops[-1] * (1 + BUDGET_TOLERANCE):
            return None, "above"
        flops = min(max(flops, self.flops[0]), self.flops[-1])
        for i in range(1, len(self.flops)):
            if flops <= self.flops[i]:
                lo, hi = math.log(self.flops[i - 1]), math.log(self.flops[i])
                share = (math.log(flops) - lo) / (hi - lo)
                return self.loss[i - 1] + share * (self.loss[i] - self.loss[i - 1]), "in range"
        return self.loss[0], "in range"  # a single-budget frontier is refused in of()

    def saving(self, flops: float, loss: float) -> dict:
        """A run ending at ``loss`` after ``flops`` against this frontier: saved, speedup, loss gap
        at equal FLOPs, each None where the frontier does not reach (with why). Where the loss is
        outside its range, ``saved_bound`` and ``speedup_bound`` bound them instead: from below for a
        loss below the range (the baseline needs more than its best point's budget), from above for
        one above it (less than its smallest)."""
        base, reach = self.flops_to(loss)
        at, budget = self.loss_at(flops)
        edge = {"below": self.flops[-1], "above": self.flops[0]}.get(reach)
        return {"baseline_flops_at_loss": base, "loss_range": reach,
                "saved": None if base is None else 1 - flops / base,
                "speedup": None if base is None else base / flops - 1,
                "saved_bound": None if edge is None else 1 - flops / edge,
                "speedup_bound": None if edge is None else edge / flops - 1,
                "loss_gap": None if at is None else loss - at, "flops_range": budget}


def frontiers(points: pd.DataFrame, method: str = "baseline") -> dict[tuple, Frontier]:
    """That seed's frontier of ``method`` runs, from ``frontier.csv`` rows (not the LR check's: it is
    judged on the tuning split): (experiment, seed) -> the baseline's. A study can have several
    small-model controls (the V-cycle's coarsest shape, staged training's half-width one), so for
    ``method="small"`` the key is (experiment, seed, shape) (shape "" for rows written before
    controls had shapes)."""
    rows = points[(points.method == method) & (points.role == "frontier")]
    if method == "small":
        rows = rows.assign(shape=rows["shape"].fillna("").astype(str) if "shape" in rows else "")
    keys = ["experiment", "seed"] + (["shape"] if method == "small" else [])
    return {(str(k[0]), int(k[1]), *k[2:]): Frontier.of(zip(g.flops, g.val_loss))
            for k, g in rows.groupby(keys) if len(g) >= 2}


def regime_controls(points: pd.DataFrame) -> dict[tuple[str, int], str]:
    """(experiment, seed) -> the shape of the regime check's small-model control (the study's
    ``control``: the small shape alone that the full model must beat), "" where the rows predate
    shapes (then it was the only control)."""
    rows = points[(points.method == "small") & (points.role == "frontier")]
    if "regime_control" in rows:
        rows = rows[rows.regime_control.fillna(True).astype(bool)]
    shapes = rows["shape"].fillna("").astype(str) if "shape" in rows else pd.Series("", index=rows.index)
    return {(str(e), int(s)): shape for e, s, shape in zip(rows.experiment, rows.seed, shapes)}


def read_points(results: str | Path) -> pd.DataFrame:
    """``<results>/tables/frontier.csv`` (written by the study's frontier stage); empty when absent."""
    path = Path(results) / "tables" / "frontier.csv"
    return pd.read_csv(path) if path.exists() else pd.DataFrame(columns=["experiment", "method", "seed", "role"])


def run_savings(runs: pd.DataFrame, points: pd.DataFrame) -> pd.DataFrame:
    """Each method run (a row of :func:`mlresearch.study.collect`: its experiment, seed, total FLOPs
    and final loss) against the annealed frontier *of its own seed*: ``saved_pct``, ``speedup_pct``,
    ``loss_gap`` (to the baseline's frontier at equal FLOPs), ``small_loss_gap`` (to the frontier of
    the run's own smallest shape trained alone, ``smallest_shape``, where the study has one, else to the
    regime check's control; ``small_control``: the shape read against), and where each stands (``loss_range``: in range / above /
    below the frontier's points; ``flops_range`` and ``small_flops_range`` likewise for the budget);
    ``saved_pct_bound`` and ``speedup_pct_bound`` for a loss outside the range (see the module's text). Runs of an experiment without a frontier
    get ``loss_range`` "no frontier"."""
    full, small, regime = frontiers(points, "baseline"), frontiers(points, "small"), regime_controls(points)
    rows = []
    for r in runs.itertuples(index=False):
        key = (str(r.experiment), int(r.seed))
        out = {"saved_pct": None, "speedup_pct": None, "saved_pct_bound": None, "speedup_pct_bound": None,
               "loss_gap": None, "small_loss_gap": None, "small_control": None,
               "loss_range": "no frontier", "flops_range": "no frontier", "small_flops_range": "no frontier",
               "baseline_flops_at_loss": None}
        # (a run with a NaN loss has no comparison, so no total: it stays "no frontier")
        flops, loss = float(getattr(r, "method_total_flops", math.nan)), float(getattr(r, "method_full_val_loss", math.nan))
        if key in full and math.isfinite(flops) and math.isfinite(loss):
            s = full[key].saving(flops, loss)
            out.update(loss_range=s["loss_range"], flops_range=s["flops_range"], loss_gap=s["loss_gap"],
                       baseline_flops_at_loss=s["baseline_flops_at_loss"],
                       **{f"{k}_pct{end}": None if s[k + end] is None else 100 * s[k + end]
                          for k in ("saved", "speedup") for end in ("", "_bound")})
        own = str(getattr(r, "smallest_shape", ""))  # its own smallest shape alone, else the regime check's control
        control = (*key, own if (*key, own) in small else regime.get(key, ""))
        if control in small and math.isfinite(flops) and math.isfinite(loss):
            s = small[control].saving(flops, loss)
            out.update(small_loss_gap=s["loss_gap"], small_flops_range=s["flops_range"], small_control=control[-1])
        rows.append(out)
    return pd.DataFrame(rows, index=runs.index, columns=list(out) if rows else None)


def spread_cell(values, ranges, digits: int = 1, bounds=None) -> str:
    """A table cell from one variant's per-seed ``values`` and where each seed stands (``ranges``):
    mean ± sd over the seeds the frontier can read, and how many it cannot (their loss or budget
    below or above its points) -- never a point value for those; with ``bounds`` (a saving's, per
    seed), each such seed's bound: "> +14.6" below the range, "< -100.0" above it."""
    ranges = list(ranges)
    bounds = [None] * len(ranges) if bounds is None else list(bounds)
    if not ranges or all(r == "no frontier" for r in ranges):
        return "no frontier yet"
    read = [float(v) for v, r in zip(values, ranges) if r == "in range"]
    cell = "-"

    def signed(x: float) -> str:  # rounded first, so a value a hair below zero reads +0.0, never -0.0
        return f"{round(x, digits) + 0.0:+.{digits}f}"

    if read:
        mean = sum(read) / len(read)
        cell = signed(mean)
        if len(read) > 1:
            sd = math.sqrt(sum((v - mean) ** 2 for v in read) / (len(read) - 1))
            cell += f" ± {sd:.{digits}f}"

    def where(k: str) -> str:
        said = [f"{'>' if k == 'below' else '<'} {signed(float(b))}" for b, r in zip(bounds, ranges)
                if r == k and b is not None and math.isfinite(float(b))]
        return f"{k} its range" + (f": {', '.join(said)}" if said else "")

    outside = [f"{ranges.count(k)} " + ("without one" if k == "no frontier" else where(k))
               for k in ("below", "above", "no frontier") if ranges.count(k)]
    return cell + (f" ({len(read)}/{len(ranges)} seeds; {', '.join(outside)})" if outside else "")


def points_markdown(points: pd.DataFrame) -> str:
    """Every experiment's frontier points as tables, a row per seed: the final validation loss of the
    baseline at each budget, then of each small shape alone (a study can have several; each column
    names its shape); a point that is not on its frontier (:func:`dominated`) is starred. The docs
    quote these, so they are generated, never typed."""
    rows = (points[points.role == "frontier"] if len(points) else points).reset_index(drop=True)
    if rows.empty:
        return "_No frontier points in results/tables/frontier.csv yet._\n"
    shapes = rows["shape"].fillna("").astype(str) if "shape" in rows else pd.Series("", index=rows.index)
    rows = rows.assign(column=[f"{m} {s} {b:g}x".replace("  ", " ") if m == "small" else f"{m} {b:g}x"
                               for m, s, b in zip(rows.method, shapes, rows.budget)],
                       order=[(m != "baseline", s, b) for m, s, b in zip(rows.method, shapes, rows.budget)],
                       line=shapes.values)
    off = set()
    for _, g in rows.groupby(["experiment", "seed", "method", "line"]):
        g = g.sort_values("budget")  # (a fraction of the baseline's FLOPs, for the small shapes too)
        off |= {i for i, d in zip(g.index, dominated(list(g.val_loss))) if d}
    rows = rows.assign(cell=[f"{v:.3f}" + ("*" if i in off else "") for i, v in zip(rows.index, rows.val_loss)])
    out = []
    for experiment, g in rows.groupby("experiment", sort=True):
        columns = [c for _, c in sorted({(o, c) for o, c in zip(g.order, g.column)})]
        cells = {(int(s), c): v for s, c, v in zip(g.seed, g.column, g.cell)}
        seeds = sorted({int(s) for s in g.seed})
        out.append(f"**{experiment}** (final validation loss)\n\n| seed | " + " | ".join(columns) + " |\n|" +
                   "---|" * (len(columns) + 1) + "\n" +
                   "".join(f"| {s} | " + " | ".join(cells.get((s, c), "-") for c in columns) + " |\n" for s in seeds) +
                   ("\n\\* ends no lower than a smaller budget of its seed: not a point of the frontier (mistuned for "
                    "its length, not what the budget reaches)\n" if any(i in off for i in g.index) else ""))
    return "\n".join(out)
