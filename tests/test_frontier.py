"""The saving at matched loss against an annealed frontier (mlresearch.frontier), on hand-built
frontiers whose answers are known in closed form."""

import math

import pandas as pd
import pytest

from mlresearch.frontier import Frontier, FrontierError, run_savings, spread_cell

# A baseline frontier at 0.4x, 0.6x, 0.8x, 1.0x of a 1e12-FLOP budget.
POINTS = [(0.4e12, 3.6), (0.6e12, 3.4), (0.8e12, 3.3), (1.0e12, 3.25)]


def test_a_run_on_the_frontier_saves_nothing():
    f = Frontier.of(POINTS)
    for flops, loss in POINTS:
        s = f.saving(flops, loss)
        assert s["saved"] == pytest.approx(0.0, abs=1e-12) and s["speedup"] == pytest.approx(0.0, abs=1e-12)
        assert s["loss_gap"] == pytest.approx(0.0, abs=1e-12)


def test_reaching_the_06x_loss_at_05x_saves_one_sixth():
    s = Frontier.of(POINTS).saving(0.5e12, 3.4)
    assert s["saved"] == pytest.approx(1 / 6) and s["speedup"] == pytest.approx(0.6 / 0.5 - 1)
    assert s["loss_range"] == "in range"


def test_interpolation_is_linear_in_log_flops():
    """Between two points the loss is linear in log FLOPs: the midpoint loss sits at the geometric
    mean of the budgets (an independent computation)."""
    f = Frontier.of([(1e12, 3.0), (4e12, 2.0)])
    flops, _ = f.flops_to(2.5)
    assert flops == pytest.approx(2e12)
    assert f.loss_at(2e12)[0] == pytest.approx(2.5)
    # and the gap at equal FLOPs is the method's loss minus that
    assert f.saving(2e12, 2.6)["loss_gap"] == pytest.approx(0.1)


def test_outside_the_frontier_is_reported_never_extrapolated():
    f = Frontier.of(POINTS)
    better = f.saving(0.9e12, 3.0)  # below the 1.0x point's loss
    assert better["saved"] is None and better["loss_range"] == "below"
    worse = f.saving(0.9e12, 3.9)   # above the 0.4x point's loss
    assert worse["saved"] is None and worse["loss_range"] == "above"
    cheap = f.saving(0.1e12, 3.5)   # spent less than the smallest budget
    assert cheap["loss_gap"] is None and cheap["flops_range"] == "below"
    assert cheap["saved"] == pytest.approx(1 - 0.1e12 / f.flops_to(3.5)[0])
    assert f.saving(2e12, 3.3)["flops_range"] == "above" and f.saving(2e12, 3.3)["saved"] == pytest.approx(-1.5)


def test_a_budget_rounded_to_whole_steps_is_read_at_the_end_point_it_rounds():
    """The small shape's equal-FLOPs control rounds its steps up and so spends a hair more than the
    1.0x point: read at that point (gap = its loss minus the 1.0x loss), while a budget 1% past it
    is still outside the frontier."""
    f = Frontier.of(POINTS)
    hair = f.saving(1.0e12 * (1 + 1e-5), 3.5)
    assert hair["flops_range"] == "in range" and hair["loss_gap"] == pytest.approx(3.5 - 3.25)
    low = f.saving(0.4e12 * (1 - 1e-5), 3.7)
    assert low["flops_range"] == "in range" and low["loss_gap"] == pytest.approx(3.7 - 3.6)
    assert f.saving(1.01e12, 3.5)["flops_range"] == "above" and f.saving(0.39e12, 3.7)["flops_range"] == "below"


