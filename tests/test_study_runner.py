"""The study runner (`mlresearch study SPEC`): specs checked whole before anything trains, the
baseline tuned on the tuning split only, every run on its seeds, resumable, CPU time recorded."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from conftest import CONFIGS
from forked_cli import run_cli
from mlresearch.study_runner import StudyError, Study, load_study, merge_tuning_rows, run_study, tuning_loss


def _spec(tmp_path, **changes):
    config = yaml.safe_load((CONFIGS / "gpt2_smoke.yaml").read_text())
    config["data"]["tune_fraction"] = 0.1
    config["train"]["steps"] = 6
    config["vcycle"].update(down_steps=[2], small_steps=2, up_steps=[4])
    (tmp_path / "smoke.yaml").write_text(yaml.safe_dump(config))
    spec = {"config": str(tmp_path / "smoke.yaml"), "root": str(tmp_path / "runs"), "seeds": [0],
            "tuning": {"seed": 0, "lr": [0.003, 0.01], "warmup": [1]},
            "runs": {"paper": {"method": "vcycle", "main": True},
                     "a1": {"method": "vcycle", "set": ["vcycle.alpha=1.0"]}},
            "best": {"among": ["paper", "a1"]}}
    spec.update(changes)
    spec = {k: v for k, v in spec.items() if v is not None}  # a change of None leaves the key out
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "study.yaml"


@pytest.fixture
def warm_launches(monkeypatch):
    """The study's runs forked from a warm fork server (tests/forked_cli.py), not started cold: still one
    process a run, its output on this process's file descriptors as a started one's would be. Not for a
    test of the CPU seconds a study records (a forked run is not this process's child)."""
    started = subprocess.run

    def launch(command, *args, **kwargs):
        if list(command[:3]) != [sys.executable, "-m", "mlresearch.cli"]:
            return started(command, *args, **kwargs)
        done = run_cli(*command[3:], env=kwargs.get("env"))
        os.write(1, done.stdout.encode())
        os.write(2, done.stderr.encode())
        return done

    monkeypatch.setattr(subprocess, "run", launch)


@pytest.mark.parametrize("change, message", [
    ({"runs": {"x": {"method": "nope"}}}, "run 'x' needs a method"),
    ({"runs": {"x": {"method": "vcycle", "sett": []}}}, "unknown keys"),
    ({"best": {"among": ["missing"]}}, "best.among names runs the spec does not have"),
    ({"variant_seeds": [5]}, "variant_seeds must be a subset of seeds"),
    ({"colour": "red"}, "only the keys"),
    ({"speed": "fast"}, "speed must be one of eager, eager.fused, compiled, compiled.fused, compiled.graphs, .*, eager.1thread, .*, auto, got 'fast'"),
])
def test_a_bad_spec_is_one_clear_line_before_anything_runs(tmp_path, change, message):
    with pytest.raises(StudyError, match=message):
        load_study(_spec(tmp_path, **change))
    assert not (tmp_path / "runs").exists()


def test_a_spec_sets_every_runs_execution(tmp_path):
    """``speed`` in a spec is every run's train.speed (what resume and reuse ignore: not what a run computes)."""
    plain, fast = Study(_spec(tmp_path)), Study(_spec(tmp_path, speed="auto"))
    out = tmp_path / "runs" / "x"
    assert "train.speed=auto" not in plain.command(out, "vcycle", [])
    command = fast.command(out, "vcycle", ["vcycle.alpha=1.0"])
    assert command[command.index("train.speed=auto") - 1] == "--set" and command[-6:-4] == ["--set", "vcycle.alpha=1.0"]


def test_a_run_the_config_cannot_plan_is_refused_before_training(tmp_path):
    path = _spec(tmp_path, runs={"bad": {"method": "vcycle", "set": ["vcycle.levels=9"]}}, best={"among": ["bad"]})
    with pytest.raises(StudyError, match="run 'bad'"):
        Study(path)
    assert not (tmp_path / "runs").exists()


def test_study_tunes_on_the_tuning_split_runs_every_seed_and_resumes(tmp_path, capsys, monkeypatch):
    path = _spec(tmp_path)
    table = run_study(path)
    runs = tmp_path / "runs"
    tuning = pd.read_csv(runs / "tables" / "baseline_tuning.csv")
    # 2 LRs at the preset's warm-up, then the other warm-up at the best LR: 3 candidates, scored on
    # the tuning split (recomputed here from each candidate's final model), the best one chosen.
    assert len(tuning) == 3 and tuning.chosen.sum() == 1
    for row in tuning.itertuples():
        assert row.tune_loss == pytest.approx(tuning_loss(runs / row.run))
    best = tuning.loc[tuning.tune_loss.idxmin()]
    assert bool(best.chosen)
    baseline = yaml.safe_load((runs / "gpt2_smoke" / "baseline-seed0" / "config.yaml").read_text())["train"]
    assert (baseline["lr"], baseline["warmup"]) == (best.lr, best.warmup)
    # Every method's full-size model trains at the tuned LR too (the V-cycle's level 1; level 2 keeps the preset's).
    for run in ("vcycle-L2-halving-a0.25-reset-seed0", "vcycle-L2-halving-a1.0-reset-seed0"):
        method = yaml.safe_load((runs / "gpt2_smoke" / run / "config.yaml").read_text())
        assert method["train"]["lr"] == best.lr and method["vcycle"]["lr"] == [best.lr, 0.006]
    # The chosen candidate's summary carries its tuning loss; the target (validation) is never read for the choice.
    summary = json.loads((runs / "gpt2_smoke" / "baseline-seed0" / "summary.json").read_text())
    assert summary["final_tune"]["tune_loss"] == pytest.approx(best.tune_loss)
    assert set(table.alpha) == {"0.25", "1.0"} and len(table) == 2
    out = capsys.readouterr().out
    # The best V-cycle is the one with the *lowest* tuning loss, named.
    losses = {name: tuning_loss(runs / "gpt2_smoke" / run) for name, run in
              (("paper", "vcycle-L2-halving-a0.25-reset-seed0"), ("a1", "vcycle-L2-halving-a1.0-reset-seed0"))}
    assert losses["paper"] != losses["a1"]
    assert f"-> {min(losses, key=losses.get)}" in out, (losses, out)
    assert "CPU-hours recorded" in out
    run_study(path, finished_only=True)  # trains nothing, and still names the best (its other seeds are counted)
    assert f"-> {min(losses, key=losses.get)}" in capsys.readouterr().out
    adopted = json.loads((runs / "gpt2_smoke" / "baseline-seed0" / "provenance.json").read_text())["copied_from"]
    assert adopted == best.run  # the chosen tuning run is seed 0's baseline, not trained twice (relative to the root)
    for d in [*(runs / "gpt2_smoke").iterdir(), *(runs / "gpt2_smoke-tuning").iterdir()]:
        assert d.name == "baseline-seed0" or json.loads((d / "cpu.json").read_text())["cpu_seconds"] > 0
    # Run again: every run is finished, nothing trains (the metrics files stay byte for byte).
    # The tuning table stays byte for byte too, though the chosen candidate is now found as seed 0's baseline.
    before = {d.name: (d / "metrics.jsonl").read_bytes() for d in (runs / "gpt2_smoke").iterdir()}
    tuning_before = (runs / "tables" / "baseline_tuning.csv").read_bytes()
    started = subprocess.run  # a finished run is skipped without starting a process to skip it

    def no_training_process(command, *args, **kwargs):
        assert "mlresearch.cli" not in command, command
        return started(command, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", no_training_process)
    run_study(path)
    again = capsys.readouterr().out
    assert all(f"{d} is complete (summary.json); skipped\n" in again for d in (runs / "gpt2_smoke").iterdir()), again
    assert before == {d.name: (d / "metrics.jsonl").read_bytes() for d in (runs / "gpt2_smoke").iterdir()}
    assert (runs / "tables" / "baseline_tuning.csv").read_bytes() == tuning_before


def test_a_study_stopped_mid_run_records_the_cpu_time_its_run_took(tmp_path):
    """Stopped with SIGTERM to its process group (how a study is stopped between sessions), the study
    reaps the run it waits on and adds that run's CPU time to cpu.json; the run stays unfinished and
    resumable. (Before, the time of every interrupted part was lost from the study's CPU-hours.)"""
    import signal
    import time

    path = _spec(tmp_path, tuning={"seed": 0, "lr": [], "warmup": []}, runs={}, best=None)
    config = yaml.safe_load((tmp_path / "smoke.yaml").read_text())
    config["train"].update(steps=100000, checkpoint_every=1000)
    (tmp_path / "smoke.yaml").write_text(yaml.safe_dump(config))
    study = subprocess.Popen([sys.executable, "-m", "mlresearch.cli", "study", str(path)], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, TQDM_DISABLE="1"))
    deadline = time.monotonic() + 300
    while not (metrics := list((tmp_path / "runs").rglob("metrics.jsonl"))) or len(metrics[0].read_text().splitlines()) < 3:
        assert study.poll() is None and time.monotonic() < deadline, study.stderr.read() if study.poll() else "slow"
        time.sleep(0.2)
    run = metrics[0].parent  # (the tuning stage's run of the preset: the study's first)
    os.killpg(study.pid, signal.SIGTERM)
    stderr = study.communicate(timeout=120)[1]
    assert study.returncode == 130, stderr[-2000:]
    assert not (run / "summary.json").exists()
    recorded = json.loads((run / "cpu.json").read_text())
    assert recorded["cpu_seconds"] > 0 and recorded["wall_seconds"] > 0


def test_a_finished_run_with_another_configuration_is_not_reused(tmp_path, warm_launches):
    path = _spec(tmp_path, tuning={"seed": 0, "lr": [], "warmup": []}, runs={"paper": {"method": "vcycle"}},
                 best={"among": ["paper"]})
    run_study(path)
    # The preset changes under the finished baseline: the study says which run and why, and stops.
    config = yaml.safe_load((tmp_path / "smoke.yaml").read_text())
    config["train"]["lr"] = 0.02
    (tmp_path / "smoke.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(StudyError, match="baseline-seed0 is finished with another configuration .*train.lr"):
        run_study(path)


@pytest.mark.parametrize("spec", sorted((CONFIGS.parent / "studies").rglob("*.yaml")),
                         ids=lambda p: str(p.relative_to(CONFIGS.parent / "studies")))
def test_every_committed_study_spec_validates_and_plans_every_run(spec):
    study = Study(spec, dry_run=True)  # checks the spec whole and builds every run's plan; trains nothing
    study.tune()  # the committed tuning choice, where results/ has one (a dry run writes nothing)
    # No two runs of a spec land in one directory (the second would be skipped as already finished).
    outs = [study.run(name, study.spec["seeds"][0]) for name in ["baseline", *study.spec["runs"]]]
    assert len(set(outs)) == len(outs), outs


@pytest.mark.parametrize("spec", sorted((CONFIGS.parent / "studies" / "records").glob("*_tiny.yaml")),
                         ids=lambda p: p.name)
def test_a_record_spec_declares_exactly_the_committed_runs(spec):
    """The tiny record grids were run by a shell script before study specs existed; their specs must
    name every committed run with its exact config (a dry run finds each finished, none to run)."""
    study = Study(spec, dry_run=True)
    study.all_runs()
    outs = set(study.runs.values())
    assert outs and all((out / "summary.json").exists() for out in outs), sorted(map(str, outs))
    committed = {d for d in study.home.iterdir() if (d / "summary.json").exists()}
    regime = {d for d in committed if d.name.startswith("small-equalflops") or d.name == "baseline-seed2"}
    assert committed - regime - outs == set()  # (the regime spec's runs aside) nothing committed is left out


def test_a_dry_run_lists_the_warmup_grid_at_the_preset_lr_while_lrs_are_untried(tmp_path, warm_launches, capsys):
    # Only the preset's candidate (lr 0.003, warm-up 2: the experiment's own baseline) has run; the others
    # have no loss yet, so the listing must go on as if the preset won, not as if an untried LR had.
    path = _spec(tmp_path, tuning={"seed": 0, "lr": [0.01, 0.003], "warmup": [1]})
    Study(path).run("baseline", 0)
    capsys.readouterr()
    assert Study(path, dry_run=True).tune() == (0.003, 2)
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(listed) == 2 and "lr0.01-wu2" in listed[0] and "lr0.003-wu1" in listed[1], listed


def test_a_narrower_tuning_grid_merges_into_the_committed_table_by_key():
    def rows(*items):
        return pd.DataFrame([dict(zip(("experiment", "seed", "lr", "warmup", "tune_loss", "chosen", "run"), r))
                             for r in items])

    committed = rows(("other", 0, 0.001, 100, 4.0, True, "o"), ("x", 0, 0.002, 300, 3.5, True, "a"),
                     ("x", 0, 0.004, 300, 3.6, False, "b")).assign(git_commit="c0")
    # The same candidates, losses and choice: nothing changes (the file and its commit stay).
    assert merge_tuning_rows(committed, committed.drop(columns="git_commit").iloc[1:], "x", "c1") is None
    # A spec with one candidate: the rows it did not run are kept (not chosen any more), its own row replaces its key.
    merged = merge_tuning_rows(committed, rows(("x", 0, 0.004, 300, 3.4, True, "b2")), "x", "c1")
    assert len(merged) == 3 and set(merged.run) == {"o", "a", "b2"}
    got = {r.run: (bool(r.chosen), r.git_commit) for r in merged.itertuples()}
    assert got == {"o": (True, "c0"), "a": (False, "c0"), "b2": (True, "c1")}
    # A new candidate of the same experiment is added, not swapped for the old rows.
    merged = merge_tuning_rows(committed, rows(("x", 0, 0.008, 300, 3.9, False, "c"), ("x", 0, 0.002, 300, 3.5, True, "a")),
                               "x", "c1")
    assert sorted(merged.run) == ["a", "b", "c", "o"] and merged.chosen.sum() == 2


def test_a_dry_run_says_it_would_write_the_tuning_table(tmp_path, warm_launches, capsys):
    path = _spec(tmp_path, tuning={"seed": 0, "lr": [0.003], "warmup": [1]})
    study = Study(path)
    study.tune()
    table = tmp_path / "runs" / "tables" / "baseline_tuning.csv"
    assert "(written)" in capsys.readouterr().out and table.exists()
    table.unlink()
    Study(path, dry_run=True).tune()
    assert "(would write)" in capsys.readouterr().out and not table.exists()


def test_the_frontier_and_regime_stages(tmp_path, warm_launches, capsys):
    """The baseline at 0.5x and 1.0x of its steps, the small shape alone at 0.5x and 1.0x of its FLOPs,
    each schedule decayed to zero at its own end; points the study already has are copied, not
    retrained; an LR check at the lowest budget that loses on the tuning split is recorded but never a frontier point; every method
    run is read against its seed's frontier (recomputed here from the closed form; the pairing of
    seeds is tests/test_frontier.py's). The regime stage (same runs): one row per seed in regime.csv
    (another experiment's rows kept), the word-order gain cached beside each run and kept from the
    table when the weights are gone (committed runs keep none)."""
    import shutil

    import math

    from mlresearch.study import write_tables
    from mlresearch.training.engine import read_metrics

    path = _spec(tmp_path, seeds=[0], tuning={"seed": 0, "lr": [], "warmup": []},
                 runs={"small": {"method": "small", "equal_flops": True, "main": True},
                       "paper": {"method": "vcycle", "main": True},
                       "small-width": {"method": "small", "equal_flops": True, "set": ["vcycle.scheme=width-only"]}},
                 best=None, frontier={"budgets": [0.5, 1.0], "small_budgets": [0.5, 1.0], "check_lr": [1e-6]},
                 regime=True)
    runs, home = tmp_path / "runs", tmp_path / "runs" / "gpt2_smoke-frontier"
    (runs / "tables").mkdir(parents=True)
    pd.DataFrame([{"experiment": "other", "seed": 0, "margin": 1.0}]).to_csv(runs / "tables" / "regime.csv", index=False)
    run_study(path, "all")
    points = pd.read_csv(runs / "tables" / "frontier.csv")
    assert len(points) == 2 + 2 * 2 + 1 and (points.role == "lr check").sum() == 1
    assert sorted(points[points.role == "lr check"].lr) == [1e-6]  # (a 3-step run at 1e-6 barely moves: it loses)
    for p in points.itertuples():
        run = runs / p.run
        rows = [r for r in read_metrics(run) if "lr" in r]
        assert rows[-1]["step"] == p.steps and rows[-1]["lr"] == 0.0  # annealed at its own end
        assert p.flops == json.loads((run / "summary.json").read_text())["flops_total"]
    half = points[(points.method == "baseline") & (points.role == "frontier")].set_index(["seed", "budget"])
    assert half.loc[(0, 0.5), "steps"] == 3 and half.loc[(0, 1.0), "steps"] == 6
    # The 1.0x points are the study's own baseline and small control, copied (their records say from where).
    copied = json.loads((home / "baseline-x1-seed0" / "provenance.json").read_text())["copied_from"]
    assert copied == "gpt2_smoke/baseline-seed0"  # relative to the results root: the same on every machine
    assert json.loads((home / "small-x1-seed0" / "provenance.json").read_text())["copied_from"] == \
        "gpt2_smoke/small-equalflops-seed0"
    # Two small-model controls, each with its frontier and its shape; the regime check's is the first.
    controls = points[points.method == "small"].set_index("run")
    regime_shape, width_shape = controls.loc["gpt2_smoke-frontier/small-x1-seed0", "shape"], \
        controls.loc["gpt2_smoke-frontier/small-width-x1-seed0", "shape"]
    assert regime_shape != width_shape and set(controls["shape"]) == {regime_shape, width_shape}
    assert {run: bool(r) for run, r in controls.regime_control.items()} == {
        f"gpt2_smoke-frontier/{name}-x{b}-seed0": name == "small" for name in ("small", "small-width") for b in ("0.5", "1")}
    assert json.loads((home / "small-width-x1-seed0" / "provenance.json").read_text())["copied_from"] == \
        "gpt2_smoke/small-width-equalflops-seed0"

    table = write_tables(runs)
    per_run = pd.read_csv(runs / "tables" / "runs.csv")
    assert len(per_run) == 3 and not any("-x" in r for r in per_run.run)  # none from the frontier
    # Each run against the control of its own smallest shape: the V-cycle's coarsest level is the regime's.
    assert dict(zip(per_run.smallest_shape, per_run.small_control)) == {regime_shape: regime_shape,
                                                                        width_shape: width_shape}
    assert (per_run.small_loss_gap.abs() < 1e-12).sum() == 2  # each control at its own 1.0x point
    for r in per_run.itertuples():
        f = half.loc[r.seed].sort_index()
        (c0, l0), (c1, l1) = zip(f.flops, f.val_loss)
        l1 = min(l0, l1)
        loss, flops = r.method_full_val_loss, r.method_total_flops
        if l1 <= loss <= l0 and l0 > l1:
            base = math.exp(math.log(c0) + (l0 - loss) / (l0 - l1) * (math.log(c1) - math.log(c0)))
            assert r.saved_pct == pytest.approx(100 * (1 - flops / base)) and r.loss_range == "in range"
        else:
            assert pd.isna(r.saved_pct) and r.loss_range == ("above" if loss > l0 else "below" if loss < l1 else r.loss_range)
    assert set(table.saved_pct_cell) and "tokens_per_parameter" in table
    capsys.readouterr()
    run_study(path, "frontier", dry_run=True)  # resumed, every point is finished: nothing would train
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(listed) == 7 and all(line.startswith("[finished]") for line in listed), listed
    assert pd.read_csv(runs / "tables" / "frontier.csv").equals(points)
    # A study stopped part-way: --finished writes the frontier of the points that finished, trains nothing.
    half_point = home / "baseline-x0.5-seed0"
    (half_point / "summary.json").rename(half_point / "summary.kept")
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("metrics.jsonl")}
    run_study(path, "frontier", finished_only=True)
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert sum(line.startswith("[started ]") for line in listed) == 1
    partial = pd.read_csv(runs / "tables" / "frontier.csv")
    assert len(partial) == len(points) - 1 and "gpt2_smoke-frontier/baseline-x0.5-seed0" not in set(partial.run)
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("metrics.jsonl")} == before  # nothing trained
    (half_point / "summary.kept").rename(half_point / "summary.json")
    run_study(path, "frontier", finished_only=True)
    assert pd.read_csv(runs / "tables" / "frontier.csv").equals(points)

    regime = pd.read_csv(runs / "tables" / "regime.csv")
    assert set(regime.experiment) == {"other", "gpt2_smoke"}
    row = regime[regime.experiment == "gpt2_smoke"].iloc[0]
    base = json.loads((runs / "gpt2_smoke" / "baseline-seed0" / "summary.json").read_text())
    small_dir = runs / "gpt2_smoke" / "small-equalflops-seed0"
    assert row.baseline_final_val_loss == base["final_full_val"]["val_loss"]
    assert row.small_steps == yaml.safe_load((small_dir / "config.yaml").read_text())["train"]["steps"]
    assert row.margin == pytest.approx(row.small_val_loss_at_baseline_flops - row.baseline_final_val_loss)
    gain = json.loads((small_dir / "word_order.json").read_text())["gain"]
    assert row.small_word_order_gain == pytest.approx(gain)
    assert (runs / "figures" / "regime_gpt2_smoke.png").is_file()
    for run in (small_dir, runs / "gpt2_smoke" / "baseline-seed0"):  # as committed: no weights, no cache
        shutil.rmtree(run / "final_model")
        (run / "word_order.json").unlink()
    run_study(path, "regime")
    again = pd.read_csv(runs / "tables" / "regime.csv")
    assert again[again.experiment == "gpt2_smoke"].small_word_order_gain.iloc[0] == pytest.approx(gain)
    with pytest.raises(StudyError, match="regime: true needs the small-model control"):
        load_study(_spec(tmp_path, regime=True))


