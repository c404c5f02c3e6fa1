"""How a phase's steps run, chosen per model shape (``train.speed: auto``).

A growth method saves FLOPs by training small models, but a small model runs far below the machine's
FLOP rate, so its wall-time saving trails its FLOPs saving. What runs a shape fastest differs by
shape and by machine (on the same 2-core CPU, ``torch.compile`` made GPT-2's 1L/64d shape 1.5x
faster in one probe and no faster in another; docs/speed.md). So the choice is made per shape, by
measurement: each candidate :class:`Execution` (eager or compiled, AdamW's multi-tensor or fused
kernel, on a CPU all the process's threads or one, for a masked LM its output layer at every
position or at the masked ones only, for a model whose GELU transformers composes in python that
composition or PyTorch's own kernel for it) trains a copy of the phase's model for a few
steps on the run's own batches, and the fastest per step is used. The trial touches nothing of
the run (its model, optimizer, data position and random generators are as before) and is cached by
shape, batch, device, threads and library versions in ``<data cache>/speed.json`` (JSON), so a
machine measures a shape once. Its time is not charged to the ledger (like evaluation); the choice
and the trial's timings are in ``metrics.jsonl`` (an ``execution`` event) and the run's record.

The default, ``train.speed: eager``, is what every committed result was trained with; a choice
trains the same model within fp32 tolerance (``tests/test_training.py``), and checkpoints are the
plain model's and optimizer's, so a run resumes under either setting.
"""

from __future__ import annotations

import json
import platform
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import torch
from torch import nn

from ..checkpoint import atomic_write_text
from ..data.datasets import Data
from ..data.text import cache_dir
from ..families import FAMILIES, family_of
from .config import RunConfig
from .phase import Phase


