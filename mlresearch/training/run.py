"""Runs: one run directory per method and config, a plan (:mod:`mlresearch.training.methods`:
baseline, small-model control, V-cycle, ...) executed over it with the FLOPs ledger.

Every run writes ``<out>/config.yaml``, ``provenance.json``, ``metrics.jsonl`` (training rows,
operator and phase-end events), ``summary.json`` (the run's record, :mod:`.record`) and
``checkpoints/`` (not committed).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from ..checkpoint import (atomic_write_text, read_structured, recover_tree, save_model,
                          state_exists, state_value)
from ..errors import MLResearchError
from ..faults import fault_point
from ..overwrite import RUN, check_is_run, check_overwrite, check_writable_path
from ..data.datasets import load_data
from ..results import provenance, write_json
from .config import SETTINGS, ConfigError, RunConfig, default_value, flatten_config
from .engine import Ledger, MetricsLog, RunState, evaluate, read_metrics, train_phase
from .methods import METHODS, build_plan, check_plan, execute
from .phase import Phase
from .models import build_model, check_model_fits_data, data_settings, model_sizes
from .record import describe


def runs_root(root: str | Path | None = None) -> Path:
    """Where runs go by default: ``--root``, else ``$MLRESEARCH_RUNS``, else ``runs/`` in the current
    directory. The committed study lives in ``results/`` and is written only when asked for
    (``root: results`` in a committed study spec), so a user's runs never land on it."""
    return Path(root or os.environ.get("MLRESEARCH_RUNS") or "runs")


def default_out(cfg: RunConfig, kind: str, root: str | Path | None = None) -> Path:
    """``<root>/<experiment>/<run name>``; the name can never leave the root."""
    if kind not in METHODS:
        raise ConfigError(f"unknown method {kind!r}; known: {sorted(METHODS)}")
    name = f"{METHODS[kind].directory(cfg)}-seed{cfg.seed}"
    base = runs_root(root)
    out = base / cfg.experiment / name
    if not out.resolve().is_relative_to(base.resolve()) or len(out.relative_to(base).parts) != 2:
        raise ConfigError(f"run name {cfg.experiment}/{name} would leave {base}")
    return out


def _latest_checkpoint_rows(ckpt: Path) -> int:
    """Rows ``metrics.jsonl`` had when the newest checkpoint was taken (0 without one)."""
    if not ckpt.is_dir():
        return 0
    return max((state_value(d, "log_rows") for d in ckpt.iterdir() if d.is_dir() and state_exists(d)), default=0)


def config_differences(out: Path, cfg: RunConfig, kind: str) -> list[str]:
    """Dotted keys whose values in ``out/config.yaml`` differ from ``cfg`` (keys the stored
    config lacks count as equal when ``cfg`` has their default), among the settings method ``kind``
    reads."""
    path = Path(out) / "config.yaml"
    if not path.exists():
        return []
    stored = read_structured(path, "the run's config", ConfigError, fmt="yaml") or {}
    if not isinstance(stored, dict):
        raise ConfigError(f"the run's config {path} is not a mapping of sections: the file was damaged")
    old, new = dict(flatten_config(stored)), dict(flatten_config(cfg.to_dict()))
    for k in new.keys() - old.keys():  # a setting added after the run was written: it had its default
        default = default_value(k)
        old[k] = list(default) if isinstance(default, tuple) else default
    reads = METHODS[kind].reads if kind in METHODS else tuple(SETTINGS)
    ignored = set(SETTINGS) - set(reads)  # other methods' sections
    keys = {k for k in set(new) | set(old) if k.split(".")[0] not in ignored}
    for k in keys - set(new):  # a section this config lacks (vcycle: null) counts as its default
        new[k] = None
    # Where and how fast the data is read or prepared changes nothing a run computes.
    # So does how a step is executed (train.speed: the same model within fp32 tolerance).
    unread = {"train.threads", "data.num_proc", "data.prepared_dir", "train.speed"}
    return sorted(k for k in keys if k not in unread and old.get(k) != new.get(k))


