"""Compare a method's run (V-cycle, small-model control, ...) with its baseline from their metrics files.

The target is the baseline's final validation loss. For each run we take the FLOPs (and wall
time) at the first evaluation whose validation loss is at or below the target; for the V-cycle
only evaluations of the full-size model after the cycle (its last phase) count. A method that ends
above the target is also measured at its own final loss: the FLOPs the baseline first needed to
get there against the method's total (``flops_saving_at_final_pct``, negative when the method
spent more). Image runs also get the same measurement for the baseline's final validation
accuracy. Tokens to the target (images for image tasks) are read at the same points as the FLOPs:
the ledger's cumulative count, which for a multi-level run includes what its smaller models saw
(a small model sees more tokens per FLOP, so a method can save FLOPs and still need more data).

The saving at the target is measured at points that were evaluated, no interpolation: the method is
charged its first evaluation at or below the target (a conservative reading: it may have got there
up to an evaluation interval sooner), the baseline its exact final point. The saving at the method's
own final loss is the one place where the baseline's FLOPs are read *between* its evaluations: taking
its first evaluation at or below that loss charged the baseline up to a whole interval too much and
flattered the method by up to that interval's share of the budget (8 points on gpt2_regime), so the
crossing is read on the straight line between the evaluation before and the one at or below it
(:func:`flops_to_loss`; on a convex falling curve the chord still crosses slightly late).
"""

from __future__ import annotations

from pathlib import Path

import dataclasses
import math

from ..checkpoint import read_structured
from ..errors import MLResearchError
from .config import DataConfig, ModelConfig, flatten_config
from .methods import title_of
from .engine import read_metrics

# What a loss means: the data (corpus, vocabulary, splits, masking), the task, the model's family and
# shape, the experiment and seed. Everything else -- method sections, budgets, LR schedules, threads
# -- may differ between a method's run and its baseline; these may not.
MEASURED = ("experiment", "seed", "task", "data", "model")
NOT_MEASURED = {"data.num_proc", "data.prepared_dir"}  # where and how fast data is read


def _evals(rows, phase: str | None = None):
    return [r for r in rows if "val_loss" in r and "event" not in r and (phase is None or r["phase"] == phase)]


def reach(rows, target: float, phase: str | None = None, key: str = "val_loss") -> dict | None:
    """First evaluation at or past ``target`` (loss: at or below; accuracy: at or above)."""
    for r in _evals(rows, phase):
        if key in r and (r[key] >= target if key.endswith("acc") else r[key] <= target):
            return r
    return None


def flops_to_loss(rows, loss: float) -> float | None:
    """The FLOPs at which the run's validation curve, drawn as straight lines between its
    evaluations, first comes down to ``loss``; None when no evaluation gets there. At the first
    evaluation (nothing before it to interpolate from) its own FLOPs."""
    evals = _evals(rows)
    for before, at in zip([None] + evals[:-1], evals):
        if at["val_loss"] <= loss:
            if before is None:
                return float(at["flops"])
            share = (before["val_loss"] - loss) / (before["val_loss"] - at["val_loss"])
            return float(before["flops"] + share * (at["flops"] - before["flops"]))
    return None


class CompareError(MLResearchError, ValueError):
    """The two runs cannot be compared (unfinished, swapped, another experiment or seed)."""


class NonFiniteLoss(CompareError):
    """A run's metrics hold a NaN or infinite validation loss: no saving can be read from it."""


def measured_settings(run: Path) -> dict:
    """The run's settings that define what its losses measure (:data:`MEASURED`), from its
    ``config.yaml``; a data or model key the stored config lacks (written before the key existed)
    has its default."""
    config = read_structured(run / "config.yaml", "run config", CompareError, fmt="yaml")
    if not isinstance(config, dict):
        raise CompareError(f"{run / 'config.yaml'} is not a run config")
    flat = {k: v for k, v in flatten_config(config) if k.split(".")[0] in MEASURED and k not in NOT_MEASURED}
    for section, cls in (("data", DataConfig), ("model", ModelConfig)):
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            if key not in flat and key not in NOT_MEASURED and f.default is not dataclasses.MISSING:
                flat[key] = list(f.default) if isinstance(f.default, tuple) else f.default
    return flat


def first_difference(a: dict, b: dict) -> str | None:
    """The first key (sorted) whose value differs between two flat mappings, with both values."""
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return f"{key} ({a.get(key)!r} vs {b.get(key)!r})"
    return None


def check_finite(rows, run) -> None:
    for r in _evals(rows):
        if isinstance(r["val_loss"], bool) or not isinstance(r["val_loss"], (int, float)):
            raise CompareError(f"{run}/metrics.jsonl: validation loss {r['val_loss']!r} at {r.get('phase')} step "
                               f"{r.get('step')} is not a number; the file was damaged")
        if not math.isfinite(float(r["val_loss"])):
            raise NonFiniteLoss(f"{run}: validation loss {r['val_loss']} at {r.get('phase')} step {r.get('step')} "
                                "(metrics.jsonl): no saving is read from a run that diverged")


def _finished(run: Path, role: str) -> dict:
    path = run / "summary.json"
    if not path.is_file():
        raise CompareError(f"{run} is not a finished run (no summary.json): finish it (--resume) before comparing")
    summary = read_structured(path, f"{role} summary", CompareError)
    if not isinstance(summary, dict):
        raise CompareError(f"{path} is not a run summary")
    return summary