@dataclass(frozen=True)
class Execution:
    """``compile``: the model runs under ``torch.compile`` (inductor's default mode); ``graphs``:
    compiled in inductor's "reduce-overhead" mode, which replays each step's kernels as one CUDA
    graph (a small shape on a GPU is bound by kernel launches, not arithmetic; on a CPU the mode
    compiles as the default one); ``fused``:
    AdamW's fused kernel instead of its multi-tensor (foreach) one; ``threads``: the phase runs on
    this many intra-op threads instead of the process's (``None``). A tiny shape's matrix products
    may be too small to split across many cores (on this project's 2-core CPU one thread was slower
    for every shape: docs/speed.md). ``masked_head``: a masked LM's output layer (and its softmax)
    only at the masked positions, the only ones its loss reads (:class:`OutputAtMaskedPositions`; the
    ledger still charges the head at every position, as the paper's count does); eager only, as the
    number of masked positions changes every step. ``native_gelu``: GELU's tanh form, which
    transformers composes in python for GPT-2 (``gelu_new``: about eight elementwise passes forward
    and more backward), as PyTorch's one kernel (transformers' ``GELUTanh``, the same function within
    fp32 rounding; :func:`use_native_gelu`); eager only, as compilation fuses the composition itself."""

    compile: bool = False
    fused: bool = False
    threads: int | None = None
    graphs: bool = False
    masked_head: bool = False
    native_gelu: bool = False

    @property
    def name(self) -> str:
        threads = "" if self.threads is None else f"+{self.threads}thread" + ("s" if self.threads > 1 else "")
        return (("compiled" if self.compile else "eager") + ("+graphs" if self.graphs else "")
                + ("+fused" if self.fused else "") + ("+maskedhead" if self.masked_head else "")
                + ("+nativegelu" if self.native_gelu else "") + threads)

    @property
    def compile_options(self) -> dict | None:
        """``torch.compile``'s keyword arguments for this execution; None: not compiled."""
        return ({"mode": "reduce-overhead"} if self.graphs else {}) if self.compile else None

    @classmethod
    def parse(cls, name: str) -> "Execution":
        """The execution ``name`` names: eager or compiled (compiled maybe "+graphs"), then maybe
        "+fused", then (eager) maybe "+maskedhead", then (eager) maybe "+nativegelu", then maybe
        "+1thread" ("+Nthreads"), e.g. "compiled+graphs+fused" or "eager+fused+nativegelu"."""
        match = re.fullmatch(r"(eager|compiled)(\+graphs)?(\+fused)?(\+maskedhead)?(\+nativegelu)?(?:\+(\d+)threads?)?",
                             name)
        execution = match and cls(compile=match[1] == "compiled", fused=bool(match[3]),
                                  threads=int(match[6]) if match[6] else None, graphs=bool(match[2]),
                                  masked_head=bool(match[4]), native_gelu=bool(match[5]))
        if (not execution or execution.name != name or execution.threads == 0
                or (execution.graphs and not execution.compile)
                or ((execution.masked_head or execution.native_gelu) and execution.compile)):
            raise ValueError(f"an execution is eager or compiled (compiled+graphs: CUDA graphs), then +fused or "
                             f"not, then (eager) +maskedhead or not, then (eager) +nativegelu or not, then +1thread "
                             f"(+Nthreads) or not; got {name!r}")
        return execution

    def set_kernel(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` (new, carried or restored) at this execution's AdamW kernel."""
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = (True, False) if self.fused else (None, None)
            if self.fused:  # the fused kernel keeps its step counts on the parameters' device
                for p in group["params"]:
                    state = optimizer.state.get(p)
                    if state and torch.is_tensor(state.get("step")):
                        state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


EAGER = Execution()


def candidates(phase: Phase, cfg: RunConfig, device: torch.device, processes: int = 1,
               model: nn.Module | None = None) -> list[Execution]:
    """What a phase may run as. Not compiled: a phase whose masks ramp (MSG: the mask's value would
    recompile every step) or that distils from a teacher, and one sharded with FSDP. On one thread
    as well as the process's: a phase on a CPU whose process has more than one. With CUDA graphs
    as well as without: a compiled phase on a GPU. With the output layer at the masked positions
    only as well as at every one: an eager phase of a family that splits off its head, on one
    process (DDP and FSDP wrap the whole model's forward, which the split would bypass), with no
    teacher (whose loss reads the logits at every predicted position). With PyTorch's GELU kernel as
    well as transformers' composition: an eager phase of a ``model`` that has such a composition."""
    compilable = phase.masks is None and phase.teacher is None and not cfg.train.fsdp
    fewer = device.type == "cpu" and torch.get_num_threads() > 1
    compiled = ([Execution(True), Execution(True, graphs=True)] if device.type == "cuda" else [Execution(True)]
                ) if compilable else []
    eager = [Execution()]
    if splits_head(cfg) and processes == 1 and phase.teacher is None and not cfg.train.fsdp:
        eager.append(Execution(masked_head=True))
    if model is not None and composed_gelus(model):
        eager += [replace(e, native_gelu=True) for e in eager]
    return [replace(e, fused=f, threads=n) for n in ((None, 1) if fewer else (None,))
            for e in [*eager, *compiled] for f in (False, True)]


def splits_head(cfg: RunConfig) -> bool:
    """Whether the run's model family can run its output layer at the masked positions only."""
    return bool(FAMILIES[cfg.model.family].output_head)


class OutputAtMaskedPositions(nn.Module):
    """``model`` (a masked LM) called as the task calls it, ``(input_ids=..., labels=...)``, with its
    output head applied to the masked positions' hidden states only (labels other than -100): the
    same mean cross-entropy, in fp32 as transformers computes it, without the logits and softmax of
    the positions the loss ignores (at 40% masking and a 1,024-word vocabulary, most of a width-64
    model's step). Shares ``model``'s parameters and hooks (MSG's masks); holds no state of its own."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        family = family_of(model)
        self.encoder = model.get_submodule(family.encoder)
        self.head = model.get_submodule(family.output_head)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        hidden = self.encoder(input_ids=input_ids)[0]
        chosen = labels != -100
        logits = self.head(hidden[chosen])
        return SimpleNamespace(loss=nn.functional.cross_entropy(logits.float(), labels[chosen]))


def composed_gelus(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every composed GELU in ``model`` (GPT-2's ``gelu_new``, one per
    block): transformers' python compositions of GELU's tanh form, 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))),
    the function its ``GELUTanh`` computes with PyTorch's kernel (its docstring: "equivalent ... but much
    faster")."""
    from transformers import activations  # (here: importing the engine, or a notebook, does not import transformers)

    composed = (activations.NewGELUActivation, activations.FastGELUActivation, activations.AccurateGELUActivation)
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, composed)]


def use_native_gelu(model: nn.Module) -> None:
    """Put transformers' ``GELUTanh`` (``F.gelu(approximate="tanh")``) in place of every composed GELU
    of ``model``. The modules hold no parameters or buffers, so its state dict, checkpoints and saved
    config are the same; :func:`activations_restored` puts the composition back."""
    from transformers.activations import GELUTanh

    for parent, name, _ in composed_gelus(model):
        setattr(parent, name, GELUTanh())


@contextmanager
def activations_restored(model: nn.Module):
    """``model``'s composed GELUs are back in place after the block, whatever it swapped: an execution
    holds for one phase, and the next phase's may be plain eager."""
    sites = composed_gelus(model)
    try:
        yield
    finally:
        for parent, name, module in sites:
            setattr(parent, name, module)


@contextmanager
def intra_op_threads(threads: int | None):
    """Run the block on ``threads`` intra-op threads (``None``: as many as now); the count is back after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def trial_key(model: nn.Module, cfg: RunConfig, data: Data, device, micro: int, world: int) -> str:
    """What a step's time depends on: the model (its class and parameter shapes), the batch, the
    precision, the device and its threads, and the library versions."""
    shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    t = cfg.train
    return "|".join(str(x) for x in (type(model).__name__, shapes, cfg.task, data.task, t.batch_size, micro,
                                     cfg.data.seq_len, t.bf16, t.grad_checkpointing, name, torch.get_num_threads(),
                                     world, torch.__version__))


def _cache_path():
    return cache_dir() / "speed.json"


def _read_cache() -> dict:
    path = _cache_path()
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):  # a damaged cache is measured again, never trusted
        return {}


def choose(options: list[Execution], key: str, measure, accelerator) -> tuple[Execution, dict]:
    """The fastest of ``options`` for the shape ``key`` names, and the trial (seconds per step of each,
    whether it came from the cache). ``measure(execution)``: seconds per step of a trial (the engine's,
    on a copy of the phase's model). Measured once per shape and machine; on several processes the
    main one's measurement is every process's choice."""
    from accelerate.utils import broadcast_object_list

    entry = _read_cache().get(key)
    cached = entry is not None and all(o.name in entry["seconds_per_step"] for o in options)
    if not cached:
        entry = {"seconds_per_step": {o.name: measure(o) for o in options}}
    if accelerator.num_processes > 1:
        entry = broadcast_object_list([entry])[0]
    best = min(options, key=lambda o: entry["seconds_per_step"][o.name])
    if not cached and accelerator.is_main_process:
        table = _read_cache()
        table[key] = {"seconds_per_step": {**table.get(key, {}).get("seconds_per_step", {}),
                                           **entry["seconds_per_step"]}}
        _cache_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(_cache_path(), json.dumps(table, indent=1) + "\n")
    return best, {**asdict(best), "execution": best.name, "cached": cached,
                  "seconds_per_step": {o.name: entry["seconds_per_step"][o.name] for o in options}}