def test_an_lr_check_at_a_budget_chooses_that_budgets_lr_on_every_seed(tmp_path, warm_launches, capsys, monkeypatch):
    """``check_lr: {1.0: [X]}``: on the tuning seed the 1.0x baseline runs at the tuned LR and at X
    first; the one with the lower tuning loss (here X, by a stubbed tuning loss: which LR wins a 6-step
    run is not the point) is that budget's frontier point on the tuning seed and the LR the other seeds
    train it with; the loser stays an "lr check" row; the other budgets keep the tuned LR; the waiting
    points train before the small-model control's frontier. Before the check has run, a dry run lists
    the other seeds' point as pending."""
    from mlresearch import study_runner

    checked = 0.0042
    path = _spec(tmp_path, seeds=[0, 1], tuning={"seed": 0, "lr": [], "warmup": []},
                 runs={"small": {"method": "small", "equal_flops": True, "main": True}}, best=None,
                 frontier={"budgets": [0.5, 1.0], "small_budgets": [0.5, 1.0], "check_lr": {1.0: [checked]}})
    runs, home = tmp_path / "runs", tmp_path / "runs" / "gpt2_smoke-frontier"
    run_study(path, "frontier", dry_run=True)
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split("]", 1)[1].split()[0].rsplit("/", 1)[1] for line in listed][:5] == [
        "baseline-x0.5-seed0", "baseline-x1-seed0", f"baseline-x1-lr{checked:g}-seed0", "baseline-x0.5-seed1",
        "baseline-x1-seed1"]
    assert [line.startswith("[pending ]") for line in listed] == [False] * 4 + [True] + [False] * 4

    monkeypatch.setattr(study_runner, "tuning_loss", lambda run: 1.0 if yaml.safe_load(
        (run / "config.yaml").read_text())["train"]["lr"] == checked else 2.0)
    run_study(path, "frontier")
    points = pd.read_csv(runs / "tables" / "frontier.csv").set_index("run")
    tuned = yaml.safe_load((tmp_path / "smoke.yaml").read_text())["train"]["lr"]
    baseline = points[points.method == "baseline"]
    assert baseline.role.to_dict() == {
        "gpt2_smoke-frontier/baseline-x0.5-seed0": "frontier", "gpt2_smoke-frontier/baseline-x1-seed0": "lr check",
        f"gpt2_smoke-frontier/baseline-x1-lr{checked:g}-seed0": "frontier",
        "gpt2_smoke-frontier/baseline-x0.5-seed1": "frontier", f"gpt2_smoke-frontier/baseline-x1-lr{checked:g}-seed1": "frontier"}
    assert baseline.lr.to_dict() == {run: checked if "-lr" in run else tuned for run in baseline.index}
    assert not (home / "baseline-x1-seed1").exists()  # the tuned LR lost the check: never trained on seed 1
    finished_at = {run: (runs / run / "summary.json").stat().st_mtime_ns for run in points.index}
    assert finished_at[f"gpt2_smoke-frontier/baseline-x1-lr{checked:g}-seed1"] < min(
        t for run, t in finished_at.items() if "/small-" in run)  # the waiting point before the controls
    with pytest.raises(StudyError, match="each budget one of frontier.budgets"):
        load_study(_spec(tmp_path, frontier={"budgets": [0.5, 1.0], "check_lr": {1.5: [0.01]}}))