def test_a_point_no_better_than_a_smaller_budget_is_not_on_the_frontier():
    """A larger budget ending no lower than a smaller one (its LR mistuned for its length) is dropped:
    the frontier neither bends back up nor stays flat out to it, and a loss below the best point is
    bounded by the best point's budget, not the dropped one's."""
    f = Frontier.of([(1e12, 3.0), (2e12, 3.1), (4e12, 2.8)])
    assert f.flops == (1e12, 4e12) and f.loss == (3.0, 2.8)
    assert f.flops_to(2.9) == (pytest.approx(2e12), "in range")  # halfway in log FLOPs from 1e12 to 4e12
    # flattened out to 2e12 instead, the frontier would need more FLOPs for 2.9 and lend a run a saving
    assert f.saving(1.5e12, 2.9)["saved"] == pytest.approx(0.25)
    late = Frontier.of([(1e12, 3.0), (2e12, 2.5), (3e12, 2.6)])
    assert late.flops == (1e12, 2e12)
    s = late.saving(2.5e12, 2.4)
    assert s["loss_range"] == "below" and s["saved_bound"] == pytest.approx(1 - 2.5 / 2)
    assert s["flops_range"] == "above" and s["loss_gap"] is None  # past the best point: nothing read
    alone = Frontier.of([(1e12, 3.0), (2e12, 3.0)])  # a tie is no better: one point left
    assert alone.flops == (1e12,) and alone.flops_to(3.0) == (1e12, "in range")
    assert alone.saving(1e12, 2.9)["saved_bound"] == pytest.approx(0.0)


@pytest.mark.parametrize("points", [[(1e12, 3.0)], [(1e12, 3.0), (1e12, 2.9)], [(1e12, 3.0), (0, 2.9)],
                                    [(1e12, float("nan")), (2e12, 2.9)]])
def test_unreadable_frontiers_are_refused(points):
    with pytest.raises(FrontierError):
        Frontier.of(points)


def _points(seed_losses: dict[int, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"experiment": "e", "method": "baseline", "role": "frontier", "seed": seed,
                          "flops": flops, "val_loss": loss}
                         for seed, losses in seed_losses.items() for (flops, _), loss in zip(POINTS, losses)])


def test_each_run_is_read_against_its_own_seeds_frontier():
    """Seed 1's frontier is seed 0's shifted down by 0.1: the same run (0.5e12 FLOPs, loss 3.4)
    saves 1/6 against seed 0 and costs against seed 1; swapping seeds would swap the answers."""
    points = _points({0: [3.6, 3.4, 3.3, 3.25], 1: [3.5, 3.3, 3.2, 3.15]})
    points = pd.concat([points, points.assign(role="lr check", val_loss=1.0)])  # never frontier points
    runs = pd.DataFrame([{"experiment": "e", "seed": 0, "method_total_flops": 0.5e12, "method_full_val_loss": 3.4},
                         {"experiment": "e", "seed": 1, "method_total_flops": 0.5e12, "method_full_val_loss": 3.4},
                         {"experiment": "other", "seed": 0, "method_total_flops": 0.5e12, "method_full_val_loss": 3.4}])
    s = run_savings(runs, points)
    assert s.saved_pct[0] == pytest.approx(100 / 6)
    seed1 = Frontier.of(zip([c for c, _ in POINTS], [3.5, 3.3, 3.2, 3.15]))
    assert s.saved_pct[1] == pytest.approx(100 * (1 - 0.5e12 / seed1.flops_to(3.4)[0])) and s.saved_pct[1] < 0
    assert s.loss_range[2] == "no frontier" and pd.isna(s.saved_pct[2])


def test_cells_show_spread_and_never_a_number_for_seeds_out_of_range():
    assert spread_cell([10.0, 12.0], ["in range", "in range"]) == f"+11.0 ± {math.sqrt(2):.1f}"
    assert spread_cell([10.0, None], ["in range", "above"]) == "+10.0 (1/2 seeds; 1 above its range)"
    assert spread_cell([None, None], ["below", "below"]) == "- (0/2 seeds; 2 below its range)"
    assert spread_cell([None], ["no frontier"]) == "no frontier yet"


