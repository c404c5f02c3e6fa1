"""Study tables: every method's run in results/ (V-cycle, staged, G_stack, the small model alone ...)
against the baseline of its experiment and seed (``results/<experiment>/baseline-seed<seed>`` beside it).

Nothing here is typed by hand except :data:`PAPER` and :data:`PAPER_TABLES`, what the multi-level paper *reports*
(Zou et al., ICLR 2024; FLOPs and wall-time saving against training the same model from scratch),
shown beside our measurements and labelled as such.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pandas as pd

from .families import Sizes
from .frontier import points_markdown, read_points, run_savings, spread_cell
from .tasks import task_of
from .training.compare import NonFiniteLoss, compare_runs, reach
from .training.engine import read_metrics
from .training.methods import methods_markdown, title_of
from .training.record import RunRecord

PAPER = pd.DataFrame([
    {"model": "BERT-Base", "levels": 2, "flops_saving_pct": 19.0, "wall_saving_pct": 10.8},
    {"model": "GPT-Base", "levels": 2, "flops_saving_pct": 24.1, "wall_saving_pct": 16.5},
    {"model": "DeiT-B", "levels": 2, "flops_saving_pct": 27.1, "wall_saving_pct": 24.3},
    {"model": "BERT-Large", "levels": 2, "flops_saving_pct": 37.4, "wall_saving_pct": 32.9},
    {"model": "BERT-Large", "levels": 3, "flops_saving_pct": 51.6, "wall_saving_pct": 41.9},
]).assign(source="paper (reported)")

# The rows of the multi-level paper's comparison tables, as it reports them (None: a number our sources
# of the paper do not give), and the study experiment each table is read against here.
PAPER_TABLES = pd.DataFrame([
    {"table": "Table 1 (BERT-Base)", "method": "vcycle", "flops": 19.0, "wall": 10.8, "metric": "GLUE 79.8 vs 79.7"},
    {"table": "Table 1 (BERT-Base)", "method": "stackbert", "flops": None, "wall": None, "metric": None},
    {"table": "Table 1 (BERT-Base)", "method": "bert2bert", "flops": None, "wall": "< 0", "metric": None},
    {"table": "Table 1 (BERT-Base)", "method": "ligo", "flops": 17.4, "wall": None, "metric": None},
    {"table": "Table 1 (BERT-Base)", "method": "ki", "flops": None, "wall": -25.9, "metric": None},
    {"table": "Table 2 (GPT-Base)", "method": "baseline", "flops": 0.0, "wall": 0.0, "metric": "PTB ppl 146.3"},
    {"table": "Table 2 (GPT-Base)", "method": "vcycle", "flops": 24.1, "wall": 16.5, "metric": "PTB ppl 142.5"},
    {"table": "Table 2 (GPT-Base)", "method": "stackbert", "flops": None, "wall": None, "metric": "PTB ppl 140.6"},
    {"table": "Table 2 (GPT-Base)", "method": "ligo", "flops": None, "wall": None, "metric": "PTB ppl 139.7"},
    {"table": "Table 3 (DeiT-B)", "method": "baseline", "flops": 0.0, "wall": 0.0, "metric": "ImageNet top-1 81.1%"},
    {"table": "Table 3 (DeiT-B)", "method": "vcycle", "flops": 27.1, "wall": 24.3, "metric": "ImageNet top-1 81.5% vs 81.1%"},
])
PAPER_TABLE_EXPERIMENTS = {"Table 1 (BERT-Base)": "bert_mask40_15k", "Table 2 (GPT-Base)": "gpt2_regime",
                           "Table 3 (DeiT-B)": "deit_fractals_2l_12k"}

# Generated blocks of the README and docs/: <!-- NAME:start --> ... <!-- NAME:end -->, rewritten by
# `mlresearch table --docs FILE...`; tests/test_docs.py fails when one is stale.
BLOCKS = ("answer", "results", "methods", "frontiers")
# ... and one per study experiment: its every variant seed by seed (seeds_markdown).
SEEDS_BLOCK = "seeds_{experiment}"
# What tells one variant of an experiment from another: the rows of variants() and the answer table.
VARIANT_KEYS = ["experiment", "method", "levels", "scheme", "alpha", "optimizer", "budget"]


def _runs(results: Path):
    """The records of the finished runs the runner wrote (``<results>/<experiment>/<run>/``)."""
    for summary in sorted(results.glob("*/*/summary.json")):
        if (summary.parent / "config.yaml").exists():
            yield RunRecord.read(summary.parent, ValueError)


def _downstream(record: RunRecord) -> float | None:
    """The run's downstream number (``mlresearch downstream``), or its own test top-1 for images."""
    key = task_of(record.task).downstream.key
    path = record.run / "downstream.json"
    if path.exists():
        return json.loads(path.read_text())[key]
    if task_of(record.task).accuracy:
        return record.test["test_acc"]
    return None


