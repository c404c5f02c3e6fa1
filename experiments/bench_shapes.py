"""Seconds per training step of every model shape a study uses, on a quiet machine.

Measured wall time on a shared 2-core machine is noise (the same model ran 0-45% slower per step in
one run than in another), so no wall-time saving is claimed from it. Instead every shape any run of
the study passes through (from each run's plan) is timed here, through the engine's own
``train_phase`` on the experiment's data: ``--repeats`` fresh models, each ``--warmup`` steps not
timed, then ``--steps`` timed steps (the ledger's training wall: no evaluation, no checkpoint). The
median over repeats, with its min and max, goes to ``results/tables/step_time.csv``; ``mlresearch
table`` then models each run's training wall time as sum(steps x seconds per step of the phase's
shape, run as it ran) beside the measured one. Nothing else may run while this does.

With ``--executions``, every shape is also timed under each execution ``train.speed`` can choose
(compiled or eager, AdamW's fused kernel or not, on a CPU the process's threads or one, GPT-2's
GELU as transformers' python composition or PyTorch's kernel;
:mod:`mlresearch.training.speed`) and the table
printed per shape: seconds per step and achieved GFLOP/s eager and under its fastest execution, and
that rate over the full shape's eager rate (issue: small phases at full speed; goal >= 85%, the full
shape no slower than eager).

    python experiments/bench_shapes.py experiments/studies/gpt2_regime.yaml [--steps 40 --repeats 5] [--executions]
    python experiments/bench_shapes.py SPEC --executions eager+1thread,compiled+fused --shapes 1L/64d/2h
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, ClassVar

import pandas as pd
import torch
import yaml

from mlresearch.checkpoint import atomic_write_text
from mlresearch.data.datasets import load_data
from mlresearch.results import REPO, provenance
from mlresearch.study_runner import load_study
from mlresearch.tasks import task_of
from mlresearch.training.config import ConfigError, load_config
from mlresearch.training.config import SPEEDS
from mlresearch.training.engine import Ledger, MetricsLog, RunState, train_phase
from mlresearch.training.flops import peak_flops, train_flops_per_example
from mlresearch.training.phase import Phase
from mlresearch.training.speed import composed_gelus, splits_head
from mlresearch.training.methods import METHODS, planned_ledger
from mlresearch.training.models import build_model, data_settings, model_sizes


def study_shapes(spec: dict, overrides: list[str] = ()) -> dict:
    """shape key -> sizes for every phase of every run the study makes (its config under ``overrides``,
    as the timing's, then each run's sets)."""
    config = REPO / "experiments" / "configs" / f"{spec['config']}.yaml"
    shapes = {}
    for method, sets in [("baseline", [])] + [(r["method"], r.get("set", [])) for r in spec["runs"].values()]:
        for phase in planned_ledger(load_config(config, [*overrides, *sets]), method)["phases"]:
            shapes.setdefault(phase["sizes"].key, phase["sizes"])
    return shapes


def config_shapes(config: Path, sets: list[str] = ()) -> dict:
    """shape key -> sizes for every phase of every method a run config (a preset, with ``sets``) can plan."""
    shapes = {}
    for method in sorted(METHODS):
        try:
            phases = planned_ledger(load_config(config, sets), method)["phases"]
        except ConfigError:  # a method this preset cannot plan
            continue
        for phase in phases:
            shapes.setdefault(phase["sizes"].key, phase["sizes"])
    return shapes


def timing_config(config: Path, sets: list[str] = ()):
    """The run config a shape is timed under: the experiment's data and batch (and ``sets``, e.g.
    train.bf16=true on a GPU), and nothing that evaluates, checkpoints or logs mid-phase."""
    return load_config(config, [*sets, "train.eval_every=1000000000", "train.eval_batches=1",
                                "train.checkpoint_every=1000000000", "train.log_every=1000000000"])


@dataclass
class StepWalls(Ledger):
    """The engine's ledger, keeping each step's wall time as well (the engine adds it to ``wall`` once
    a step), so a phase's first steps can be left out of its timing: a compiled phase compiles
    afresh in its first step (``compile_afresh``), which a second phase after a warm one would charge
    to the timed steps."""

    walls: list = field(default_factory=list)
    # called as each step's wall time is charged (a profiler's step); not a field, so the ledger's
    # state (a checkpoint's copy) stays plain numbers
    on_step: ClassVar[Callable[[], None] | None] = None

    def __setattr__(self, name, value):
        if name == "wall" and "walls" in self.__dict__:
            self.walls.append(value - self.wall)
            if self.on_step is not None:
                self.on_step()
        super().__setattr__(name, value)


def seconds_per_step(cfg, sizes, data, steps: int, warmup: int, execution: str = "eager", on_step=None) -> float:
    """Mean seconds per step over ``steps`` steps of one phase, after its first ``warmup`` (not timed);
    ``on_step()`` is called after each step's wall time is charged."""
    from accelerate import Accelerator

    cfg = replace(cfg, train=replace(cfg.train, speed=execution))
    model = build_model(cfg, data.vocab_size or None, data.special, sizes=sizes).train()
    with tempfile.TemporaryDirectory() as tmp:
        ledger = StepWalls()
        ledger.on_step = on_step
        state = RunState(ledger, MetricsLog(Path(tmp) / "metrics.jsonl"))
        train_phase(model, None, Phase("timed", 1, warmup + steps, cfg.train.lr, min(cfg.train.warmup, warmup + steps)),
                    data, cfg, Accelerator(cpu=not torch.cuda.is_available()), state, Path(tmp) / "ck")
        assert len(ledger.walls) == warmup + steps, "a step's wall time was not charged once"
        return sum(ledger.walls[warmup:]) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="a study spec (experiments/studies/*.yaml: the shapes of its runs) or a preset "
                                 "(experiments/configs/*.yaml: the shapes of every method it plans)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per repeat")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--executions", nargs="?", const="all", metavar="NAMES",
                    help="also time every execution train.speed can choose (or these, comma-separated)")
    ap.add_argument("--shapes", metavar="KEYS", help="time only these shapes (comma-separated, e.g. 1L/64d/1h; "
                                                      "the full shape is always timed)")
    ap.add_argument("--table", help="write the rows here (default: the study's results/tables/step_time.csv)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override the experiment's config for the timing (repeatable), e.g. train.bf16=true")
    args = ap.parse_args()
    path = Path(args.spec)
    if "experiment" in (yaml.safe_load(path.read_text()) or {}):
        config, shapes, root = path, config_shapes(path, args.set), "results"
    else:
        spec = load_study(path)
        config = REPO / "experiments" / "configs" / f"{spec['config']}.yaml"
        shapes, root = study_shapes(spec, args.set), spec.get("root", "results")
    cfg = timing_config(config, args.set)
    # (on a GPU, not the one-thread ones: the host's threads idle there; the masked-head ones for a masked LM only)
    everything = [e for e in SPEEDS if e != "auto" and not (torch.cuda.is_available() and "thread" in e)
                  and (splits_head(cfg) or "maskedhead" not in e)]
    named = everything if args.executions == "all" else (args.executions or "eager").split(",")
    executions = ["eager"] + [e for e in named if e != "eager"]
    if set(executions) - set(SPEEDS):
        raise SystemExit(f"--executions: {', '.join(sorted(set(executions) - set(SPEEDS)))} is not one of "
                         f"{', '.join(everything)}")
    if any("maskedhead" in e for e in executions) and not splits_head(cfg):
        raise SystemExit(f"--executions: +maskedhead is for a masked LM; {cfg.model.family} models have no head to "
                         f"run apart")
    full = model_sizes(cfg).key
    shapes = {full: model_sizes(cfg), **{k: v for k, v in shapes.items() if k != full}}  # the full shape first
    if args.shapes:
        unknown = set(args.shapes.split(",")) - set(shapes)
        if unknown:
            raise SystemExit(f"--shapes: {', '.join(sorted(unknown))} is not a shape of {path.name} "
                             f"(its shapes: {', '.join(shapes)})")
        shapes = {k: v for k, v in shapes.items() if k == full or k in args.shapes.split(",")}
    out = Path(args.table) if args.table else REPO / root / "tables" / "step_time.csv"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    if out.exists() and "device" in (previous := pd.read_csv(out)) and set(previous["device"].dropna()) - {device}:
        # (a study's modelled wall reads one machine's timings: another machine's would mix in)
        raise SystemExit(f"--table: {out} holds timings from {', '.join(sorted(set(previous['device'].dropna())))}, "
                         f"not this {device}: write this machine's to another table (--table)")
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    data = load_data(cfg.task, data_settings(cfg), cfg.seed)
    if not composed_gelus(build_model(cfg, data.vocab_size or None, data.special, device="meta")):
        if args.executions != "all" and any("nativegelu" in e for e in executions):
            raise SystemExit(f"--executions: +nativegelu replaces a GELU transformers composes in python; "
                             f"{cfg.model.family} models here have none")
        executions = [e for e in executions if "nativegelu" not in e]
    rows, rates = [], {}
    for key, sizes in shapes.items():
        seq = task_of(cfg.task).seq_len(cfg)
        flops = train_flops_per_example(build_model(cfg, data.vocab_size or None, data.special, device="meta",
                                                    sizes=sizes), seq) * cfg.train.batch_size
        for execution in executions:
            torch.compiler.reset()  # compiled afresh for each shape: no recompile limit, no shape made dynamic
            times = []
            try:
                for i in range(args.repeats):
                    torch.manual_seed(i)
                    times.append(seconds_per_step(cfg, sizes, data, args.steps, args.warmup, execution))
            except Exception as error:  # (an execution this machine cannot run is reported, the others timed)
                print(f"{key:>14} {execution:>22}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
                continue
            rows.append({"experiment": cfg.experiment, "shape": key, "execution": execution,
                         "seconds_per_step": statistics.median(times), "min": min(times), "max": max(times),
                         "gflops_per_second": flops / statistics.median(times) / 1e9,
                         "repeats": args.repeats, "steps": args.steps,
                         "batch_size": cfg.train.batch_size, "bf16": cfg.train.bf16, "threads": torch.get_num_threads(),
                         "device": device, "torch": torch.__version__, "git_commit": provenance({}, 0)["git_commit"]})
            rates[key, execution] = rows[-1]["gflops_per_second"]
            print(f"{key:>14} {execution:>22}: {rows[-1]['seconds_per_step'] * 1e3:7.2f} ms/step, "
                  f"{rows[-1]['gflops_per_second']:6.1f} GFLOP/s (median of {args.repeats}; min {min(times) * 1e3:.2f}, "
                  f"max {max(times) * 1e3:.2f} ms)", flush=True)
    if args.executions:
        peak = peak_flops(torch.device("cuda" if torch.cuda.is_available() else "cpu"), cfg.train.peak_tflops)
        mfu = (lambda r: f"{r * 1e9 / peak:7.1%}") if peak else (lambda r: f"{'-':>7}")  # noqa: E731
        print(f"\nper shape: eager and its fastest execution; the rate over the full shape ({full}) eager's "
              "(MFU: over the device's dense bf16 peak, GPUs only)")
        print(f"{'shape':>14} | {'eager GFLOP/s':>13} | {'MFU':>7} | {'fastest':>22} | {'GFLOP/s':>7} | {'MFU':>7} | "
              f"{'x eager':>7} | {'vs full eager':>13}")
        for key in shapes:
            rate = lambda e: rates.get((key, e), float("nan"))  # noqa: E731 (nan: the execution failed)
            best = max(executions, key=lambda e: rates.get((key, e), 0.0))
            print(f"{key:>14} | {rate('eager'):13.1f} | {mfu(rate('eager'))} | {best:>22} | "
                  f"{rate(best):7.1f} | {mfu(rate(best))} | {rate(best) / rate('eager'):7.2f} | "
                  f"{rate(best) / rates.get((full, 'eager'), float('nan')):13.0%}")
    table = pd.DataFrame(rows)
    if out.exists():  # other shapes stay
        previous = pd.read_csv(out)
        if "execution" not in previous:  # rows from before executions were timed: eager
            previous["execution"] = "eager"
        previous["execution"] = previous["execution"].fillna("eager")
        # (a shape timed in bf16 is another row than the same shape in fp32: neither replaces the other)
        previous["bf16"] = previous["bf16"].fillna(False).astype(bool) if "bf16" in previous else False
        index = ["experiment", "shape", "execution", "bf16"]
        keep = ~previous.set_index(index).index.isin(table.set_index(index).index)
        table = pd.concat([previous[keep], table], ignore_index=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, table.to_csv(index=False))
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
