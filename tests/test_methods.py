"""Methods as plans: every method runs end to end, its ledger equals its plan, and a new method or a
bad plan needs no change to the runner."""

from __future__ import annotations

import pytest
from conftest import smoke

from mlresearch.checkpoint import load_model
from mlresearch.families import family_of
from mlresearch.training import methods
from mlresearch.training.config import ConfigError
from mlresearch.training.engine import read_metrics
from mlresearch.training.methods import METHODS, Method, Phase, Step, build_plan, planned_ledger
from mlresearch.training.methods.vcycle import level_sizes
from mlresearch.training.models import model_sizes
from mlresearch.training.run import run_method

pytestmark = pytest.mark.usefixtures("isolated_data_cache")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_runs_and_spends_exactly_its_plan(tmp_path, method):
    cfg = smoke("gpt2")
    summary = run_method(cfg, method, tmp_path / method)
    rows = read_metrics(tmp_path / method)
    ends = [r for r in rows if r.get("event") == "phase_end"]
    planned = planned_ledger(cfg, method)["phases"]
    assert [(r["phase"], r["steps"]) for r in ends] == [(p["phase"], p["steps"]) for p in planned]
    for r, p in zip(ends, planned):
        assert r["flops"] == p["flops"] and r["examples"] == p["examples"]
    assert summary["flops_total"] == planned_ledger(cfg, method)["flops"] and summary["kind"] == method


def test_the_small_control_is_the_smallest_level_trained_for_the_baselines_steps(tmp_path):
    cfg = smoke("gpt2", "model.layers=4", "vcycle.levels=3", "vcycle.down_steps=[2, 2]", "vcycle.up_steps=[2, 6]",
                "vcycle.lr=null")
    run_method(cfg, "small", tmp_path / "small")
    model = load_model(tmp_path / "small" / "checkpoints" / "small" / "model")
    assert family_of(model).sizes(model) == level_sizes(cfg)[2]
    rows = [r for r in read_metrics(tmp_path / "small") if "train_loss" in r]
    assert rows[-1]["step"] == cfg.train.steps and rows[-1]["examples"] == cfg.train.steps * cfg.train.batch_size


def test_a_new_method_is_one_function_and_a_registry_entry(tmp_path, monkeypatch):
    def down_and_up(cfg):  # coalesce after 2 steps, de-coalesce without merging, finish at full size
        return [Step("new_model", 1), Phase("a", 1, 2, cfg.train.lr, 1), Step("choose_scheme", 1),
                Step("coalesce", 1), Phase("b", 2, 2, cfg.train.lr, 1), Step("decoalesce", 1),
                Phase("c", 1, 2, cfg.train.lr, 1)]

    monkeypatch.setitem(METHODS, "down-and-up", Method("down-and-up", down_and_up))
    summary = run_method(smoke("gpt2"), "down-and-up", tmp_path / "run")
    assert [p["phase"] for p in summary["phases"]] == ["a", "b", "c"]
    ops = [(r["op"], r["level"]) for r in read_metrics(tmp_path / "run") if r.get("event") == "operator"]
    assert ops == [("coalesce", 1), ("decoalesce", 1)]


def test_a_plan_with_an_unknown_transition_is_a_config_error(monkeypatch):
    monkeypatch.setitem(METHODS, "broken", Method("broken", lambda cfg: [Step("new_model", 1), Step("teleport", 1)]))
    with pytest.raises(ConfigError, match=r"unknown transition\(s\) \['teleport'\]"):
        build_plan(smoke("gpt2"), "broken")
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        build_plan(smoke("gpt2"), "nope")
    with pytest.raises(ConfigError, match="needs the config's vcycle section"):
        build_plan(smoke("gpt2", "vcycle=null"), "small")


def test_plan_command_prints_every_item_and_the_total(capsys):
    from mlresearch.cli import main

    config = str(smoke.__globals__["CONFIGS"] / "gpt2_smoke.yaml")
    assert main(["run", config, "--method", "vcycle", "--plan"]) == 0
    out = capsys.readouterr().out.splitlines()
    cfg = smoke("gpt2")
    plan = build_plan(cfg, "vcycle")
    assert len([line for line in out if line[:3].strip().isdigit()]) == len(plan)
    total = planned_ledger(cfg, "vcycle")["flops"]
    assert out[-1].startswith(f"total: {total:.3e} FLOPs")
    trained = [line for line in out if " train " in f" {line[3:]}"]
    assert [line.split()[2] for line in trained] == ["down1", "small", "up1"]