def test_a_bad_frontier_is_refused_before_anything_runs(tmp_path):
    for frontier, message in (({"budgets": [1.0]}, "at least 2"), ({"budgets": [0.5, -1]}, "positive"),
                              ({"budgets": [0.5, 1.0], "colour": 1}, "frontier must be a mapping"),
                              ({"budgets": [0.5, 1.0], "small_budgets": [1.0]}, "small_budgets needs at least 2")):
        with pytest.raises(StudyError, match=message):
            load_study(_spec(tmp_path, frontier=frontier))
    with pytest.raises(StudyError, match="no frontier section"):
        run_study(_spec(tmp_path), "frontier")
    assert not (tmp_path / "runs").exists()


def test_a_launcher_starts_every_run_and_a_missing_one_is_one_clear_line(tmp_path, capsys):
    # The launcher (torchrun on a GPU node) is a command line put before `-m mlresearch.cli run ...`; here
    # a wrapper that notes each run it starts, then runs this Python. A launcher that is not installed
    # stops the study with one line naming it, before anything is written.
    import shlex
    import sys
    from pathlib import Path

    wrapper = tmp_path / "launch.sh"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/launched\nshift\nexec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    path = _spec(tmp_path, tuning={"seed": 0, "lr": [], "warmup": []}, runs={"paper": {"method": "vcycle"}},
                 best={"among": ["paper"]})
    Study(path, dry_run=True, launch=f"{wrapper} --flag").run("paper", 0)
    assert f"(via {wrapper} --flag)" in capsys.readouterr().out
    with pytest.raises(StudyError, match="cannot start '/nonexistent/torchrun'"):
        Study(path, launch="/nonexistent/torchrun --nproc_per_node 8").run("baseline", 0)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(StudyError, match="is not a command line"):
        Study(path, launch='torchrun "unclosed')
    out = Study(path, launch=f"{wrapper} --flag").run("baseline", 0)
    assert (out / "summary.json").exists()
    launched = (tmp_path / "launched").read_text().split()
    assert launched[:5] == ["--flag", "-m", "mlresearch.cli", "run", str(tmp_path / "smoke.yaml")]
    assert (Path(launched[launched.index("--out") + 1]) / "summary.json").exists()  # the tuning run, adopted as out


