"""The training engine: one phase of training, read top to bottom.

A run is a sequence of *phases* (the baseline is one; a V-cycle has one per level visit). Each
phase trains one model with AdamW (or a carried optimizer) under warm-up + linear/cosine decay,
through ``accelerate`` (so ``torchrun`` / ``accelerate launch`` give DDP; ``train.fsdp``: FSDP2,
see :class:`Sharded`), logs to the run's
``metrics.jsonl``, adds its FLOPs to the ledger, and checkpoints atomically (model safetensors,
optimizer, scheduler, RNG, data position, ledger) so that ``--resume`` reproduces an
uninterrupted run. A non-finite loss stops the run and keeps the last good checkpoint.
"""

from __future__ import annotations

import copy
import json
import math
import random
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..checkpoint import (atomic_dir, atomic_write_text, load_model, load_state, save_model, save_state,
                          state_exists)
from ..data.datasets import Data, batch_indices, make_batch
from ..errors import MLResearchError
from ..faults import fault_point
from ..tasks import task_of
from .config import RunConfig
from .flops import eval_flops_per_example, peak_flops, train_flops_per_example
from .speed import (EAGER, Execution, OutputAtMaskedPositions, activations_restored, candidates, choose,
                    intra_op_threads, trial_key, use_native_gelu)
from .phase import Phase


class TrainingDiverged(MLResearchError, RuntimeError):
    """The loss became NaN or infinite."""


@dataclass
class Ledger:
    """Cumulative counters over the whole run (every phase adds to them)."""

    flops: float = 0.0
    examples: int = 0
    tokens: int = 0
    wall: float = 0.0
    data_step: int = 0  # global batches drawn so far: phases continue one data stream

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Counters a checkpoint lacks (one written before they existed) keep their values."""
        for k, v in state.items():
            setattr(self, k, v)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, flushed as written.

    ``count`` is the run's position in its own sequence of rows. A resumed run replays the plan
    from the start: rows up to the position already in the file are not written again, and the
    file holds nothing past the checkpoint being resumed (the run truncates it there first), so
    after any sequence of kills and resumes the file equals an uninterrupted run's rows.
    """

    def __init__(self, path: Path, main: bool = True) -> None:
        self.path, self.main = path, main
        self.count = self.in_file = len(self._complete_lines())
        self._board = None

    def _complete_lines(self) -> list[str]:
        """The file's rows, without a last line a kill cut off mid-write (it has no newline)."""
        if not self.path.exists():
            return []
        return self.path.read_text().splitlines(keepends=True)[:self.path.read_text().count("\n")]

    def write(self, row: dict) -> None:
        self.count += 1
        if self.count <= self.in_file:  # replaying a resumed run: this row is already there
            return
        if self.main:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            self._tensorboard(row)
        self.in_file = self.count

    def resume_at(self, count: int) -> None:
        """Continue from a checkpoint that was taken after ``count`` rows."""
        if count > self.in_file:
            raise MLResearchError(f"{self.path} has {self.in_file} rows but a checkpoint was taken after {count}; "
                                  "the run directory was changed by hand: start it over with --overwrite")
        self.count = count

    def truncate(self, count: int) -> None:
        """Keep the first ``count`` rows (a resumed run writes the later ones again)."""
        if self.main and self.path.exists():
            atomic_write_text(self.path, "".join(self._complete_lines()[:count]))
        self.count = self.in_file = min(count, self.in_file)

    def _tensorboard(self, row: dict) -> None:
        """Mirror training rows to TensorBoard when it is installed (x axis: examples seen)."""
        if self._board is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._board = SummaryWriter(str(self.path.parent / "tensorboard"))
            except ImportError:
                self._board = False
        if self._board and "examples" in row and "event" not in row:
            for key in ("train_loss", "val_loss", "val_acc", "lr"):
                if key in row:
                    self._board.add_scalar(f"{key}/{row['phase']}", row[key], row["examples"])


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise MLResearchError(f"{path} line {n} is not JSON ({exc}); the file was damaged") from exc
    return rows


def new_optimizer(model: nn.Module, cfg: RunConfig, lr: float) -> torch.optim.Optimizer:
    """AdamW; matrices decay, norms/biases/embedding-like vectors do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    t = cfg.train
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(t.betas), eps=t.eps)


def compute_loss(model: nn.Module, batch: dict, task: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean loss, number of correct predictions where the task counts them)."""
    return task_of(task).loss(model, batch)