def test_cost_plan_prints_gpu_hours_from_the_planned_flops(capsys):
    from mlresearch.cli import main
    from mlresearch.training.config import load_config

    config = smoke.__globals__["CONFIGS"] / "gpt2_paper.yaml"
    assert main(["plan", str(config), "--gpus", "8", "--peak-tflops", "1000", "--mfu", "0.5"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(config)
    base, vc = planned_ledger(cfg, "baseline")["flops"], planned_ledger(cfg, "vcycle")["flops"]
    hours = base / (1000e12 * 0.5 * 3600)  # GPU-hours, computed here from the FLOPs alone
    assert f"{base:>10.3e} {hours:>10,.1f}  ({hours / 8:,.1f} h on 8 GPU(s))" in out
    assert f"vcycle: {100 * (1 - vc / base):.1f}% of the baseline's FLOPs saved" in out
    assert "small:" in out  # the control is priced too
    with pytest.raises(ConfigError, match="--mfu"):
        main.__globals__["_cmd_plan"](type("A", (), {"config": str(config), "set": [], "gpus": 1,
                                                     "peak_tflops": 1.0, "mfu": 1.5})())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_staged_training_grows_with_its_state_and_restarts_the_schedule(tmp_path, name):
    from mlresearch.checkpoint import load_state
    from mlresearch.training.methods.staged import staged_schedule, staged_sizes

    cfg = smoke(name)  # gpt2: width once; llama: depth, then width
    run_method(cfg, "staged", tmp_path / "st")
    rows = read_metrics(tmp_path / "st")
    grown = [r for r in rows if r.get("event") == "grown"]
    assert [g["op"] for g in grown] == [f"grow_{g}" for g in cfg.staged.grow]
    for g in grown:  # pre-norm models: growth keeps the loss
        assert abs(g["val_loss_after"] - g["val_loss_before"]) <= 1e-5
    schedule, sizes = staged_schedule(cfg), staged_sizes(cfg)
    t, w = cfg.train, cfg.staged.rewarmup
    for i, (start, steps) in enumerate(schedule):
        ck = tmp_path / "st" / "checkpoints" / f"stage{i}"
        model = load_model(ck / "model")
        assert family_of(model).sizes(model) == sizes[i]
        # Adam's step counter runs on through the growths: every stage's steps so far.
        state = load_state(ck)["optimizer"]["state"]
        assert int(next(iter(state.values()))["step"]) == sum(s for _, s in schedule[:i + 1])
        if i:  # first step after a growth: re-warm-up from 0 toward the base schedule at S_r + W_r
            first = next(r for r in rows if r.get("phase") == f"stage{i}" and "lr" in r)
            base = 1 - (start + w - t.warmup) / (t.steps - t.warmup)  # linear decay, past the warm-up
            assert first["lr"] == pytest.approx(t.lr * (1 / w) * base)
    last = [r for r in rows if r.get("phase") == f"stage{len(schedule) - 1}" and "lr" in r][-1]
    assert last["step"] == t.steps - schedule[-1][0] and last["lr"] == pytest.approx(0.0, abs=1e-12)


def test_staged_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="staged.steps needs one entry per growth"):
        smoke("gpt2", "staged.steps=[2, 2]")
    odd = smoke("gpt2", "model.layers=3", "vcycle=null", "staged.grow=[depth]", "staged.steps=[2]")
    with pytest.raises(ConfigError, match="even number of layers"):  # checked for the method that reads staged
        build_plan(odd, "staged")
    assert build_plan(odd, "baseline")
    with pytest.raises(ConfigError, match="re-enter the schedule at step"):
        build_plan(smoke("gpt2", "staged.steps=[40]"), "staged")
    with pytest.raises(ConfigError, match="stack.steps 12 leaves no steps"):
        build_plan(smoke("gpt2", "stack.steps=12"), "stack")


@pytest.mark.parametrize("variant, merged_asymmetry", [
    (["vcycle.alpha=1.0"], 0.0),  # the de-coalesced model alone: duplicated units equal ...
    (["vcycle.alpha=1.0", "vcycle.tie_break=0.01"], 1e-3),  # ... unless noise breaks the tie
    (["vcycle.alpha=0.25"], 1e-3),  # or the partner does
])
def test_symmetry_is_measured_and_only_broken_by_something(tmp_path, variant, merged_asymmetry):
    run_method(smoke("gpt2", *variant), "vcycle", tmp_path / "vc")
    events = {r["when"]: r["max_rel_diff"] for r in read_metrics(tmp_path / "vc") if r.get("event") == "symmetry"}
    assert set(events) == {"merged", "after up1"}
    if merged_asymmetry == 0.0:
        assert events["merged"] <= 1e-6
        assert events["after up1"] <= 1e-4  # identical gradients keep duplicates (almost) identical
    else:
        assert events["merged"] > merged_asymmetry and events["after up1"] > merged_asymmetry


def test_identity_up_path_starts_the_up_phase_at_the_small_models_loss(tmp_path):
    run_method(smoke("gpt2", "vcycle.up_path=identity", "vcycle.alpha=1.0"), "vcycle", tmp_path / "vc")
    (event,) = [r for r in read_metrics(tmp_path / "vc") if r.get("event") == "interpolated"]
    small_last = [r for r in read_metrics(tmp_path / "vc") if r.get("phase") == "small" and "val_loss" in r][-1]
    assert event["decoalesced_val_loss"] == pytest.approx(small_last["val_loss"], abs=1e-5)


def test_alpha_is_read_once_into_one_typed_choice():
    from mlresearch.training.methods.vcycle import Alpha

    assert Alpha.parse(0) == Alpha("fixed", weight=0.0) and Alpha.parse(0.25) == Alpha("fixed", weight=0.25)
    assert Alpha.parse("adaptive") == Alpha("adaptive", norms="tensor")
    assert Alpha.parse("adaptive-row") == Alpha("adaptive", norms="row")
    assert Alpha.parse("search") == Alpha("search")
    for bad in (-0.1, 1.01, "0.5", None, False):
        with pytest.raises(ConfigError, match="vcycle.alpha"):
            Alpha.parse(bad)


@pytest.mark.parametrize("mode", ["adaptive", "adaptive-row"])
def test_adaptive_alpha_logs_the_rescaling_it_applied_and_merges_half_and_half(tmp_path, mode):
    import torch

    run_method(smoke("gpt2", f"vcycle.alpha={mode}"), "vcycle", tmp_path / "vc")
    rows = read_metrics(tmp_path / "vc")
    (scale,) = [r for r in rows if r.get("event") == "adaptive_scale"]
    ck = tmp_path / "vc" / "checkpoints"
    partner, merged = load_model(ck / "partner1"), load_model(ck / "merged1")
    assert scale["mode"] == {"adaptive": "tensor", "adaptive-row": "row"}[mode] and scale["level"] == 1
    assert scale["tensors"] == len(list(partner.parameters())) and scale["zero_norm_tensors"] == 0
    assert 0 < scale["norm_ratio_min"] <= scale["norm_ratio_median"] <= scale["norm_ratio_max"] < float("inf")
    if mode == "adaptive":  # merged = (partner + s * decoalesced) / 2 with ||s * decoalesced|| = ||partner||
        for (name, a), m in zip(partner.named_parameters(), merged.parameters()):
            torch.testing.assert_close((2 * m - a).norm(), a.norm(), rtol=1e-4, atol=1e-6, msg=name)
    assert not [r for r in read_metrics(tmp_path / "vc") if r.get("event") == "alpha_search"]


TRIGGERED = ("train.eval_every=1", "staged.trigger=true", "staged.thresholds=[-100.0]")  # fires at its 3rd point


def test_a_trigger_grows_early_and_the_schedule_reenters_where_the_stage_ended(tmp_path):
    from mlresearch.training.schedules import CONSTANT_OP

    cfg = smoke("gpt2", *TRIGGERED)
    summary = run_method(cfg, "staged", tmp_path / "st")
    rows = read_metrics(tmp_path / "st")
    (fired,) = [r for r in rows if r.get("event") == "trigger"]
    assert (fired["phase"], fired["step"], fired["of_steps"], fired["threshold"]) == ("stage0", 3, 6, -100.0)
    evals = [r for r in rows if r.get("phase") == "stage0" and "val_loss" in r]
    assert [r["step"] for r in evals] == [1, 2, 3]
    assert evals[0]["loglog_slope"] is None and fired["loglog_slope"] == evals[-1]["loglog_slope"] < 0
    start = round(3 / CONSTANT_OP["width"])  # S_r from where stage 0 ended, not from its cap of 6
    ends = [(r["phase"], r["steps"]) for r in rows if r.get("event") == "phase_end"]
    assert ends == [("stage0", 3), ("stage1", cfg.train.steps - start)]
    # The ledger charges the steps actually trained, at each stage's model's FLOPs per step.
    per_step = {p["phase"]: p["flops"] / p["steps"] for p in planned_ledger(cfg, "staged")["phases"]}
    assert summary["flops_total"] == pytest.approx(per_step["stage0"] * 3 + per_step["stage1"] * (12 - start),
                                                   rel=1e-12)
    # The plan says what it assumes.
    assert "trigger ends early" in methods.format_plan(cfg, "staged")


def test_searched_alpha_is_chosen_on_the_tuning_split_and_charged_to_the_ledger(tmp_path):
    from mlresearch.training.flops import eval_flops_per_example

    cfg = smoke("gpt2", "data.tune_fraction=0.1", "vcycle.alpha=search", "vcycle.search_batches=2")
    summary = run_method(cfg, "vcycle", tmp_path / "vc")
    rows = read_metrics(tmp_path / "vc")
    (search,) = [r for r in rows if r.get("event") == "alpha_search"]
    grid = dict((a, s) for a, s in search["grid"])
    assert list(grid) == cfg.vcycle.alpha_grid and search["alpha"] == min(grid, key=grid.get)
    assert search["examples"] == 5 * 2 * cfg.train.batch_size
    # Independently: the merged model at the chosen alpha scores what the search logged, on the tuning split.
    from mlresearch.data.datasets import load_data
    from mlresearch.training.engine import evaluate
    from mlresearch.training.models import data_settings

    data = load_data(cfg.task, data_settings(cfg), cfg.seed)
    ck = tmp_path / "vc" / "checkpoints"
    merged = load_model(ck / "merged1")
    assert evaluate(merged, data, cfg, "tune", 2)["tune_loss"] == pytest.approx(grid[search["alpha"]], abs=1e-5)
    # Its cost is in the plan and in the ledger, once.
    assert search["flops"] == 5 * 2 * cfg.train.batch_size * eval_flops_per_example(merged, cfg.data.seq_len)
    plan = planned_ledger(cfg, "vcycle")
    assert summary["flops_total"] == pytest.approx(plan["flops"], rel=1e-12)
    assert plan["flops"] == pytest.approx(sum(p["flops"] for p in plan["phases"]) + search["flops"], rel=1e-12)
    # The tuning documents are held out of training and of validation: the target's batches never choose.
    assert data.info["split_documents"][3] == round(0.1 * sum(data.info["split_documents"]))


def test_searched_alpha_needs_a_tuning_split(tmp_path):
    with pytest.raises(ConfigError, match="set data.tune_fraction > 0"):
        smoke("gpt2", "vcycle.alpha=search")
    cfg = smoke("gpt2", "data.tune_fraction=0.02", "vcycle.alpha=search", "vcycle.search_batches=50")
    with pytest.raises(ConfigError, match="the tuning split has"):
        run_method(cfg, "vcycle", tmp_path / "vc")
    assert not (tmp_path / "vc" / "metrics.jsonl").exists()  # refused before anything was written


def test_the_small_phase_can_keep_its_lr_flat_while_the_rest_decays(tmp_path):
    """``vcycle.small_schedule: constant``: the small phase warms up and then holds its peak LR to
    its last step (it is about to be grown, so it is not annealed); the other phases still decay to
    zero at their ends; an unknown shape is one config error; the run directory says the variant."""
    cfg = smoke("gpt2", "vcycle.small_schedule=constant", "vcycle.small_steps=4", "vcycle.small_warmup=1",
                "train.log_every=1")
    run_method(cfg, "vcycle", tmp_path / "vc")
    rows = [r for r in read_metrics(tmp_path / "vc") if "lr" in r and "event" not in r]
    small = [r for r in rows if r["phase"] == "small"]
    peak = cfg.vcycle.lr[1] if cfg.vcycle.lr else cfg.train.lr
    assert small and all(r["lr"] == pytest.approx(peak) for r in small if r["step"] >= 1)
    assert [r for r in rows if r["phase"] == "up1"][-1]["lr"] == 0.0
    from mlresearch.training.run import default_out

    assert default_out(cfg, "vcycle", tmp_path).name.endswith("-small_constant-seed0")
    with pytest.raises(ConfigError, match="small_schedule must be 'linear', 'cosine' or 'constant' \\(or unset: train.schedule\\)"):
        build_plan(smoke("gpt2", "vcycle.small_schedule=flat"), "vcycle")


def test_an_external_partner_replays_the_public_example_and_is_checked_before_training(tmp_path):
    """``vcycle.partner``: level 1 merges with that saved model instead of M1 after E_a (what the public
    example script does with the fully trained baseline): the merge event's partner loss is the saved
    model's own final validation loss; a partner of another shape, or none there, is one config error
    before the run directory exists; the run directory says the partner is external."""
    base = run_method(smoke("gpt2"), "baseline", tmp_path / "base")
    assert (tmp_path / "base" / "final_model" / "config.json").is_file()
    cfg = smoke("gpt2", f"vcycle.partner={tmp_path}/base/final_model")
    run_method(cfg, "vcycle", tmp_path / "vc")
    merged = [r for r in read_metrics(tmp_path / "vc") if r.get("event") == "interpolated"]
    assert len(merged) == 1 and merged[0]["partner_val_loss"] == pytest.approx(
        [r for r in read_metrics(tmp_path / "base") if "val_loss" in r and "event" not in r][-1]["val_loss"], abs=1e-6)
    assert base["kind"] == "baseline"
    from mlresearch.training.run import default_out

    assert default_out(cfg, "vcycle", tmp_path).name.endswith("-external_partner-seed0")
    # "{seed}" is the run's seed
    assert build_plan(smoke("gpt2", "vcycle.partner=m/seed{seed}", "seed=3"), "vcycle")[2].option("external") == "m/seed3"
    wide = run_method(smoke("gpt2", "model.hidden=64"), "baseline", tmp_path / "wide")
    assert wide["kind"] == "baseline"
    for partner, message in ((tmp_path / "wide" / "final_model", "not a gpt2 model of the config's shape"),
                             (tmp_path / "nothing", "no saved model there")):
        with pytest.raises(ConfigError, match=message):
            run_method(smoke("gpt2", f"vcycle.partner={partner}"), "vcycle", tmp_path / "refused")
        assert not (tmp_path / "refused").exists()


def test_a_run_records_its_tokens_per_parameter_of_the_full_model(tmp_path):
    """The summary's parameter counts equal the trained model's own (tied head counted once; token
    and position embeddings left out of the non-embedding count), and its tokens are steps x batch x
    sequence length; the small control is divided by the *full* model's parameters."""
    import torch

    cfg = smoke("gpt2")
    summary = run_method(cfg, "baseline", tmp_path / "base")
    model = load_model(tmp_path / "base" / "final_model")
    unique = {id(p): p.numel() for p in model.parameters()}
    embedded = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    assert summary["full_model_parameters"] == sum(unique.values())
    assert summary["full_model_non_embedding_parameters"] == sum(n for i, n in unique.items() if i not in embedded)
    assert summary["tokens_total"] == cfg.train.steps * cfg.train.batch_size * cfg.data.seq_len
    assert summary["tokens_per_parameter"] == summary["tokens_total"] / summary["full_model_parameters"]
    small = run_method(cfg, "small", tmp_path / "small")
    assert small["full_model_parameters"] == summary["full_model_parameters"]


def test_the_new_method_of_the_contributing_guide_is_one_file_and_runs(tmp_path, monkeypatch):
    """docs/contributing.md's example, executed as the file it says to write (with its settings
    section registered): it parses, validates, plans, runs end to end, names its run directory and
    table columns, and another method's run ignores its section."""
    import re
    import sys
    import types
    from pathlib import Path

    from mlresearch.training import config as config_module
    from mlresearch.training.run import config_differences, default_out

    guide = (Path(__file__).resolve().parent.parent / "docs" / "contributing.md").read_text()
    code = re.search(r"## A new method.*?```python\n(.*?)```", guide, re.S).group(1)
    module = types.ModuleType("mlresearch.training.methods.mymethod")
    module.__package__ = "mlresearch.training.methods"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        exec(compile(code, "docs/contributing.md", "exec"), module.__dict__)
        assert "mymethod" in METHODS and "mymethod" in config_module.SETTINGS
        with pytest.raises(ConfigError, match=r"mymethod.fraction must be a number in \(0, 1\)"):
            smoke("gpt2", "mymethod.fraction=1.5")
        cfg = smoke("gpt2", "mymethod.fraction=0.5")
        assert cfg.mymethod.fraction == 0.5 and cfg.to_dict()["mymethod"] == {"fraction": 0.5}
        summary = run_method(cfg, "mymethod", tmp_path / "run")
        assert [p["phase"] for p in summary["phases"]] == ["small", "full"]
        assert summary["flops_total"] == planned_ledger(cfg, "mymethod")["flops"]
        assert default_out(cfg, "mymethod", tmp_path).name == "mymethod-seed0"
        assert methods.describe_run("mymethod", cfg.to_dict())["budget"] == "fraction 0.5"
        assert methods.title_of("mymethod") == "My method"
        # a baseline run does not read the new section: changing it changes nothing of the baseline's
        run_method(cfg, "baseline", tmp_path / "base")
        assert config_differences(tmp_path / "base", smoke("gpt2", "mymethod.fraction=0.25"), "baseline") == []
        assert config_differences(tmp_path / "run", smoke("gpt2", "mymethod.fraction=0.25"), "mymethod") == \
            ["mymethod.fraction"]
    finally:  # the registries as they were
        METHODS.pop("mymethod", None)
        config_module.SETTINGS.pop("mymethod", None)


def test_stackbert_doubles_the_depth_at_each_stage_on_one_schedule(tmp_path):
    """Progressive stacking with two doublings: 1 -> 2 -> 4 layers, each stage on the full model's
    LR schedule (the last runs to train.steps), two stack events; impossible shapes and budgets
    are config errors."""
    cfg = smoke("gpt2", "model.layers=4", "stackbert.steps=[3,3]", "stackbert.optimizer=reset")
    summary = run_method(cfg, "stackbert", tmp_path / "run")
    assert [(p["phase"], p["steps"]) for p in summary["phases"]] == [("stage0", 3), ("stage1", 3), ("stage2", 6)]
    grown = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "grown"]
    assert [(r["op"], r["level"]) for r in grown] == [("stack", 1), ("stack", 2)]
    model = load_model(tmp_path / "run" / "final_model")
    assert family_of(model).sizes(model).layers == 4
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r and r.get("phase") == "stage2"}
    assert lrs[max(lrs)] == 0.0  # the one schedule decays to zero at train.steps
    with pytest.raises(ConfigError, match="2 doublings need model.layers divisible by 4, got 2"):
        build_plan(smoke("gpt2", "stackbert.steps=[3,3]"), "stackbert")
    with pytest.raises(ConfigError, match="stackbert.steps add up to 12"):
        build_plan(smoke("gpt2", "stackbert.steps=[12]"), "stackbert")
    with pytest.raises(ConfigError, match="stackbert.optimizer must be 'reset' or 'carry'"):
        smoke("gpt2", "stackbert.optimizer=keep")


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_bert2bert_widens_then_stacks_fpi_keeping_the_function_aki_not(tmp_path, family):
    """bert2BERT on the smoke presets (post-norm BERT and pre-norm GPT-2): a half-width, half-depth
    model for its steps, widened (FPI: the logged validation loss unchanged; AKI: changed), stacked to
    the full depth, then the full model to train.steps on the one schedule; impossible shapes and
    budgets are config errors."""
    section = "bert2bert={init: %s, steps: 4, rewarmup: 2, optimizer: carry}"
    losses = {}
    for init in ("fpi", "aki"):
        cfg = smoke(family, "model.layers=4", section % init)
        summary = run_method(cfg, "bert2bert", tmp_path / init)
        assert [(p["phase"], p["steps"]) for p in summary["phases"]] == [("stage0", 4), ("stage1", 8)]
        grown = [r for r in read_metrics(tmp_path / init) if r.get("event") == "grown"]
        assert [r["op"] for r in grown] == ["expand_width", "stack"]
        losses[init] = grown[0]["val_loss_before"], grown[0]["val_loss_after"]
        model = load_model(tmp_path / init / "final_model")
        assert (family_of(model).sizes(model).layers, family_of(model).sizes(model).hidden) == (4, 32)
        assert summary["flops_total"] == planned_ledger(cfg, "bert2bert")["flops"]
    assert abs(losses["fpi"][0] - losses["fpi"][1]) <= 1e-6
    assert abs(losses["aki"][0] - losses["aki"][1]) > 1e-5  # 5e-4 (GPT-2), 7e-5 (BERT) after 4 steps
    assert losses["fpi"][0] == losses["aki"][0]  # the same small model up to the expansion
    with pytest.raises(ConfigError, match="bert2bert: width 3 and depth 2 must divide the model's heads"):
        build_plan(smoke(family, section % "fpi", "bert2bert.width=3"), "bert2bert")
    with pytest.raises(ConfigError, match="bert2bert.steps 12 leaves no steps of train.steps 12"):
        build_plan(smoke(family, section % "fpi", "bert2bert.steps=12"), "bert2bert")
    with pytest.raises(ConfigError, match="bert2bert.init must be 'fpi' or 'aki'"):
        smoke(family, section % "net2net")