def test_a_spec_finds_its_preset_by_name_in_the_configs_folder_beside_it(tmp_path, monkeypatch):
    """A copy of experiments/ anywhere (an installed, non-editable package has none of its own):
    a spec's preset name is looked up in the nearest configs/ above the spec; a missing one is one line
    naming every place it looked."""
    (tmp_path / "experiments" / "configs").mkdir(parents=True)
    (tmp_path / "experiments" / "studies" / "records").mkdir(parents=True)
    (tmp_path / "experiments" / "configs" / "my_preset.yaml").write_text((CONFIGS / "gpt2_smoke.yaml").read_text())
    spec = tmp_path / "experiments" / "studies" / "records" / "mine.yaml"
    spec.write_text(yaml.safe_dump({"config": "my_preset", "root": str(tmp_path / "runs"), "seeds": [0],
                                    "runs": {"paper": {"method": "vcycle"}}}))
    monkeypatch.chdir(tmp_path / "experiments")  # not where ./experiments/configs would be found
    assert Study(spec, dry_run=True).config == (tmp_path / "experiments" / "configs" / "my_preset.yaml").resolve()
    spec.write_text(spec.read_text().replace("my_preset", "no_such_preset"))
    with pytest.raises(StudyError, match=r"no preset 'no_such_preset': looked for no_such_preset.yaml in .*configs"):
        Study(spec, dry_run=True)