def _transfer(record: RunRecord) -> float | None:
    """The run's transfer probe accuracy (``downstream.json``'s ``transfer_accuracy``: image tasks), or None."""
    path = record.run / "downstream.json"
    return json.loads(path.read_text()).get("transfer_accuracy") if path.exists() else None


def step_times(results: Path) -> dict:
    """(experiment, shape, execution, bf16) -> median seconds per training step on a quiet machine
    (``results/tables/step_time.csv``, written by experiments/bench_shapes.py; rows without an
    execution were timed eager, rows without a precision in fp32)."""
    path = results / "tables" / "step_time.csv"
    if not path.exists():
        return {}
    table = pd.read_csv(path)
    executions = table["execution"].fillna("eager") if "execution" in table else ["eager"] * len(table)
    precisions = table["bf16"].fillna(False).astype(bool) if "bf16" in table else [False] * len(table)
    return {(r.experiment, r.shape, e, b): float(r.seconds_per_step)
            for r, e, b in zip(table.itertuples(), executions, precisions)}


def modelled_wall(record: RunRecord, times: dict):
    """The run's training wall time as the quiet benchmark models it: a function of (phase, step)
    giving sum(steps x seconds per step of each phase's shape) up to that point; None when a shape
    the run passed through was not benchmarked. Measured wall time on a shared machine is noise;
    this is what a saving in wall time is claimed from. Each phase is timed as it ran (its execution:
    eager, or what ``train.speed`` chose; in its precision: a bf16 timing never stands in for fp32)."""
    execution, bf16 = record.execution, bool((record.config.get("train") or {}).get("bf16", False))
    per_step = {p["phase"]: times.get((record.experiment, Sizes(**p["shape"]).key, execution[p["phase"]], bf16))
                for p in record.phases}
    if any(v is None for v in per_step.values()):
        return None
    before, elapsed = {}, 0.0
    for p in record.phases:
        before[p["phase"]] = elapsed
        elapsed += p["steps"] * per_step[p["phase"]]
    return lambda phase, step: before[phase] + step * per_step[phase]


def _modelled_columns(baseline_wall: float | None, record: RunRecord, times: dict, target: float) -> dict:
    """``baseline_wall``: the baseline's modelled training seconds to the target (one per baseline)."""
    wm = modelled_wall(record, times)
    if baseline_wall is None or wm is None:
        return {}
    rows = read_metrics(record.run)
    last = [r for r in rows if "val_loss" in r and "event" not in r][-1]
    out = {"baseline_modelled_wall": baseline_wall, "method_modelled_total_wall": wm(last["phase"], last["step"])}
    hit = reach(rows, target, last["phase"])
    if hit is not None:
        out["modelled_wall_saving_pct"] = 100 * (1 - wm(hit["phase"], hit["step"]) / out["baseline_modelled_wall"])
    return out


def collect(results: str | Path = "results") -> pd.DataFrame:
    """One row per run of a method (every kind but the baseline) with the baseline of the same
    seed in the same directory, and the comparison; a run without exactly one such baseline (one
    kept as a record elsewhere; the runs of a tuning grid or a frontier, beside several) has no
    single baseline to be compared with and is left out. Each row also has its saving against the
    annealed frontier of its seed (``results/tables/frontier.csv``, :mod:`mlresearch.frontier`) and
    the full model's tokens per parameter at the run's end."""
    table = _collect(Path(results))
    if table.empty:
        return table
    return pd.concat([table, run_savings(table, read_points(results))], axis=1)