def test_knowledge_inheritance_distils_with_a_decaying_weight_and_charges_the_teacher(tmp_path):
    """KI on the GPT-2 smoke preset: a half-width, half-depth teacher trained on its own schedule,
    then the full model from scratch; the student phase is charged its own training plus one teacher
    forward pass per example on each of the ki.steps steps of weight above 0 (counted here from the
    saved models), and nothing more once the weight is 0."""
    from mlresearch.training.flops import eval_flops_per_example, train_flops_per_example

    cfg = smoke("gpt2", "ki.teacher_steps=4", "ki.steps=6", "ki.alpha=0.5")
    summary = run_method(cfg, "ki", tmp_path / "run")
    assert [(p["phase"], p["steps"]) for p in summary["phases"]] == [("teacher", 4), ("student", 12)]
    student = load_model(tmp_path / "run" / "final_model")
    teacher = load_model(tmp_path / "run" / "checkpoints" / "teacher" / "model")
    assert family_of(teacher).sizes(teacher) == family_of(student).sizes(student).replace(
        layers=1, heads=2, kv_heads=2, hidden=16, ffn=64)
    seq, b = cfg.data.seq_len, cfg.train.batch_size
    charged = summary["phases"][1]["flops"]
    assert charged == 12 * b * train_flops_per_example(student, seq) + 6 * b * eval_flops_per_example(teacher, seq)
    phase = next(p for p in build_plan(cfg, "ki") if isinstance(p, Phase) and p.teacher)
    assert [phase.teacher_weight(s) for s in (0, 3, 6, 11)] == [0.5, 0.25, 0.0, 0.0]
    with pytest.raises(ConfigError, match=r"ki.alpha must be a number in \(0, 1\]"):
        smoke("gpt2", "ki.alpha=0")
    with pytest.raises(ConfigError, match="ki: width 3 and depth 2 must divide"):
        build_plan(smoke("gpt2", "ki.width=3"), "ki")