def test_a_loss_outside_the_range_is_bounded_and_every_longer_frontier_keeps_the_bound():
    """Below the largest budget's loss the run saved more than 1 - C/C_max; above the smallest's, less
    than 1 - C/C_min. Independent check: extend the frontier with a point past either end (any
    non-increasing extension) and the saving it then reads honours the bound."""
    f = Frontier.of(POINTS)
    better = f.saving(0.9e12, 3.0)
    assert better["saved_bound"] == pytest.approx(1 - 0.9 / 1.0) and better["speedup_bound"] == pytest.approx(1.0 / 0.9 - 1)
    worse = f.saving(0.9e12, 3.9)
    assert worse["saved_bound"] == pytest.approx(1 - 0.9 / 0.4)
    for longer in ([*POINTS, (1.5e12, 3.1), (3e12, 2.9)], [*POINTS, (1.2e12, 2.99)]):
        assert Frontier.of(longer).saving(0.9e12, 3.0)["saved"] > better["saved_bound"]
    for shorter in ([(0.1e12, 4.2), *POINTS], [(0.39e12, 3.95), *POINTS]):
        assert Frontier.of(shorter).saving(0.9e12, 3.9)["saved"] < worse["saved_bound"]
    assert f.saving(0.5e12, 3.4)["saved_bound"] is None  # in range: a value, no bound


def test_cells_state_the_bound_of_each_seed_out_of_range():
    assert spread_cell([None], ["below"], 1, [14.63]) == "- (0/1 seeds; 1 below its range: > +14.6)"
    # a run that spent a hair more than the largest budget (equal-FLOPs steps are rounded up): +0.0, not -0.0
    assert spread_cell([None], ["below"], 1, [-0.003]) == "- (0/1 seeds; 1 below its range: > +0.0)"
    assert spread_cell([-0.04], ["in range"]) == "+0.0"
    assert spread_cell([10.0, None, None], ["in range", "above", "above"], 1, [None, -100.0, -120.04]) == \
        "+10.0 (1/3 seeds; 2 above its range: < -100.0, < -120.0)"
    assert spread_cell([10.0, None], ["in range", "above"], 1, [None, float("nan")]) == "+10.0 (1/2 seeds; 1 above its range)"
    runs = pd.DataFrame([{"experiment": "e", "seed": 0, "method_total_flops": 0.9e12, "method_full_val_loss": 3.0}])
    s = run_savings(runs, _points({0: [3.6, 3.4, 3.3, 3.25]}))
    assert pd.isna(s.saved_pct[0]) and s.saved_pct_bound[0] == pytest.approx(10.0)


def test_each_run_is_read_against_the_small_shape_it_trained_else_the_regime_control():
    """Two small-model controls on one seed: the regime check's (1L/64d/2h, losses 3.9 / 3.8) and a
    half-width one (2L/64d/2h, 3.5 / 3.4). A run whose smallest shape is the half-width one is read
    against that frontier; a run through a shape without a control (1L/128d/4h) against the regime
    check's; rows written before controls had shapes are the regime check's, whatever the run."""
    base = _points({0: [3.6, 3.4, 3.3, 3.25]})
    small = pd.DataFrame([{"experiment": "e", "method": "small", "role": "frontier", "seed": 0, "flops": c,
                           "val_loss": loss, "shape": shape, "regime_control": regime}
                          for shape, regime, losses in (("1L/64d/2h", True, (3.9, 3.8)), ("2L/64d/2h", False, (3.5, 3.4)))
                          for c, loss in zip((0.5e12, 1.0e12), losses)])
    runs = pd.DataFrame([{"experiment": "e", "seed": 0, "method_total_flops": 1.0e12, "method_full_val_loss": 3.3,
                          "smallest_shape": shape} for shape in ("2L/64d/2h", "1L/128d/4h", "1L/64d/2h")])
    s = run_savings(runs, pd.concat([base, small]))
    assert list(s.small_control) == ["2L/64d/2h", "1L/64d/2h", "1L/64d/2h"]
    assert list(s.small_loss_gap) == pytest.approx([3.3 - 3.4, 3.3 - 3.8, 3.3 - 3.8])
    old = pd.concat([base, small[small.regime_control].drop(columns=["shape", "regime_control"])])
    s = run_savings(runs, old)
    assert list(s.small_loss_gap) == pytest.approx([3.3 - 3.8] * 3) and list(s.small_control) == [""] * 3