def _collect(results: Path) -> pd.DataFrame:
    results = Path(results)
    runs = list(_runs(results))
    baselines: dict = {}
    for r in runs:
        if r.method == "baseline":
            key = (r.run.parent, r.seed)
            baselines[key] = None if key in baselines else r
    times, baseline_walls = step_times(results), {}
    rows = []
    for r in runs:
        base = baselines.get((r.run.parent, r.seed))
        if r.method == "baseline" or base is None:  # (a run kept as a record, beside no baseline)
            continue
        try:  # first: runs that measure different things are refused before anything reads their plans
            c = compare_runs(base.run, r.run)
        except NonFiniteLoss as exc:  # a marked cell, not a blank that reads as a number
            warnings.warn(f"table: {exc}", stacklevel=2)
            c = None
        row = {"experiment": r.experiment, "method": r.method, "task": r.task, "run": r.run.name, "seed": r.seed,
               **r.variant, "smallest_shape": r.smallest_shape, "method_full_val_loss": r.val_loss, "method_test": next(iter(r.test.values())),
               "method_downstream": _downstream(r), "method_transfer": _transfer(r)}
        if c is None:
            rows.append({**row, "nonfinite_loss": 1, "reached": False})
            continue
        row.update({"parameters": r.parameters, "non_embedding_parameters": r.non_embedding_parameters})
        row.update({"baseline_full_val_loss": base.val_loss, "baseline_test": next(iter(base.test.values())),
                    "target_val_loss": c["target_val_loss"], "baseline_flops": c["baseline_flops"],
                    "baseline_total_flops": c["baseline_total_flops"],
                    "method_total_flops": c["method_total_flops"], "reached": c["reached"],
                    "baseline_tokens": c["baseline_tokens"], "method_tokens": c.get("method_tokens"),
                    "method_total_tokens": c["method_total_tokens"],
                    "tokens_per_parameter": (c["method_total_tokens"] or math.nan) / r.parameters,
                    "tokens_per_non_embedding_parameter":
                        (c["method_total_tokens"] or math.nan) / r.non_embedding_parameters,
                    "method_total_wall": c["method_total_wall"],
                    "method_flops": c.get("method_flops"), "flops_saving_pct": c.get("flops_saving_pct"),
                    "flops_saving_at_final_pct": c.get("flops_saving_at_final_pct"),
                    "wall_saving_pct": c.get("wall_saving_pct"),
                    "final_val_loss_gap": c["method_final_val_loss"] - c["target_val_loss"],
                    "baseline_downstream": _downstream(base), "baseline_transfer": _transfer(base),
                    "reached_acc": c.get("reached_acc"), "acc_flops_saving_pct": c.get("acc_flops_saving_pct")})
        if times:
            if base.run not in baseline_walls:  # the baseline's modelled time to its own final loss, once
                wb = modelled_wall(base, times)
                hit = reach(read_metrics(base.run), c["target_val_loss"])
                baseline_walls[base.run] = None if wb is None else wb(hit["phase"], hit["step"])
            row.update(_modelled_columns(baseline_walls[base.run], r, times, c["target_val_loss"]))
        rows.append(row)
    return pd.DataFrame(rows)


def _one_control(df: pd.DataFrame, keys: list[str]) -> tuple[pd.Series, pd.Series]:
    """Each run's small-model control and where it stands, one control per variant: a seed reads
    against its run's own smallest shape once that shape's frontier exists *on that seed*, else
    against the regime check's, so while a control's frontier is still running a variant's seeds
    can differ. Their gaps are not averaged together: the variant keeps its own shape's control
    (the seeds without that frontier yet read "without one"), or the one every seed shares."""
    control, where = df["small_control"].copy(), df["small_flops_range"].copy()
    own = df["smallest_shape"] if "smallest_shape" in df else pd.Series(None, index=df.index)
    for _, rows in df.groupby(keys, dropna=False).groups.items():
        named = control.loc[rows].dropna()
        if named.nunique() < 2:
            continue
        mine = named[named == own.loc[named.index]]
        keep = mine.iloc[0] if len(mine) else named.iloc[0]
        other = [i for i in rows if control[i] != keep]
        where.loc[other], control.loc[other] = "no frontier", keep
    return control, where


