"""The regime check's arithmetic (mlresearch.analysis.regime): the small model's loss read off its curve
at the baseline's FLOPs, the margin, the verdict against the seed spread, and the table merge that
keeps other experiments' rows."""

import json
import math

import pandas as pd
import pytest

from conftest import write_run
from mlresearch.analysis.regime import loss_at_flops, merge_rows, regime_row, verdict


def _curve(points):
    return pd.DataFrame(points, columns=["flops", "val_loss"])


def test_loss_at_flops_is_linear_in_log_flops_between_evaluations():
    curve = _curve([(1e9, 6.0), (1e10, 5.0), (1e12, 3.0)])
    assert loss_at_flops(curve, 1e10) == 5.0  # on an evaluation: exactly its loss
    # 1e11 lies halfway between 1e10 and 1e12 in log FLOPs (not at 1/11 of the way, as in linear FLOPs)
    assert loss_at_flops(curve, 1e11) == pytest.approx(4.0, abs=1e-12)
    t = (math.log(3e9) - math.log(1e9)) / (math.log(1e10) - math.log(1e9))
    assert loss_at_flops(curve, 3e9) == pytest.approx(6.0 - t, abs=1e-12)


def test_a_curve_that_ends_before_the_baselines_flops_is_refused_not_extrapolated():
    with pytest.raises(ValueError, match="ends at 1e\\+12 FLOPs, before 2e\\+12"):
        loss_at_flops(_curve([(1e9, 6.0), (1e12, 3.0)]), 2e12)
    assert loss_at_flops(_curve([(1e9, 6.0), (1e12, 3.0)]), 1e12 * (1 + 1e-12)) == 3.0  # rounding is not an end


def _finished(path, evals, final_val, flops_total, kind):
    write_run(path, [{"step": i, "flops": f, "val_loss": v} for i, (f, v) in enumerate(evals)]
              + [{"event": "final", "val_loss": 99.0, "flops": 1.0}], kind)  # events are not evaluations
    summary = json.loads((path / "summary.json").read_text())
    summary.update(final_full_val={"val_loss": final_val}, flops_total=flops_total)
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_regime_row_reads_both_runs_and_signs_the_margin_so_positive_means_the_full_model_wins(tmp_path):
    base = _finished(tmp_path / "baseline-seed3", [(1e10, 5.0), (4e10, 3.5)], 3.4, 4e10, "baseline")
    small = _finished(tmp_path / "small-equalflops-seed3", [(1e10, 4.0), (2e10, 3.8), (8e10, 3.2)], 3.1, 8e10, "small")
    gains = {base: 2.5, small: 1.5}
    row = regime_row("exp", 3, base, small, 1234, word_order=gains.__getitem__)
    t = (math.log(4e10) - math.log(2e10)) / (math.log(8e10) - math.log(2e10))
    small_at = 3.8 + t * (3.2 - 3.8)
    assert row == pytest.approx({"experiment": "exp", "seed": 3, "baseline_final_val_loss": 3.4, "baseline_flops": 4e10,
                                 "small_val_loss_at_baseline_flops": small_at, "small_steps": 1234,
                                 "small_final_val_loss": 3.1, "margin": small_at - 3.4,
                                 "baseline_word_order_gain": 2.5, "small_word_order_gain": 1.5})
    assert row["margin"] > 0  # 3.5 at the baseline's FLOPs against 3.4
    assert "baseline_word_order_gain" not in regime_row("exp", 3, base, small, 1234)  # images: no word order


def _rows(experiment, baselines, smalls, commit="a"):
    return pd.DataFrame([{"experiment": experiment, "seed": s, "baseline_final_val_loss": b,
                          "small_val_loss_at_baseline_flops": m, "margin": m - b, "git_commit": commit}
                         for s, (b, m) in enumerate(zip(baselines, smalls))])


def test_in_the_regime_only_when_every_seeds_margin_exceeds_the_baselines_seed_spread():
    clear = verdict(_rows("e", [3.0, 3.1, 3.05], [3.3, 3.35, 3.4]))
    assert clear["spread"] == pytest.approx(0.1) and clear["margin_min"] == pytest.approx(0.25)
    assert clear["in_regime"] and clear["seeds"] == 3
    assert clear["baseline"] == pytest.approx(3.05) and clear["margin"] == pytest.approx((0.3 + 0.25 + 0.35) / 3)
    # a large mean margin carried by two seeds, the third inside the spread: not in the regime
    lucky = verdict(_rows("e", [3.0, 3.1, 3.05], [3.6, 3.7, 3.1]))
    assert lucky["margin"] > lucky["spread"] and not lucky["in_regime"]
    assert not verdict(_rows("e", [3.0], [2.9]))["in_regime"]  # the small model alone wins: out of the regime


def test_a_rerun_replaces_its_own_rows_and_keeps_every_other_experiments():
    previous = pd.concat([_rows("gpt2", [3.0, 3.1], [3.2, 3.3]), _rows("bert", [4.0], [3.9])], ignore_index=True)
    new = _rows("bert", [3.7, 3.8], [3.9, 3.95], commit="b")
    merged = merge_rows(previous, new)
    assert list(zip(merged.experiment, merged.seed)) == [("bert", 0), ("bert", 1), ("gpt2", 0), ("gpt2", 1)]
    assert merged.query("experiment == 'bert'").git_commit.tolist() == ["b", "b"]  # seed 0 replaced, not doubled
    assert merged.query("experiment == 'gpt2'").baseline_final_val_loss.tolist() == [3.0, 3.1]
    assert merge_rows(pd.DataFrame(), new).equals(new)  # the first run: nothing to keep


def test_rereading_unchanged_runs_keeps_the_commit_that_wrote_their_rows():
    """`--finished` from a later checkout re-reads the same runs: an unchanged row keeps its commit,
    a changed value takes the new one."""
    previous = _rows("deit", [1.4, 1.8], [2.8, 2.3], commit="a")
    again = merge_rows(previous, _rows("deit", [1.4, 1.8], [2.8, 2.3], commit="b"))
    assert again.git_commit.tolist() == ["a", "a"]
    changed = merge_rows(previous, _rows("deit", [1.4, 1.7], [2.8, 2.3], commit="b"))
    assert changed.git_commit.tolist() == ["a", "b"] and changed.baseline_final_val_loss.tolist() == [1.4, 1.7]