def check_comparable(baseline: str | Path, method: str | Path) -> str:
    """Refuse pairs whose saving would mean nothing: unfinished runs, arguments in the wrong order,
    runs of different experiments or seeds."""
    method_dir = method
    base, other = _finished(Path(baseline), "baseline"), _finished(Path(method_dir), "compared")
    if base.get("kind") != "baseline":
        hint = " (the arguments are in the wrong order?)" if other.get("kind") == "baseline" else ""
        raise CompareError(f"the first run must be a baseline; {baseline} is a {base.get('kind')!r} run{hint}")
    if other.get("kind") == "baseline":
        raise CompareError(f"{method_dir} is a baseline too; compare a method's run against its baseline")
    for key in ("experiment", "seed"):
        if base.get(key) != other.get(key):
            raise CompareError(f"the runs differ in {key} ({base.get(key)!r} vs {other.get(key)!r}): a saving is "
                               "measured against the baseline of the same experiment and seed")
    differs = first_difference(measured_settings(Path(baseline)), measured_settings(Path(method_dir))) or \
        first_difference({f"data as trained: {k}": v for k, v in (base.get("data") or {}).items()},
                         {f"data as trained: {k}": v for k, v in (other.get("data") or {}).items()})
    if differs:
        raise CompareError(f"{baseline} and {method_dir} measure different things: they differ in {differs}; a "
                           "saving is read only against a baseline of the same data, task and model")
    return other.get("kind") or "vcycle"  # the compared run's method (runs before summaries named it: V-cycles)


def compare_runs(baseline: str | Path, method: str | Path) -> dict:
    """A method's run (its directory) against the baseline run of its seed."""
    kind, method_dir = check_comparable(baseline, method), method
    base, vc = read_metrics(baseline), read_metrics(method_dir)
    check_finite(base, baseline)
    check_finite(vc, method_dir)
    base_evals = _evals(base)
    if not base_evals:
        raise CompareError(f"{baseline}/metrics.jsonl has no validation rows: nothing to compare against")
    target = base_evals[-1]["val_loss"]
    if not _evals(vc):
        raise CompareError(f"{method_dir}/metrics.jsonl has no validation rows: nothing to compare")
    final_phase = [r for r in vc if "event" not in r][-1]["phase"]
    b, v = reach(base, target), reach(vc, target, final_phase)
    vc_last = _evals(vc, final_phase)[-1]
    out = {
        "method": kind, "target_val_loss": target,
        "baseline_flops": b["flops"], "baseline_wall": b["wall"], "baseline_total_flops": base_evals[-1]["flops"],
        "baseline_tokens": b.get("tokens"), "method_total_tokens": vc_last.get("tokens"),
        "method_final_val_loss": vc_last["val_loss"],
        "method_total_flops": vc_last["flops"], "method_total_wall": vc_last["wall"],
        "reached": v is not None,
    }
    if "val_acc" in base_evals[-1]:
        target_acc = base_evals[-1]["val_acc"]
        b_acc, v_acc = reach(base, target_acc, key="val_acc"), reach(vc, target_acc, final_phase, key="val_acc")
        out.update(baseline_final_val_acc=target_acc, method_final_val_acc=vc_last.get("val_acc"),
                   reached_acc=v_acc is not None)
        if v_acc is not None:
            out["acc_flops_saving_pct"] = 100 * (1 - v_acc["flops"] / b_acc["flops"])
    # Where the baseline's curve first came down to the method's *own* final loss: a saving (or,
    # negative, an extra cost) at matched loss even when the method ends above the target. None when
    # the method ended below anything the baseline reached (then it reached the target, and the
    # saving above applies).
    b_final = flops_to_loss(base, vc_last["val_loss"])
    if b_final is not None:
        out.update(baseline_flops_to_method_final=b_final,
                   flops_saving_at_final_pct=100 * (1 - vc_last["flops"] / b_final))
    if v is not None:
        out.update(method_flops=v["flops"], method_wall=v["wall"], method_tokens=v.get("tokens"),
                   flops_saving_pct=100 * (1 - v["flops"] / b["flops"]),
                   wall_saving_pct=100 * (1 - v["wall"] / b["wall"]))
    return out


def format_comparison(c: dict) -> str:
    name = title_of(c.get("method", "vcycle"))
    lines = [f"target (baseline final val loss): {c['target_val_loss']:.4f}",
             f"baseline: {c['baseline_flops']:.3e} FLOPs, {c['baseline_wall']:.1f} s{_tokens(c['baseline_tokens'])}"]
    if c["reached"]:
        lines += [f"{name} reached it at {c['method_flops']:.3e} FLOPs, {c['method_wall']:.1f} s"
                  f"{_tokens(c['method_tokens'])}",
                  f"saving: {c['flops_saving_pct']:.1f}% FLOPs, {c['wall_saving_pct']:.1f}% wall time"]
    else:
        lines += [f"{name} did NOT reach it: final val loss {c['method_final_val_loss']:.4f} after "
                  f"{c['method_total_flops']:.3e} FLOPs ({c['method_total_wall']:.1f} s)"]
        if "flops_saving_at_final_pct" in c:
            lines.append(f"at that loss: the baseline got there at {c['baseline_flops_to_method_final']:.3e} FLOPs, so "
                         f"{name} {'saved' if c['flops_saving_at_final_pct'] >= 0 else 'spent'} "
                         f"{abs(c['flops_saving_at_final_pct']):.1f}% {'' if c['flops_saving_at_final_pct'] >= 0 else 'more '}"
                         "FLOPs for the same loss")
    if "baseline_final_val_acc" in c:
        lines.append(f"val accuracy: baseline {c['baseline_final_val_acc']:.4f}, {name} {c['method_final_val_acc']:.4f}"
                     + (f"; reached at {c['acc_flops_saving_pct']:.1f}% FLOPs saving" if c["reached_acc"] else
                        f"; {name} did NOT reach the baseline's final accuracy"))
    return "\n".join(lines)


def _tokens(n) -> str:
    return "" if n is None else f", {n:.4g} tokens"