def variants(df: pd.DataFrame) -> pd.DataFrame:
    """Mean and spread over seeds for each experiment x variant."""
    if df.empty:
        return df
    keys = VARIANT_KEYS
    df = df.copy()
    floats = ["method_downstream", "baseline_downstream", "acc_flops_saving_pct", "modelled_wall_saving_pct",
              "flops_saving_at_final_pct", "method_tokens", "baseline_tokens", "method_total_tokens",
              "final_val_loss_gap", "nonfinite_loss", "baseline_flops", "baseline_total_flops", "flops_saving_pct",
              "method_flops", "method_total_flops", "wall_saving_pct", "tokens_per_parameter",
              "tokens_per_non_embedding_parameter"]  # a run with a NaN loss has none of these
    for c in (*floats, "reached_acc"):  # columns only some experiments or runs have
        if c not in df:
            df[c] = None
    df[floats] = df[floats].astype(float)
    if "small_control" in df:  # one small-model control per variant (see _one_control)
        df["small_control"], df["small_flops_range"] = _one_control(df, keys)
    g = df.groupby(keys, dropna=False)
    out = g.agg(seeds=("seed", "nunique"), reached=("reached", "sum"),
                flops_saving_pct=("flops_saving_pct", "mean"), flops_saving_std=("flops_saving_pct", "std"),
                wall_saving_pct=("wall_saving_pct", "mean"),
                modelled_wall_saving_pct=("modelled_wall_saving_pct", "mean"),
                flops_saving_at_final_pct=("flops_saving_at_final_pct", "mean"),
                flops_saving_at_final_std=("flops_saving_at_final_pct", "std"),
                final_val_loss_gap=("final_val_loss_gap", "mean"), final_val_loss_gap_std=("final_val_loss_gap", "std"),
                task=("task", "first"), method_downstream=("method_downstream", "mean"),
                baseline_downstream=("baseline_downstream", "mean"), downstream_runs=("method_downstream", "count"),
                acc_flops_saving_pct=("acc_flops_saving_pct", "mean"), reached_acc=("reached_acc", "sum"),
                baseline_flops=("baseline_flops", "mean"), method_flops_to_target=("method_flops", "mean"),
                method_total_flops=("method_total_flops", "mean"),
                baseline_tokens_to_target=("baseline_tokens", "mean"), method_tokens_to_target=("method_tokens", "mean"),
                method_total_tokens=("method_total_tokens", "mean"), nonfinite_seeds=("nonfinite_loss", "sum"))
    out["method_flops_over_baseline"] = out["method_total_flops"] / g["baseline_total_flops"].mean()
    out["final_val_loss_gap_cell"] = g["final_val_loss_gap"].apply(  # mean ± sd over the seeds with a finite loss
        lambda v: spread_cell(v.dropna(), ["in range"] * v.notna().sum(), 3) if v.notna().any() else "-")
    if "loss_range" in df:  # against the annealed frontier of each run's seed (mlresearch.frontier)
        for col, where, digits in (("saved_pct", "loss_range", 1), ("speedup_pct", "loss_range", 1),
                                   ("loss_gap", "flops_range", 3), ("small_loss_gap", "small_flops_range", 3)):
            if col in df:
                out[f"{col}_cell"] = g.apply(lambda d, c=col, w=where, k=digits: spread_cell(
                    d[c], d[w], k, d[f"{c}_bound"] if f"{c}_bound" in d else None), include_groups=False)
                inside = df[df[where] == "in range"].groupby(keys, dropna=False)[col]
                out[f"{col}_mean"], out[f"{col}_sd"] = inside.mean(), inside.std()
        if "small_control" in df:  # the shape its small-model control was (the same for every seed read)
            out["small_control"] = g["small_control"].first()
        out["tokens_per_parameter"] = g["tokens_per_parameter"].mean()
        out["tokens_per_non_embedding_parameter"] = g["tokens_per_non_embedding_parameter"].mean()
    return out.reset_index()


# The choices a variant shares with the paper's V-cycle or with most runs: left out of its name.
_PLAIN = {"levels": 2, "scheme": "halving", "optimizer": "reset", "budget": "preset"}