def test_ligo_fits_its_operator_and_charges_each_fitting_step_as_a_large_training_step(tmp_path):
    """LiGO on the GPT-2 smoke preset: the small stage, the fit logged (its loss before and after),
    the large model trained to train.steps; the fit is charged fit_steps x batch x the large model's
    training FLOPs per example (counted here from the saved model), in the plan and the ledger."""
    from mlresearch.training.flops import train_flops_per_example

    cfg = smoke("gpt2", "model.layers=4", "ligo.fit_steps=5")
    summary = run_method(cfg, "ligo", tmp_path / "run")
    assert [(p["phase"], p["steps"]) for p in summary["phases"]] == [("stage0", 4), ("stage1", 8)]
    rows = read_metrics(tmp_path / "run")
    fitted = next(r for r in rows if r.get("event") == "ligo_fit")
    model = load_model(tmp_path / "run" / "final_model")
    assert family_of(model).sizes(model).layers == 4
    assert fitted["flops"] == 5 * cfg.train.batch_size * train_flops_per_example(model, cfg.data.seq_len)
    phases = sum(p["flops"] for p in summary["phases"])
    assert summary["flops_total"] == phases + fitted["flops"] == planned_ledger(cfg, "ligo")["flops"]
    with pytest.raises(ConfigError, match="ligo.steps 12 leaves no steps"):
        build_plan(smoke("gpt2", "ligo.steps=12"), "ligo")
    with pytest.raises(ConfigError, match=r"ligo.fit_lr must be a number in \(0, inf\)"):
        smoke("gpt2", "ligo.fit_lr=0")


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_msg_grows_keeping_the_function_and_ramps_its_masks_to_the_plain_model(tmp_path, family):
    """MSG on the smoke presets (pre-norm GPT-2, post-norm BERT): a half-width, half-depth model for
    its steps, grown with the validation loss unchanged (masks at 0), the full model trained to
    train.steps on the one schedule while the masks ramp (steps 1..6 train at 1/6 .. 1, then none),
    the ledger equal to the plan; impossible ramps and budgets are config errors."""
    from mlresearch.operators.msg import MaskRamp

    cfg = smoke(family, "model.layers=4", "msg={steps: 4, ramp: 6}")
    summary = run_method(cfg, "msg", tmp_path / "run")
    assert [(p["phase"], p["steps"]) for p in summary["phases"]] == [("stage0", 4), ("stage1", 8)]
    grown = next(r for r in read_metrics(tmp_path / "run") if r.get("event") == "grown")
    assert grown["op"] == "msg_grow" and abs(grown["val_loss_before"] - grown["val_loss_after"]) <= 1e-6
    assert summary["flops_total"] == planned_ledger(cfg, "msg")["flops"]
    model = load_model(tmp_path / "run" / "final_model")
    assert family_of(model).sizes(model) == model_sizes(cfg)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    phase = next(p for p in build_plan(cfg, "msg") if isinstance(p, Phase) and p.masks)
    assert phase.masks == MaskRamp(2, 2, 6) and [phase.masks.value(s) for s in (0, 2, 5)] == [1 / 6, 0.5, 1.0]
    with pytest.raises(ConfigError, match="msg.ramp 9 is longer than the 8 steps after the growth"):
        build_plan(smoke(family, "msg={steps: 4, ramp: 9}"), "msg")
    with pytest.raises(ConfigError, match="msg.steps 12 leaves no steps"):
        build_plan(smoke(family, "msg={steps: 12, ramp: 1}"), "msg")
    with pytest.raises(ConfigError, match="msg.optimizer must be 'reset' or 'carry'"):
        smoke(family, "msg={steps: 4, optimizer: keep}")


@pytest.mark.parametrize("family", ["bert", "deit", "llama"])
@pytest.mark.parametrize("method, section", [
    ("stackbert", "stackbert={steps: [4], rewarmup: 2, optimizer: carry}"),
    ("bert2bert", "bert2bert={init: aki, steps: 4, rewarmup: 2, optimizer: carry}"),
    ("ki", "ki={teacher_steps: 4, alpha: 0.5, steps: 6}"),
    ("ligo", "ligo={steps: 4, fit_steps: 3, rewarmup: 2}"),
    ("msg", "msg={steps: 4, ramp: 4}"),
])
def test_the_comparison_methods_run_on_every_smoke_preset(tmp_path, family, method, section):
    """Each comparison method end to end on the other families' smoke presets (the first test runs
    every method on GPT-2's): its ledger equals its plan and the final model has the config's shape."""
    cfg = smoke(family, section)
    summary = run_method(cfg, method, tmp_path / "run")
    assert summary["flops_total"] == planned_ledger(cfg, method)["flops"]
    model = load_model(tmp_path / "run" / "final_model")
    assert family_of(model).sizes(model) == model_sizes(cfg)