def test_a_variants_seeds_are_never_averaged_over_two_small_controls():
    """While a shape's own control frontier exists on seed 0 only, seed 0 reads against it (2L/64d/2h)
    and seeds 1, 2 against the regime check's (1L/64d/2h): the variant's cell is seed 0's gap alone,
    the other seeds "without one", never the mean of gaps to two different models. A variant whose
    seeds share a control is read over all of them."""
    from mlresearch.study import markdown, variants

    def run(method, seed, gap, control):
        return {"experiment": "e", "method": method, "levels": 2, "scheme": "-", "alpha": "-", "optimizer": "-",
                "budget": "preset", "seed": seed, "reached": False, "task": "causal_lm", "baseline_total_flops": 1e12,
                "method_total_flops": 0.8e12, "loss_range": "in range", "flops_range": "in range", "saved_pct": 1.0,
                "speedup_pct": 1.0, "loss_gap": 0.1, "smallest_shape": "2L/64d/2h" if method == "staged" else "1L/64d/2h",
                "small_loss_gap": gap, "small_control": control, "small_flops_range": "in range"}

    rows = [run("staged", 0, 0.06, "2L/64d/2h"), run("staged", 1, -1.4, "1L/64d/2h"), run("staged", 2, -2.7, "1L/64d/2h"),
            *(run("vcycle", seed, gap, "1L/64d/2h") for seed, gap in ((0, 0.2), (1, 0.4), (2, 0.3)))]
    table = variants(pd.DataFrame(rows)).set_index("method")
    assert table.small_loss_gap_cell["staged"] == "+0.060 (1/3 seeds; 2 without one)"
    assert table.small_control["staged"] == "2L/64d/2h"
    assert table.small_loss_gap_cell["vcycle"] == "+0.300 ± 0.100" and table.small_control["vcycle"] == "1L/64d/2h"
    assert "+0.060 (1/3 seeds; 2 without one) (2L/64d/2h)" in markdown(table.reset_index())


def test_the_frontier_figure_draws_each_small_shape_alone_as_its_own_curve():
    """Two small-model controls (1L/64d/2h on 2 budgets; 2L/64d/2h, 1.0x only): two curves, each
    the mean of its own shape's points, never one averaged across shapes at a shared budget."""
    import matplotlib

    matplotlib.use("Agg")
    from mlresearch.analysis.plots import frontier_figure

    base = _points({0: [3.6, 3.4, 3.3, 3.25]})
    small = pd.DataFrame([{"experiment": "e", "method": "small", "role": "frontier", "seed": 0, "budget": b,
                           "flops": b * 1e12, "val_loss": loss, "shape": shape}
                          for shape, b, loss in (("1L/64d/2h", 0.5, 3.9), ("1L/64d/2h", 1.0, 3.8), ("2L/64d/2h", 1.0, 3.0))])
    base = base.assign(budget=base.flops / 1e12, shape="2L/128d/4h")
    runs = pd.DataFrame(columns=["experiment", "method", "levels", "scheme", "alpha", "optimizer", "budget", "run",
                                 "method_total_flops", "method_full_val_loss"])
    fig = frontier_figure(pd.concat([base, small]), runs, "e")
    drawn = {line.get_label().split(" alone")[0]: list(line.get_ydata()) for line in fig.axes[0].get_lines()
             if line.get_label().startswith("small")}
    assert drawn == {"small shape 1L/64d/2h": [3.9, 3.8], "small shape 2L/64d/2h": [3.0]}
    # a budget with fewer seeds so far (one still running) is said in the curve's label
    more = pd.concat([base, base.assign(seed=1)[base.budget < 1.0]])
    labels = [line.get_label() for line in frontier_figure(more, runs, "e").axes[0].get_lines()]
    assert any(label.startswith("baseline") and label.endswith("(1-2 seeds by budget)") for label in labels), labels
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert any(label.startswith("baseline") and label.endswith("(1 seed)") for label in labels), labels