def variant_name(row) -> str:
    """A variant's name for a reader ("V-cycle, alpha 0.5", "G_stack", "small shape alone, 13500
    steps"): the method's title and each choice that sets the variant apart, never a run id."""
    title = title_of(str(row.method))
    parts = [title]
    for key, fmt in (("levels", "{} levels"), ("scheme", "{}"), ("alpha", "alpha {}"), ("optimizer", "optimizer {}"),
                     ("budget", "{}")):
        value = getattr(row, key, "-")
        if value is None or (not isinstance(value, str) and pd.isna(value)) or value == "-":
            continue
        value = int(value) if key == "levels" else value
        if _PLAIN.get(key) == value or (key == "scheme" and title.lower() in str(value).lower()):
            continue  # "G_stack x2" under G_stack says nothing new
        parts.append(fmt.format(value))
    return ", ".join(parts)


def _small_cell(cell: str, shape) -> str:
    """The loss gap to the small-model control, naming the shape trained alone it is read against:
    the run's own smallest shape (``RunRecord.smallest_shape``) where the study has that control,
    else the regime check's (:func:`mlresearch.frontier.run_savings`)."""
    return f"{cell} ({shape})" if isinstance(shape, str) and shape and cell != "no frontier yet" else cell


def markdown(table: pd.DataFrame) -> str:
    """The study table: each variant against the *annealed* frontier of its seed (saved at matched
    loss, speedup, loss at equal FLOPs against the full and the small shape), mean ± sd over seeds;
    the readings off the single unannealed 1.0x baseline curve stay in variants.csv only."""
    if table.empty:
        return "_No method runs in results/ yet._"
    cols = ["experiment", "method", "levels", "scheme", "alpha", "optimizer", "budget", "seeds",
            "method_flops_over_baseline", "saved", "speedup", "loss_gap", "small_loss_gap", "final_val_loss_gap",
            "tokens_per_parameter", "downstream"]
    t = table.copy()
    for col in ("saved_pct", "speedup_pct", "loss_gap", "small_loss_gap"):
        t[col.removesuffix("_pct")] = t[f"{col}_cell"] if f"{col}_cell" in t else "no frontier yet"
    t["small_loss_gap"] = [_small_cell(c, s) for c, s in zip(t["small_loss_gap"], t.get("small_control", [None] * len(t)))]
    t["method_flops_over_baseline"] = t["method_flops_over_baseline"].map(lambda x: f"{x:.2f}")
    t["final_val_loss_gap"] = [c + (f" (NaN/inf loss: {int(n)} seed{'s' * (n > 1)} left out)" if n else "")
                               for c, n in zip(table["final_val_loss_gap_cell"],
                                               table.get("nonfinite_seeds", pd.Series(0, index=table.index)))]
    per_param = table.get("tokens_per_parameter", pd.Series(math.nan, index=table.index))
    per_non_embedding = table.get("tokens_per_non_embedding_parameter", pd.Series(math.nan, index=table.index))
    t["tokens_per_parameter"] = ["-" if pd.isna(a) else f"{a:.1f} / {b:.1f}" for a, b in zip(per_param, per_non_embedding)]
    t["downstream"] = [_downstream_cell(r) for r in table.itertuples(index=False)]
    t = t[cols].rename(columns={"method_flops_over_baseline": "total FLOPs / 1.0x baseline",
                                "saved": "FLOPs saved % at matched loss (annealed frontier)",
                                "speedup": "speedup %",
                                "loss_gap": "loss - frontier at equal FLOPs",
                                "small_loss_gap": "loss - small shape alone at equal FLOPs (its shape)",
                                "final_val_loss_gap": "final val loss - 1.0x baseline",
                                "tokens_per_parameter": "tokens per parameter (all / non-embedding)",
                                "downstream": "downstream: method vs baseline"})
    header = "| " + " | ".join(t.columns) + " |\n|" + "---|" * len(t.columns) + "\n"
    return header + "".join("| " + " | ".join(str(v) for v in row) + " |\n" for row in t.itertuples(index=False))