def evaluate(model: nn.Module, data: Data, cfg: RunConfig, split: str = "val", batches: int | None = None) -> dict:
    """Mean loss (and accuracy) over the first ``batches`` fixed batches of ``split``."""
    x, _ = data.split(split)
    b = cfg.train.batch_size
    n = min(len(x), b * (batches or cfg.train.eval_batches))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for i, start in enumerate(range(0, n, b)):
            idx = np.arange(start, min(start + b, n))
            batch = {k: v.to(device) for k, v in make_batch(data, split, idx, step=10**9 + i, seed=cfg.seed).items()}
            loss, right = compute_loss(model, batch, data.task)
            total += loss.item() * len(idx)
            correct += int(right) if right is not None else 0
            count += len(idx)
    model.train(was_training)
    out = {f"{split}_loss": total / count}
    if task_of(data.task).accuracy:
        out[f"{split}_acc"] = correct / count
    return out


class RNG:
    """Every random generator a run draws from (torch, CUDA, NumPy, Python), as one part of its state:
    after a resume the next draws are the killed run's."""

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class RunState:
    """What a run carries from phase to phase, and every checkpoint saves of it: the FLOPs ledger,
    the metrics log's position and the random generators. Each part saves and restores itself;
    :meth:`restore` is the one place a resumed run takes them back. (The model, optimizer, schedule
    and step are the phase's, restored by :class:`Progress`; what a plan carries between phases,
    its partners and schedule position, is rebuilt by replaying the plan over finished phases.)"""

    ledger: Ledger
    log: MetricsLog
    rng: RNG = field(default_factory=RNG)

    def state_dict(self) -> dict:
        return {"ledger": self.ledger.state_dict(), "log_rows": self.log.count, "rng": self.rng.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.load_state_dict(state["rng"])
        self.ledger.load_state_dict(state["ledger"])
        self.log.resume_at(state["log_rows"])

    def restore(self, ckpt: Path) -> dict:
        """Take back what the phase checkpoint ``ckpt`` saved of the run; returns the whole
        checkpoint (its optimizer, scheduler, step and trigger curve, for the phase)."""
        state = load_state(ckpt)
        self.load_state_dict(state)
        return state


def save_checkpoint(path: Path, model, optimizer, scheduler, step: int, run_state: RunState,
                    curve: list | None = None, ended: bool = False) -> None:
    """``curve``: the (FLOPs, validation loss) points a trigger has seen; ``ended``: the phase
    stopped here before its ``steps`` because the trigger fired."""
    with atomic_dir(path, overwrite=True) as tmp:
        save_model(model, tmp / "model")
        # The LR multipliers themselves are not state: the phase rebuilds them; only the position is kept.
        position = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        save_state(tmp, {"optimizer": optimizer.state_dict(), "scheduler": position, **run_state.state_dict(),
                         "step": step, "curve": curve or [], "ended": ended})


def trigger_check(curve: list, threshold: float) -> tuple[float | None, bool]:
    """(the smoothed log-log slope at the newest point, whether the trigger has fired) for the
    (FLOPs, loss) points of a phase so far (fewer than 3 points: no slope yet)."""
    from .trigger import loglog_slope, trigger_index

    if len(curve) < 3:
        return None, False
    compute, loss = zip(*curve)
    return float(loglog_slope(compute, loss)[-1]), trigger_index(compute, loss, threshold) is not None


def nonfinite_parameters(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]


def train_phase(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    phase: Phase,
    data: Data,
    cfg: RunConfig,
    accelerator,
    run_state: RunState,
    ckpt_dir: Path,
    resume: bool = False,
    teacher: nn.Module | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Train ``model`` for ``phase.steps`` steps; returns the trained model and its optimizer.

    Each step is one optimizer step on the global batch and the ledger charged; then each of the
    phase's :class:`Hook` s the step is due for runs, in order (a log row, an evaluation, the growth
    trigger, the row written, a checkpoint, a snapshot). What a phase adds to the step itself (a
    ``teacher`` to distil from, masks that ramp) is :class:`PhaseExtras`. With ``resume`` a phase
    starts where its checkpoint left off, and one whose checkpoint says it finished trains no step:
    it hands on the model and optimizer the checkpoint holds (this is the one place a run resumes).
    An execution (``train.speed``) may run the phase on fewer threads or with other activation modules;
    the process's count and ``model``'s modules are back after."""
    with intra_op_threads(None), activations_restored(model):
        return _train_phase(model, optimizer, phase, data, cfg, accelerator, run_state, ckpt_dir, resume, teacher)


def _train_phase(model, optimizer, phase: Phase, data: Data, cfg: RunConfig, accelerator, run_state: RunState,
                 ckpt_dir: Path, resume: bool, teacher: nn.Module | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    t, ledger = cfg.train, run_state.ledger
    optimizer, scheduler = _optimizer_and_schedule(model, optimizer, phase, cfg)
    progress = Progress(ckpt_dir / phase.name)
    if resume and state_exists(progress.ckpt):
        progress.restore(model, optimizer, scheduler, run_state)
        if progress.finished(phase):  # as the phase left it: the next transition keeps or drops the optimizer
            return model.train(), optimizer
        if accelerator.is_main_process:
            tqdm.write(f"resuming {phase.name} at step {progress.start} of {phase.steps} ({progress.ckpt})",
                       file=sys.stderr)
    accelerator.free_memory()  # drop the previous phase's references
    seq = task_of(data.task).seq_len(cfg)
    flops_per_example, tokens_per_example = train_flops_per_example(model, seq), seq or 1
    batch, world = t.batch_size, accelerator.num_processes
    micro = _micro_batch(cfg, world)
    if t.speed == "eager":  # train.compile: true, or a backend's name
        execution = EAGER
        compiled = None if not t.compile else {} if t.compile is True else {"backend": t.compile}
    else:
        execution = _execution(model, optimizer, phase, cfg, data, accelerator, micro, run_state.log, progress.start)
        compiled = execution.compile_options
    if execution.native_gelu:
        use_native_gelu(model)
    model, optimizer, scheduler, raw, sharded = _distribute(model, optimizer, scheduler, phase, cfg, accelerator,
                                                            compiled)
    if execution.masked_head:  # (offered on one process only: ``model`` is ``raw`` itself)
        model = OutputAtMaskedPositions(raw)
    extras = PhaseExtras(phase, teacher, raw, progress.start, accelerator.device, seq)
    first_bad = torch.zeros((), dtype=torch.long, device=accelerator.device)  # step of the first non-finite loss
    loop = PhaseLoop(phase, cfg, accelerator, run_state, progress, raw, optimizer, scheduler, sharded, ckpt_dir)
    hooks = phase_hooks(loop, data)

    for step in loop.bar:
        tick = time.perf_counter()
        end = StepEnd(step + 1)  # steps count from 1, as in metrics.jsonl
        idx = batch_indices(len(data.train), batch, ledger.data_step, cfg.seed)[accelerator.process_index::world]
        distil_from, weight = extras.at(step)
        total = accumulate(model, data, idx, micro, ledger.data_step, cfg, accelerator, distil_from, weight)
        first_bad = torch.where((first_bad == 0) & ~torch.isfinite(total), end.done, first_bad)
        if t.grad_clip:
            accelerator.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        due = [hook for hook in hooks if hook.due(end)]
        # The host waits for the device only on steps a due hook reads the loss on (inside the
        # step's wall time, so the ledger's wall stays right on an asynchronous device).
        if any(hook.reads_loss for hook in due):
            end.loss = _finite_loss(total, first_bad, accelerator, phase, end.done, progress)
        ledger.flops += (flops_per_example + extras.flops_per_example(weight)) * batch
        ledger.examples += batch
        ledger.tokens += tokens_per_example * batch
        ledger.data_step += 1
        ledger.wall += time.perf_counter() - tick
        for hook in hooks:  # asked again: a hook before may have made it due (a fired trigger, a checkpoint)
            if hook.due(end):
                hook(end)
        fault_point(f"step:{phase.name}:{end.done}")
        if end.fired:
            break
    loop.bar.close()
    extras.close(end.done if progress.start < phase.steps else progress.start)  # (a phase of no steps trains none)
    if sharded:  # the phase ends on a checkpoint step, so the gathered copy is the trained model
        return loop.whole or sharded.gather(raw, optimizer)
    return raw, getattr(optimizer, "optimizer", optimizer)


@dataclass
class StepEnd:
    """A finished training step as its hooks see it: the step (from 1), its mean loss over the
    processes (read only on steps a hook needs it), the metrics row the hooks fill in, and whether
    the growth trigger fired (which ends the phase after this step)."""

    done: int
    loss: float | None = None
    row: dict | None = None
    fired: bool = False


class PhaseLoop:
    """What the hooks of one phase share: the phase, the run's state and log, the plain model
    (``raw``: evaluation and checkpoints use it), the optimizer and schedule, the FSDP wrapper, the
    progress bar, and the whole model and optimizer the last checkpoint gathered."""

    def __init__(self, phase: Phase, cfg: RunConfig, accelerator, run_state: RunState, progress: "Progress",
                 raw: nn.Module, optimizer, scheduler, sharded, ckpt_dir: Path) -> None:
        self.phase, self.cfg, self.accelerator, self.run_state = phase, cfg, accelerator, run_state
        self.progress, self.raw, self.optimizer, self.scheduler = progress, raw, optimizer, scheduler
        self.sharded, self.ckpt_dir = sharded, ckpt_dir
        # ``disable`` is passed only to silence other processes: passed at all, it would override TQDM_DISABLE=1.
        quiet = {} if accelerator.is_main_process else {"disable": True}
        self.bar = tqdm(range(progress.start, phase.steps), desc=f"{phase.name} (level {phase.level})",
                        initial=progress.start, total=phase.steps, leave=False, **quiet)
        self.whole: tuple[nn.Module, torch.optim.Optimizer] | None = None

    def every(self, n: int, done: int) -> bool:
        """Step ``done`` is a multiple of ``n`` or the phase's last."""
        return done % n == 0 or done == self.phase.steps


class Hook:
    """Something a phase does after a training step when the step (:class:`StepEnd`, as the hooks
    before it left it) is due for it. ``reads_loss``:
    it needs the step's mean loss (the host waits for the device on those steps)."""

    reads_loss = False

    def __init__(self, loop: PhaseLoop) -> None:
        self.loop = loop

    def due(self, end: StepEnd) -> bool:
        raise NotImplementedError

    def __call__(self, end: StepEnd) -> None:
        raise NotImplementedError


class LogRow(Hook):
    """Start the step's metrics row: training loss, LR, the ledger, and the model FLOP utilisation
    since the last row."""

    reads_loss = True

    def __init__(self, loop: PhaseLoop) -> None:
        super().__init__(loop)
        device = loop.accelerator.device
        self.peak, self.device = peak_flops(device, loop.cfg.train.peak_tflops), device
        self.since = (loop.run_state.ledger.flops, loop.run_state.ledger.wall)  # MFU is measured between rows

    def due(self, end: StepEnd) -> bool:
        t = self.loop.cfg.train
        return end.done % t.log_every == 0 or self.loop.every(t.eval_every, end.done)

    def __call__(self, end: StepEnd) -> None:
        loop, ledger = self.loop, self.loop.run_state.ledger
        end.row = {"phase": loop.phase.name, "level": loop.phase.level, "step": end.done, "train_loss": end.loss,
                   "lr": loop.scheduler.get_last_lr()[0], "flops": ledger.flops, "examples": ledger.examples,
                   "tokens": ledger.tokens, "wall": ledger.wall}
        if self.peak and ledger.wall > self.since[1]:  # model FLOPs per second per device over the peak
            world = loop.accelerator.num_processes
            end.row["mfu"] = (ledger.flops - self.since[0]) / (ledger.wall - self.since[1]) / world / self.peak
        if self.device.type == "cuda":
            end.row["max_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        self.since = (ledger.flops, ledger.wall)


class Evaluate(Hook):
    """The validation loss (and accuracy) into the row; not training FLOPs or wall time (runs
    evaluate at different rates)."""

    def __init__(self, loop: PhaseLoop, data: Data) -> None:
        super().__init__(loop)
        self.data = data

    def due(self, end: StepEnd) -> bool:
        return self.loop.every(self.loop.cfg.train.eval_every, end.done)

    def __call__(self, end: StepEnd) -> None:
        end.row.update(evaluate(self.loop.raw, self.data, self.loop.cfg))
        self.loop.bar.set_postfix(val=f"{end.row['val_loss']:.3f}")


class Trigger(Hook):
    """The growth trigger (a phase with ``trigger``): after each evaluation, the loss curve's
    log-log slope into the row; when it fires before the phase's end, the phase ends here."""

    def due(self, end: StepEnd) -> bool:
        return self.loop.phase.trigger is not None and self.loop.every(self.loop.cfg.train.eval_every, end.done)

    def __call__(self, end: StepEnd) -> None:
        end.fired = self.loop.progress.trigger(self.loop.phase, self.loop.run_state.ledger, end.row, end.done)


class WriteRow(Hook):
    """The row into ``metrics.jsonl`` (and a trigger event after it, when the trigger fired)."""

    def due(self, end: StepEnd) -> bool:
        return end.row is not None

    def __call__(self, end: StepEnd) -> None:
        loop = self.loop
        loop.run_state.log.write(end.row)
        if end.fired:
            _log_trigger(loop.phase, end.row, end.done, loop.run_state.log, loop.accelerator)


class Checkpoint(Hook):
    """The phase's checkpoint (every ``train.checkpoint_every`` steps, at its end, and where the
    trigger ended it), through :meth:`Progress.checkpoint`."""

    reads_loss = True

    def due(self, end: StepEnd) -> bool:
        return self.loop.every(self.loop.cfg.train.checkpoint_every, end.done) or end.fired

    def __call__(self, end: StepEnd) -> None:
        loop = self.loop
        loop.whole = loop.progress.checkpoint(loop.raw, loop.optimizer, loop.scheduler, loop.sharded, end.done,
                                              loop.run_state, loop.accelerator, ended=end.fired)


class Snapshot(Checkpoint):
    """With ``train.keep_snapshots``: the model at every checkpoint, kept (similarity over training)."""

    reads_loss = False

    def due(self, end: StepEnd) -> bool:
        return self.loop.cfg.train.keep_snapshots and super().due(end)

    def __call__(self, end: StepEnd) -> None:
        loop = self.loop
        if loop.accelerator.is_main_process:
            save_model(loop.whole[0], loop.ckpt_dir / "snapshots" / f"{loop.phase.name}-{end.done:07d}", overwrite=True)


def phase_hooks(loop: PhaseLoop, data: Data) -> list[Hook]:
    """A phase's hooks, in the order they run after a step."""
    return [LogRow(loop), Evaluate(loop, data), Trigger(loop), WriteRow(loop), Checkpoint(loop), Snapshot(loop)]


def _finite_loss(total, first_bad, accelerator, phase: Phase, done: int, progress: "Progress") -> float:
    """The step's mean loss over the processes; a non-finite loss at this or an earlier step stops
    the run (naming the last good checkpoint)."""
    mean_loss = accelerator.reduce(total, reduction="mean").item()
    bad = int(accelerator.reduce(first_bad, reduction="max").item())
    if bad or not math.isfinite(mean_loss):
        raise TrainingDiverged(f"loss is {'nan' if bad else mean_loss} in phase {phase.name} at step "
                               f"{bad or done}; stopping. The last good checkpoint is {progress.last_good}")
    return mean_loss


class PhaseExtras:
    """What a phase adds to a plain training step, read from its settings: a teacher whose
    distillation term has weight :meth:`Phase.teacher_weight` (Knowledge Inheritance; each step of
    weight above 0 runs and is charged its forward pass), and masks on a grown model's new structures
    that ramp to 1 and are then removed (MSG). A phase with neither adds nothing."""

    def __init__(self, phase: Phase, teacher: nn.Module | None, raw: nn.Module, start: int, device, seq) -> None:
        self.phase = phase
        self.teacher = teacher.to(device).eval().requires_grad_(False) if teacher is not None else None
        self.teacher_flops = eval_flops_per_example(self.teacher, seq) if teacher is not None else 0.0
        ramp = phase.masks
        self.masks = ramp.attach(raw) if ramp is not None and start < ramp.steps else None

    def at(self, step: int) -> tuple[nn.Module | None, float]:
        """Ready 0-based ``step``: set the masks' value (or remove them once the ramp is over);
        returns the teacher to distil from at this step (None: none) and its weight."""
        if self.masks is not None and step >= self.phase.masks.steps:
            self.masks.remove()  # the ramp is over: the plain model from here on
            self.masks = None
        elif self.masks is not None:
            self.masks.set(self.phase.masks.value(step))
        weight = self.phase.teacher_weight(step) if self.teacher is not None else 0.0
        return (self.teacher if weight else None), weight

    def flops_per_example(self, weight: float) -> float:
        return self.teacher_flops if weight else 0.0

    def close(self, steps_done: int) -> None:
        if self.masks is None:
            return
        self.masks.remove()
        if steps_done < self.phase.masks.steps:  # (a trigger ended the phase inside the ramp)
            raise ValueError(f"phase {self.phase.name} ended at step {steps_done}, inside its masks' ramp of "
                             f"{self.phase.masks.steps} steps; the model is not whole without them")


def _optimizer_and_schedule(model: nn.Module, optimizer, phase: Phase, cfg: RunConfig):
    """A fresh AdamW (or the carried one, at this phase's LR) and the phase's LR schedule."""
    t = cfg.train
    if t.grad_checkpointing:
        if hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
        else:
            model.set_grad_checkpointing(True)
    if optimizer is None:
        optimizer = new_optimizer(model, cfg, phase.lr)
    for group in optimizer.param_groups:  # a carried optimizer keeps its state, takes this phase's LR
        group["lr"] = group["initial_lr"] = phase.lr
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, phase.schedule(t.schedule, t.min_lr_ratio))


def _execution(model: nn.Module, optimizer, phase: Phase, cfg: RunConfig, data: Data, accelerator, micro: int,
               log: MetricsLog, start: int) -> Execution:
    """``train.speed`` other than eager (:mod:`.speed`): the phase's execution -- the one named, or
    (auto) this shape's fastest, measured or cached -- with ``optimizer`` set to its AdamW kernel and
    an ``execution`` event in the log, and the process on its threads (:func:`train_phase` restores
    them)."""
    if cfg.train.speed == "auto":
        execution, trial = _choose_execution(model, phase, cfg, data, accelerator, micro)
    else:
        execution = Execution.parse(cfg.train.speed)
        allowed = candidates(phase, cfg, accelerator.device, accelerator.num_processes, model)
        if not any(option.compile for option in allowed):
            execution = replace(execution, compile=False, graphs=False)  # (a phase never compiled runs eager)
        if not any(option.masked_head for option in allowed):
            execution = replace(execution, masked_head=False)  # (nor one whose head cannot run apart)
        if not any(option.native_gelu for option in allowed):
            execution = replace(execution, native_gelu=False)  # (nor one whose GELU is a kernel already)
        trial = {**asdict(execution), "execution": execution.name}
    execution.set_kernel(optimizer)
    if execution.threads is not None:
        torch.set_num_threads(execution.threads)
    if start == 0:  # (a resumed phase wrote it before its checkpoint)
        log.write({"event": "execution", "phase": phase.name, "level": phase.level, **trial})
    return execution


def _choose_execution(model: nn.Module, phase: Phase, cfg: RunConfig, data: Data, accelerator, micro: int,
                      warmup: int = 3, steps: int = 8):
    """``train.speed: auto``: the phase's execution (:func:`choose`), each candidate timed on a
    copy of ``model`` over ``steps`` steps of the run's first batches after ``warmup`` untimed ones;
    the run's random generators are as before the trial."""

    def measure(execution: Execution) -> float:
        with intra_op_threads(execution.threads):
            return timed(execution)

    def timed(execution: Execution) -> float:
        trial = copy.deepcopy(model).train()
        optimizer = new_optimizer(trial, cfg, phase.lr)
        execution.set_kernel(optimizer)
        if execution.native_gelu:
            use_native_gelu(trial)
        runner = trial if execution.compile_options is None else compile_afresh(trial, execution.compile_options)
        if execution.masked_head:
            runner = OutputAtMaskedPositions(trial)
        times = []
        for step in range(warmup + steps):
            tick = time.perf_counter()
            idx = batch_indices(len(data.train), cfg.train.batch_size, step, cfg.seed)
            total = accumulate(runner, data, idx[accelerator.process_index::accelerator.num_processes], micro, step,
                               cfg, accelerator)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total.item()  # the host waits for the device: the step is over
            times.append(time.perf_counter() - tick)
        return statistics.median(times[warmup:])

    rng = RNG()
    saved = rng.state_dict()  # the trial draws dropout masks: the run's next draws stay its own
    try:
        key = trial_key(model, cfg, data, accelerator.device, micro, accelerator.num_processes)
        return choose(candidates(phase, cfg, accelerator.device, accelerator.num_processes, model), key, measure,
                      accelerator)
    finally:
        rng.load_state_dict(saved)


def compile_afresh(model: nn.Module, options: dict) -> nn.Module:
    """``torch.compile(model, **options)`` with dynamo's caches emptied first. A run passes through
    many shapes (each phase's, each trial's), every one a recompilation of the same forward code,
    and past dynamo's recompile limit (8) a frame silently runs eager while the run's record says
    compiled. The models compiled before are out of use when a phase or trial starts, so nothing is
    lost but their compiled code (a shape met again compiles again, from inductor's on-disk cache)."""
    torch.compiler.reset()
    return torch.compile(model, **options)


def _distribute(model, optimizer, scheduler, phase: Phase, cfg: RunConfig, accelerator, compiled):
    """The model and optimizer under DDP (``accelerate``) or FSDP2 (:class:`Sharded`), maybe
    compiled (``compiled``: ``torch.compile``'s keyword arguments; None: not); ``raw`` is the plain
    model evaluation and checkpoints use."""
    t = cfg.train
    if t.fsdp and accelerator.num_processes > 1:
        sharded = Sharded(model, cfg, phase.lr, accelerator.device)
        model, optimizer, scheduler = sharded.shard(optimizer, scheduler, phase.schedule(t.schedule, t.min_lr_ratio))
    else:
        sharded = None
        model, optimizer = accelerator.prepare(model, optimizer)
    raw = accelerator.unwrap_model(model)
    if compiled is not None:  # the compiled module shares raw's parameters; evaluation and checkpoints use raw
        model = compile_afresh(model, compiled)
    return model, optimizer, scheduler, raw, sharded


def _micro_batch(cfg: RunConfig, world: int) -> int:
    """Examples per forward pass on each process (the global batch split evenly, then accumulated)."""
    batch = cfg.train.batch_size
    if batch % world:
        raise MLResearchError(f"train.batch_size {batch} is not divisible by {world} processes")
    micro = cfg.train.micro_batch_size or batch // world
    if (batch // world) % micro:
        raise MLResearchError(f"train.micro_batch_size {micro} does not divide the {batch // world} examples each of "
                              f"{world} processes takes per step")
    return micro


def _log_trigger(phase: Phase, row: dict, done: int, log: MetricsLog, accelerator) -> None:
    log.write({"event": "trigger", "phase": phase.name, "level": phase.level, "step": done,
               "loglog_slope": row["loglog_slope"], "threshold": phase.trigger, "of_steps": phase.steps})
    if accelerator.is_main_process:
        tqdm.write(f"{phase.name}: the trigger fired at step {done} of {phase.steps} (log-log slope "
                   f"{row['loglog_slope']:.4f} after its steepest point, threshold {phase.trigger})", file=sys.stderr)


class Progress:
    """Where a phase stands: the step it starts from, whether its trigger ended it, the (FLOPs,
    validation loss) points its growth trigger has seen, its last good checkpoint; restored from,
    and written to, its checkpoint."""

    def __init__(self, ckpt: Path) -> None:
        self.ckpt, self.start, self.ended, self.curve = ckpt, 0, False, []
        self.last_good = "none (no checkpoint of this phase yet)"

    def restore(self, model, optimizer, scheduler, run_state: RunState) -> None:
        state = run_state.restore(self.ckpt)
        model.load_state_dict(load_model(self.ckpt / "model").state_dict())
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict({"lr_lambdas": [None] * len(optimizer.param_groups), **state["scheduler"]})
        self.start, self.ended = state["step"], bool(state.get("ended", False))
        self.curve = [list(p) for p in state.get("curve", [])]
        self.last_good = f"{self.ckpt} (step {self.start})"

    def finished(self, phase: Phase) -> bool:
        """The restored checkpoint is at the phase's last step, or where its trigger ended it."""
        return self.start >= phase.steps or self.ended

    def trigger(self, phase: Phase, ledger: Ledger, row: dict, done: int) -> bool:
        """After an evaluation: the slope goes into ``row``; whether the trigger has fired before the end."""
        if phase.trigger is None:
            return False
        self.curve.append([ledger.flops, row["val_loss"]])
        row["loglog_slope"], fired = trigger_check(self.curve, phase.trigger)
        return fired and done < phase.steps

    def checkpoint(self, raw, optimizer, scheduler, sharded, done: int, run_state: RunState, accelerator,
                   ended: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Write the checkpoint; returns the whole model and optimizer. Under FSDP every rank
        gathers them (a collective) into an unsharded copy: what is checkpointed, and what the
        phase hands to the next transition."""
        accelerator.wait_for_everyone()
        whole, whole_opt = sharded.gather(raw, optimizer) if sharded else (raw, optimizer)
        bad = nonfinite_parameters(whole)
        if bad:  # a finite loss can come from weights an update has just broken: never checkpoint them
            raise TrainingDiverged(f"parameters {bad[:3]}{' ...' if len(bad) > 3 else ''} are not finite in phase "
                                   f"{self.ckpt.name} after step {done}; stopping. The last good checkpoint is "
                                   f"{self.last_good}")
        if accelerator.is_main_process:
            save_checkpoint(self.ckpt, whole, whole_opt, scheduler, done, run_state, self.curve, ended=ended)
            self.last_good = f"{self.ckpt} (step {done})"
        accelerator.wait_for_everyone()
        return whole, whole_opt


class Sharded:
    """A phase trained with ``train.fsdp`` on several processes: FSDP2 (``torch.distributed.fsdp.
    fully_shard``) with each of the family's blocks (its ``layers``) a shard unit and the root
    holding the rest, so every process keeps 1/N of each parameter and of its Adam moments.

    The model and optimizer go in and come out unsharded: the operators, checkpoints and transitions
    between phases never see a shard. A carried or resumed optimizer's state is moved over by
    parameter name (``torch.distributed.checkpoint.state_dict``), and gathered back whole, on every
    process, at each checkpoint and at the phase's end. (accelerate's FSDP plugin does the same
    ``fully_shard`` but only on GPUs; applied here it is one code path, tested on CPU with gloo.)"""

    def __init__(self, model: nn.Module, cfg: RunConfig, lr: float, device) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.cfg, self.lr = model.to(device), cfg, lr
        self.plain = copy.deepcopy(self.model)  # the unsharded module gathered weights go back into
        self.full = StateDictOptions(full_state_dict=True, cpu_offload=False)  # every rank gets everything

    def shard(self, optimizer, scheduler, schedule):
        """Shard the model in place; a new optimizer over the shards with the old one's hyper-parameters
        and state, and a scheduler at the old one's position."""
        from operator import attrgetter

        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        from torch.distributed.fsdp import fully_shard

        from ..families import family_of

        model = self.model
        carried = get_optimizer_state_dict(model, optimizer, options=self.full) if optimizer.state else None
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        for block in attrgetter(family_of(model).layers)(model):
            fully_shard(block)
        fully_shard(model)
        sharded_opt = new_optimizer(model, self.cfg, self.lr)
        for group, saved in zip(sharded_opt.param_groups, groups):
            group.update(saved)
        sharded_sched = torch.optim.lr_scheduler.LambdaLR(sharded_opt, schedule)
        sharded_sched.load_state_dict({"lr_lambdas": [None] * len(groups),
                                       **{k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}})
        for group, saved in zip(sharded_opt.param_groups, groups):  # the LR where the old schedule was
            group.update(saved)
        if carried is not None:
            set_optimizer_state_dict(model, sharded_opt, carried, options=self.full)
        return model, sharded_opt, sharded_sched

    def gather(self, model: nn.Module, optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The whole model and optimizer, unsharded, on every process (a collective: all call it)."""
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_optimizer_state_dict)

        self.plain.load_state_dict(get_model_state_dict(model, options=self.full))
        state = get_optimizer_state_dict(model, optimizer, options=self.full)
        plain_opt = new_optimizer(self.plain, self.cfg, self.lr)
        for group, sharded in zip(plain_opt.param_groups, optimizer.param_groups):  # (initial_lr, the LR now)
            group.update({k: v for k, v in sharded.items() if k != "params"})
        set_optimizer_state_dict(self.plain, plain_opt, state, options=self.full)
        return self.plain, plain_opt


@contextmanager
def no_sync(model, accelerator):
    """Gradients stay local (no all-reduce / reduce-scatter) inside: DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)``."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with accelerator.no_sync(model):
            yield


def accumulate(model, data: Data, idx: np.ndarray, micro: int, data_step: int, cfg: RunConfig, accelerator,
               teacher: nn.Module | None = None, weight: float = 0.0) -> torch.Tensor:
    """Forward and backward this process's examples ``idx`` of one step in micro-batches of
    ``micro``, gradients accumulated (synchronised between processes only on the last); returns
    the step's mean loss, still on the device. Each micro-batch's mean loss is weighted by its
    share of the examples, so for equal-length sequences the sum is the whole batch's mean. With
    a ``teacher`` the loss is the task's distilled loss of ``weight``."""
    from contextlib import nullcontext

    part = (accelerator.process_index, accelerator.num_processes)  # idx = rows rank::world of the step's batch
    batch = make_batch(data, "train", idx, data_step, cfg.seed, part)  # drawn whole: masks do not depend on ``micro``
    if accelerator.device.type == "cuda":  # (a new step for CUDA graphs: the last step's outputs are consumed;
        torch.compiler.cudagraph_mark_step_begin()  # on a CPU the call would only import inductor)
    starts = range(0, len(idx), micro)
    total = torch.zeros((), device=accelerator.device)
    for j, i in enumerate(starts):
        inputs = {k: v[i:i + micro].to(accelerator.device) for k, v in batch.items()}
        with no_sync(model, accelerator) if j < len(starts) - 1 else nullcontext():
            with torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=cfg.train.bf16):
                if teacher is None:
                    loss, _ = compute_loss(model, inputs, data.task)
                else:
                    loss = task_of(data.task).distilled_loss(model, teacher, inputs, weight)
            loss = loss * (min(micro, len(idx) - i) / len(idx))
            accelerator.backward(loss)
        total += loss.detach().float()
    return total