def test_the_frontier_figure_marks_a_seeds_dominated_point_and_only_that_one():
    """Seed 1's last point ends above its own cheaper one (3.35 > 3.3): it stays in the mean curve
    (what ran) and is marked where it lies; seed 0's same budget, below its own cheaper points, is not."""
    import matplotlib

    matplotlib.use("Agg")
    from mlresearch.analysis.plots import frontier_figure

    base = _points({0: [3.6, 3.4, 3.3, 3.25], 1: [3.7, 3.5, 3.3, 3.35]})
    base = base.assign(budget=base.flops / 1e12, shape="2L/128d/4h")
    runs = pd.DataFrame(columns=["experiment", "method", "levels", "scheme", "alpha", "optimizer", "budget", "run",
                                 "method_total_flops", "method_full_val_loss"])
    lines = frontier_figure(base, runs, "e").axes[0].get_lines()
    marked = [(list(line.get_xdata()), list(line.get_ydata())) for line in lines if "not on its frontier" in line.get_label()]
    assert marked == [([POINTS[3][0]], [3.35])]
    curve = next(line for line in lines if line.get_label().startswith("baseline (full shape)"))
    assert list(curve.get_ydata()) == pytest.approx([3.65, 3.45, 3.3, 3.3])
    clean = frontier_figure(base[base.seed == 0], runs, "e").axes[0].get_lines()
    assert not [line for line in clean if "not on its frontier" in line.get_label()]


def test_the_docs_frontier_table_is_every_point_where_its_seed_and_column_say():
    """The generated frontier tables of the docs: a cell per (seed, method + shape + budget), the
    baseline's columns first, a point missing on a seed a dash, the LR check's point (judged on the
    tuning split) left out; one table per experiment."""
    from mlresearch.frontier import points_markdown

    rows = [("e", "baseline", "", 0, 0.5, 3.6), ("e", "baseline", "", 0, 1.0, 3.25), ("e", "baseline", "", 1, 0.5, 3.7),
            ("e", "baseline", "", 1, 1.0, 3.3), ("e", "small", "1L/64d/2h", 0, 1.0, 3.9),
            ("e", "small", "2L/64d/2h", 1, 1.0, 3.05), ("f", "baseline", "", 0, 1.0, 2.5)]
    points = pd.DataFrame([{"experiment": e, "method": m, "shape": s, "seed": seed, "budget": b, "val_loss": v,
                            "role": "frontier"} for e, m, s, seed, b, v in rows] +
                          [{"experiment": "e", "method": "baseline", "shape": "", "seed": 0, "budget": 0.5,
                            "val_loss": 9.0, "role": "lr check"}])
    text = points_markdown(points)
    e, f = text.split("**f**")
    lines = [line.strip("|").split(" | ") for line in e.splitlines() if line.startswith("| ")]
    assert [c.strip() for c in lines[0]] == ["seed", "baseline 0.5x", "baseline 1x", "small 1L/64d/2h 1x",
                                             "small 2L/64d/2h 1x"]
    assert [[c.strip() for c in line] for line in lines[1:]] == [["0", "3.600", "3.250", "3.900", "-"],
                                                                 ["1", "3.700", "3.300", "-", "3.050"]]
    assert "9.000" not in text and "| 0 | 2.500 |" in f and "* |" not in text
    assert points_markdown(points.iloc[:0]).startswith("_No frontier points")
    # a budget ending no lower than a smaller one of its seed and line is starred, with the note; a
    # small shape's point is judged against its own shape's, not the baseline's
    worse = pd.concat([points, pd.DataFrame([
        {"experiment": "e", "method": "baseline", "shape": "", "seed": 0, "budget": 1.5, "val_loss": 3.4,
         "role": "frontier"},
        {"experiment": "e", "method": "small", "shape": "2L/64d/2h", "seed": 1, "budget": 0.5, "val_loss": 3.5,
         "role": "frontier"}])])
    e = points_markdown(worse).split("**f**")[0]
    assert "| 0 | 3.600 | 3.250 | 3.400* |" in e and "3.050 |" in e and "3.500 |" in e and "not a point of the frontier" in e