def answer(table: pd.DataFrame) -> str:
    """The README's answer: for each study experiment, its headline rows (the spec's main runs and
    the best V-cycle) against the annealed frontier of their own seeds, mean ± sd over seeds, best
    saving first."""
    if table.empty:
        return "_No headline runs in results/ yet._"
    t = table.copy()
    t["_order"] = t.get("saved_pct_mean", pd.Series(math.nan, index=t.index)).fillna(-math.inf)
    t = t.sort_values(["experiment", "_order"], ascending=[True, False])
    rows = []
    for r in t.itertuples(index=False):
        cells = [getattr(r, f"{c}_cell", "no frontier yet") for c in ("saved_pct", "loss_gap", "small_loss_gap")]
        cells[-1] = _small_cell(cells[-1], getattr(r, "small_control", None))
        label = getattr(r, "label", "")
        name = variant_name(r) + (f" ({label})" if isinstance(label, str) and label else "")
        rows.append([r.experiment, name, str(int(r.seeds)), *cells,
                     "-" if pd.isna(getattr(r, "tokens_per_parameter", math.nan)) else f"{r.tokens_per_parameter:.1f}"])
    # short headers (the README's first screen, read on a narrow one too); the sentence under the table says them in full
    head = ["experiment", "method", "seeds", "FLOPs saved %", "loss gap, baseline", "loss gap, small alone",
            "tokens / param"]
    return ("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n" +
            "".join("| " + " | ".join(row) + " |\n" for row in rows))


def _seed_cell(task: str, loss: float, downstream: float, transfer: float) -> str:
    """"validation loss; downstream; transfer" of one run (an accuracy as a percentage)."""
    parts = [f"{loss:.3f}"]
    for value, accuracy in ((downstream, task_of(task).accuracy), (transfer, True)):
        if not pd.isna(value):
            parts.append(f"{100 * value:.1f}%" if accuracy else _downstream_number(task, value))
    return "; ".join(parts)


def seeds_markdown(runs: pd.DataFrame, experiment: str, labels: dict[str, str] | None = None) -> str:
    """One study experiment's every variant seed by seed, the 1.0x baseline first, then the headline
    rows (``labels``: run directory -> label, :meth:`mlresearch.study_runner.Study.headline_runs`),
    then the rest: each cell the run's final validation loss, its downstream number and, for an
    image task, its transfer probe accuracy. The spread a mean ± sd hides (one seed leaving a
    plateau late) is what this table shows."""
    labels = labels or {}
    mine = runs[runs.experiment == experiment] if len(runs) else runs
    if mine.empty:
        return f"_No runs of {experiment} in results/ yet._\n"
    mine = mine.assign(method_transfer=mine.get("method_transfer", math.nan),
                       baseline_transfer=mine.get("baseline_transfer", math.nan))
    task, seeds = mine.task.iloc[0], sorted(int(s) for s in mine.seed.unique())
    cells: dict[int, str] = {}
    for seed, rows in mine.groupby("seed"):
        base = rows.dropna(subset=["baseline_full_val_loss"])
        if len(base):
            b = base.iloc[0]
            cells[int(seed)] = _seed_cell(task, b.baseline_full_val_loss, b.baseline_downstream, b.baseline_transfer)
    body = [(0, "", ["baseline 1.0x", "1.00", *[cells.get(s, "-") for s in seeds]])]
    for _, rows in mine.groupby(VARIANT_KEYS, dropna=False, sort=False):
        first = rows.iloc[0]
        label = next((labels[r] for r in rows.run if labels.get(r)), "")
        name = variant_name(first) + (f" ({label})" if label else "")
        ratio = (rows.method_total_flops / rows.baseline_total_flops).mean()
        by_seed = {int(r.seed): _seed_cell(task, r.method_full_val_loss, r.method_downstream, r.method_transfer)
                   for r in rows.itertuples(index=False)}
        body.append((1 if any(r in labels for r in rows.run) else 2, name,
                     [name, "-" if pd.isna(ratio) else f"{ratio:.2f}", *[by_seed.get(s, "-") for s in seeds]]))
    head = ["run", "FLOPs / 1.0x", *[f"seed {s}" for s in seeds]]
    return ("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n" +
            "".join("| " + " | ".join(row) + " |\n" for _, _, row in sorted(body, key=lambda b: b[:2])))