class Run:
    """Shared plumbing of a baseline or V-cycle run: one writer per run directory (a lock), and
    nothing written before the config, the output path and the data have been checked."""

    def __init__(self, cfg: RunConfig, out: Path, resume: bool, overwrite: bool, kind: str, plan=None) -> None:
        from accelerate import Accelerator

        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.cfg, self.out = cfg, Path(out)
        check_writable_path(self.out)
        if self.out.exists() and not self.out.is_dir():
            raise FileExistsError(f"--out {self.out} is a file, not a run directory")
        # cpu=True when there is no GPU: accelerate then treats torchrun's ranks as MULTI_CPU (gloo).
        # bf16 is our own torch.autocast in the engine: accelerate's process-wide state would pin
        # the first run's precision for every later run in the same process.
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        main = self.accelerator.is_main_process
        self.accelerator.wait_for_everyone()  # every rank looks before any rank creates the directory
        exists = self.out.exists() and any(p.name != ".lock" for p in self.out.iterdir())
        self.accelerator.wait_for_everyone()
        if resume and overwrite:
            raise ConfigError("--resume continues a run and --overwrite starts it over: give one of them")
        if exists and not resume:
            if not overwrite:
                changed = config_differences(self.out, cfg, kind)
                other = f" with another config (differs in {', '.join(changed)})" if changed else ""
                raise FileExistsError(f"{self.out} exists{other}; pass --resume to continue it, --overwrite to start "
                                      "over, or --out/--root to write elsewhere")
            check_overwrite(self.out, RUN)  # only a run this project wrote, nothing git tracks
        if exists and resume:
            check_is_run(self.out)
            changed = config_differences(self.out, cfg, kind)
            if changed:
                raise ConfigError(f"{self.out} was started with another config (differs in {', '.join(changed)}); "
                                  "resume it with its own config, or give the variant its own directory (--out or "
                                  "vcycle.tag)")
        torch.manual_seed(cfg.seed)
        self.data = load_data(cfg.task, data_settings(cfg), cfg.seed)  # data errors come before any write
        check_model_fits_data(cfg, self.data)
        if plan is not None:
            check_plan(cfg, plan, self.data)
        self._lock = None
        if main:
            self._lock = _lock(self.out)
            if exists and not resume:
                for child in self.out.iterdir():
                    if child.name != ".lock":
                        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            recover_tree(self.out)  # writes a killed process left half done
        self.accelerator.wait_for_everyone()
        self.ckpt = self.out / "checkpoints"
        self.state = RunState(Ledger(), MetricsLog(self.out / "metrics.jsonl", main))
        if resume:  # rows past the newest checkpoint are written again as the run replays
            self.log.truncate(_latest_checkpoint_rows(self.ckpt))
        if main:
            self.ckpt.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            record = {**provenance(cfg.to_dict(), cfg.seed), "data": self.data.info}  # what it trains on, as loaded
            previous = self.out / "provenance.json"
            if resume and previous.exists():  # keep who started the run; note every resumption
                started = json.loads(previous.read_text())
                started.setdefault("resumed", []).append({k: record[k] for k in ("git_commit", "command", "date")})
                record = started
            write_json(previous, record)
        self.accelerator.wait_for_everyone()
        self.resume = resume
        self.phases: list[dict] = []
        self.shapes: dict = {}  # each phase's model shape, for the record

    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    @property
    def log(self) -> MetricsLog:
        return self.state.log

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def new_model(self, sizes=None):
        torch.manual_seed(self.cfg.seed)
        return build_model(self.cfg, self.data.vocab_size or None, self.data.special, sizes=sizes)

    def train(self, model, optimizer, phase: Phase, teacher=None):
        start = dict(flops=self.ledger.flops, wall=self.ledger.wall, examples=self.ledger.examples)
        model, optimizer = train_phase(model, optimizer, phase, self.data, self.cfg, self.accelerator, self.state,
                                       self.ckpt, resume=self.resume, teacher=teacher)
        steps = state_value(self.ckpt / phase.name, "step")  # fewer than planned where a trigger ended it
        record = {"event": "phase_end", "phase": phase.name, "level": phase.level, "steps": steps,
                  "flops": self.ledger.flops - start["flops"], "wall": self.ledger.wall - start["wall"],
                  "examples": self.ledger.examples - start["examples"]}
        self.phases.append(record)
        self.shapes[phase.name] = phase.sizes or model_sizes(self.cfg)
        self.log.write(record)
        fault_point(f"after-phase:{phase.name}")
        return model, optimizer

    def probe_batches(self, n: int = 2) -> list[dict]:
        """Fixed validation batches for measuring similarity (not training data)."""
        from ..data.datasets import make_batch

        b, total = self.cfg.train.batch_size, len(self.data.val)
        return [{k: v for k, v in make_batch(self.data, "val", np.arange(i * b, min((i + 1) * b, total)),
                                             10**9 + i, self.cfg.seed).items() if k != "labels"}
                for i in range(min(n, max(1, total // b)))]

    @property
    def data_step(self) -> int:
        """The training stream's next step: the batch the next phase (or a transition's own use of
        training batches) draws first."""
        return self.ledger.data_step

    def charge(self, flops: float = 0.0, wall: float = 0.0, data_steps: int = 0) -> None:
        """Count what a transition spent outside the phases (forward passes that choose something,
        a fitted operator's steps) and the training batches it consumed."""
        self.ledger.flops += flops
        self.ledger.wall += wall
        self.ledger.data_step += data_steps

    def keep(self, model, name: str) -> None:
        """Save ``model`` beside the checkpoints as ``name`` (the main process writes it)."""
        if self.accelerator.is_main_process:
            save_model(model, self.ckpt / name, overwrite=True)

    def operator(self, name: str, level: int, fn):
        """Run an operator and record its wall time (its FLOPs are negligible: one pass over the parameters)."""
        tick = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - tick
        self.ledger.wall += seconds
        self.log.write({"event": "operator", "op": name, "level": level, "seconds": seconds})
        fault_point(f"after:{name}:{level}")
        return result

    def finish(self, model, kind: str) -> dict:
        final = evaluate(model, self.data, self.cfg, "val", batches=10**9)
        test = evaluate(model, self.data, self.cfg, "test", batches=10**9)
        summary = {"kind": kind, "experiment": self.cfg.experiment, "seed": self.cfg.seed,
                   "final_full_val": final, "final_test": test, "flops_total": self.ledger.flops,
                   "wall_total": self.ledger.wall, "examples_total": self.ledger.examples,
                   "phases": self.phases, "data": self.data.info, "tokens_total": self.ledger.tokens,
                   **describe(self.cfg, kind, self.shapes, self.data.vocab_size or None)}
        # Where growth can pay is stated in tokens per parameter (of the full model: the one a method
        # is compared as), all parameters and non-embedding ones.
        summary.update(tokens_per_parameter=self.ledger.tokens / summary["full_model_parameters"],
                       tokens_per_non_embedding_parameter=self.ledger.tokens / summary["full_model_non_embedding_parameters"])
        chosen = {r["phase"]: r["execution"] for r in read_metrics(self.out) if r.get("event") == "execution"}
        if chosen:  # train.speed: auto (each phase's execution; the default, eager, is not written)
            summary["execution"] = chosen
        if self.data.tune is not None and len(self.data.tune):  # for choices among runs, not the target
            summary["final_tune"] = evaluate(model, self.data, self.cfg, "tune", batches=10**9)
        if self.accelerator.is_main_process:
            save_model(model, self.out / "final_model", overwrite=True)
            write_json(self.out / "summary.json", summary)
        return summary


def run_method(cfg: RunConfig, method: str, out: Path | None = None, resume: bool = False,
               overwrite: bool = False, root: str | Path | None = None) -> dict:
    """Build ``method``'s plan (a config error if it cannot be built) and execute it in one run directory."""
    plan = build_plan(cfg, method)  # before anything is written
    with Run(cfg, out or default_out(cfg, method, root), resume, overwrite, method, plan) as run:
        return run.finish(execute(run, plan), method)


def _lock(out: Path):
    """Hold ``out/.lock`` for this process (released when it exits, however it exits)."""
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise MLResearchError(f"{out} is being written by {holder}; one run directory takes one writer at a time") from None
    f.seek(0)
    f.truncate()
    f.write(f"process {os.getpid()}\n")
    f.flush()
    return f