def generated_blocks(runs: pd.DataFrame, headline: dict[str, dict[str, str]] | None = None,
                     points: pd.DataFrame | None = None) -> dict[str, str]:
    """The text of every generated block, from :func:`collect`'s rows, the headline run
    directories (with their labels) of each study experiment (:func:`mlresearch.study_runner.headlines`)
    and the frontier points (:func:`mlresearch.frontier.read_points`)."""
    table = variants(runs)
    blocks = {"results": markdown(table), "methods": methods_markdown()}
    if points is not None:
        blocks["frontiers"] = points_markdown(points)
    if headline is not None:
        mine = runs[[run in headline.get(e, {}) for e, run in zip(runs.experiment, runs.run)]] if len(runs) else runs
        labels = {(e, run): label for e, runs_ in headline.items() for run, label in runs_.items()}
        table = variants(mine)
        if len(table):  # a row's label is its runs' (the same spec run on every seed)
            named = mine.assign(label=[labels[e, run] for e, run in zip(mine.experiment, mine.run)])
            table = table.merge(named.groupby(VARIANT_KEYS, dropna=False)["label"].first().reset_index(),
                                on=VARIANT_KEYS, how="left")
        blocks["answer"] = answer(table)
        for experiment, labels in headline.items():
            blocks[SEEDS_BLOCK.format(experiment=experiment)] = seeds_markdown(runs, experiment, labels)
    return blocks


def block_text(body: str, name: str) -> str | None:
    """The text inside ``body``'s generated block ``name`` (None when it has none)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in body or end not in body:
        return None
    return body.split(start, 1)[1].split(end, 1)[0].removeprefix("\n")


def fill_blocks(path: Path, blocks: dict[str, str]) -> list[str]:
    """Rewrite every generated block of ``path`` that ``blocks`` has; returns their names. A file
    with none of them is refused (the markers were lost)."""
    from .checkpoint import atomic_write_text

    body, done = path.read_text(), []
    for name, text in blocks.items():
        if block_text(body, name) is None:
            continue
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        head, rest = body.split(start, 1)
        body = f"{head}{start}\n{text}{end}{rest.split(end, 1)[1]}"
        done.append(name)
    if not done:
        raise ValueError(f"{path} has no generated block (<!-- NAME:start --> ... <!-- NAME:end -->, NAME in "
                         f"{', '.join(blocks)})")
    atomic_write_text(path, body)
    return done


def paper_style(table: pd.DataFrame) -> pd.DataFrame:
    """Our variants in the paper's table layout (measured; the saving at matched loss against the
    annealed frontier of each seed), followed by the paper's reported rows (against one baseline)."""
    cell = table["saved_pct_cell"] if "saved_pct_cell" in table else pd.Series("no frontier yet", index=table.index)
    ours = pd.DataFrame({
        "model": table.experiment, "levels": table.levels, "alpha": table.alpha,
        "variant": table.method + ": " + table.scheme + ", optimizer " + table.optimizer + ", budget " + table.budget,
        "seeds": table.seeds, "method FLOPs / 1.0x baseline": table.method_flops_over_baseline.round(2),
        "FLOPs saving %": cell,
        "final metric vs baseline": [_downstream_cell(r) for r in table.itertuples(index=False)],
        "source": "ours (measured, tiny, CPU; vs an annealed frontier)"})
    paper = PAPER.rename(columns={"flops_saving_pct": "FLOPs saving %", "wall_saving_pct": "wall saving %"})
    paper = paper.assign(**{"final metric vs baseline": "preserved (reported)"})
    return pd.concat([ours, paper], ignore_index=True)


def paper_tables(runs: pd.DataFrame, headline: dict[str, dict[str, str]] | None = None) -> pd.DataFrame:
    """The paper's Tables 1, 2 and 3 row by row, each beside what we measured of that method on the study
    experiment the table is read against (:func:`collect` rows): FLOPs saved at matched loss against
    the annealed frontier and the loss gap at equal FLOPs, mean ± sd over seeds, and the downstream
    check; one row per variant we ran (for the V-cycle, only the study's headline ones when
    ``headline``, :func:`mlresearch.study_runner.headlines`, is given), then the methods we ran that the
    paper's table has no row for. A reported number is the paper's, against its one baseline at base
    scale on GPUs; ours are small models on a CPU: side by side for reading, not like for like."""
    rows = []
    for name, experiment in PAPER_TABLE_EXPERIMENTS.items():
        mine_runs = runs[runs.experiment == experiment] if len(runs) else runs
        if headline is not None and len(mine_runs):
            keep = (mine_runs.method != "vcycle") | mine_runs.run.isin(list(headline.get(experiment, {})))
            mine_runs = mine_runs[keep]
        ours = variants(mine_runs) if len(mine_runs) else pd.DataFrame()
        reported = PAPER_TABLES[PAPER_TABLES.table == name]
        ran = set(ours.method) if len(ours) else set()
        for method in list(reported.method) + sorted(ran - set(reported.method) - {"small"}):
            paper = reported[reported.method == method]
            paper = paper.iloc[0] if len(paper) else None
            cells = {"table": name, "method": title_of(method),
                     "paper: FLOPs saving %": _reported(paper, "flops"), "paper: wall saving %": _reported(paper, "wall"),
                     "paper: downstream": _reported(paper, "metric")}
            mine = ours[ours.method == method] if len(ours) else ours
            if method == "baseline":
                rows.append({**cells, "ours": f"{experiment}: the annealed frontier (saving 0 by definition)",
                             "ours: downstream": _baseline_downstream(ours)})
            elif not len(mine):
                rows.append({**cells, "ours": f"{experiment}: not run yet"})
            else:
                rows.extend({**cells, "ours": f"{experiment}: {variant_name(r)}", "seeds": int(r.seeds),
                             "ours: FLOPs saved % at matched loss": getattr(r, "saved_pct_cell", "no frontier yet"),
                             "ours: loss - frontier at equal FLOPs": getattr(r, "loss_gap_cell", "no frontier yet"),
                             "ours: downstream": _downstream_cell(r)} for r in mine.itertuples(index=False))
    table = pd.DataFrame(rows)
    return table.fillna({"seeds": 0}).astype({"seeds": int}).fillna("-") if len(table) else table


def _baseline_downstream(ours: pd.DataFrame) -> str:
    """The baseline's downstream number, read beside the variants with the most seeds."""
    if not len(ours) or ours.baseline_downstream.isna().all():
        return "-"
    best = ours[ours.baseline_downstream.notna()].sort_values("seeds", ascending=False).iloc[0]
    return f"{task_of(best.task).downstream.label} {_downstream_number(best.task, best.baseline_downstream)} " \
           f"({int(best.seeds)} seeds)"


def _downstream_number(task: str, value: float) -> str:
    """A downstream number as the tables print it (a perplexity to 0.1, an accuracy to 0.001)."""
    return f"{value:.{task_of(task).downstream.digits}f}"


def _reported(row, key: str) -> str:
    if row is None:
        return "no such row"
    value = row[key]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "not in our sources"
    return f"{value:+.1f}" if isinstance(value, float) else str(value)


def _downstream_cell(row) -> str:
    if pd.isna(row.method_downstream) or pd.isna(row.baseline_downstream):
        return "-"
    name = task_of(row.task).downstream.label
    cell = (f"{name} {_downstream_number(row.task, row.method_downstream)} vs "
            f"{_downstream_number(row.task, row.baseline_downstream)}")
    if task_of(row.task).accuracy:
        cell += "; val-acc target " + ("not reached" if pd.isna(row.acc_flops_saving_pct) else
                                       f"reached {int(row.reached_acc)}/{int(row.seeds)}, "
                                       f"{row.acc_flops_saving_pct:.1f}% FLOPs saving")
    return cell


def write_tables(results: str | Path = "results", docs: list | tuple = (),
                 headline: dict[str, dict[str, str]] | None = None) -> pd.DataFrame:
    """``results/tables/{runs,variants}.csv`` and ``variants.md``; then every generated block of the
    ``docs`` files (the README, docs/*.md)."""
    from .checkpoint import atomic_write_text

    results = Path(results)
    runs = collect(results)
    table = variants(runs)
    (results / "tables").mkdir(parents=True, exist_ok=True)
    atomic_write_text(results / "tables" / "runs.csv", runs.to_csv(index=False))
    atomic_write_text(results / "tables" / "variants.csv", table.to_csv(index=False))
    atomic_write_text(results / "tables" / "variants.md", markdown(table))
    if docs:
        blocks = generated_blocks(runs, headline, read_points(results))
        for path in docs:
            fill_blocks(Path(path), blocks)
    return table


def curves(run: str | Path) -> pd.DataFrame:
    """A run's evaluation rows (loss vs cumulative FLOPs), with phase and level."""
    rows = [r for r in read_metrics(run) if "val_loss" in r and "event" not in r]
    return pd.DataFrame(rows)
