"""Run configs: YAML files validated into dataclasses, with errors that name the bad key.

A config has ``experiment``, ``seed``, ``task``, ``model``, ``data``, ``train`` (the baseline's
budget and optimiser) and, for the V-cycle, ``vcycle``. See ``experiments/configs/*.yaml``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint import parse_yaml, read_structured
from ..errors import MLResearchError
from ..families import FAMILIES
from ..tasks import TASKS as _TASKS

TASKS = tuple(_TASKS)


class ConfigError(MLResearchError, ValueError):
    """A config key is unknown, missing or has an impossible value."""


@dataclass
class ModelConfig:
    family: str
    layers: int
    heads: int
    hidden: int
    ffn: int | None = None
    kv_heads: int | None = None
    options: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    corpus: Any = field(default_factory=lambda: ["bible", "bbc"])
    path: str | None = None
    text_field: str = "text"
    tokenizer: str = "train"  # "train" (our own BPE/WordPiece) or "gpt2" (GPT-2's vocabulary)
    vocab_size: int = 8192
    seq_len: int = 128
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    tune_fraction: float = 0.0  # documents held out for a method's own choices (searched alpha), not the target's
    max_documents: int | None = None  # use only the first N documents (smoke tests)
    img_size: int | None = None  # image side for image folders (default: the model's img_size)
    prepared_dir: str | None = None  # text: where `mlresearch data prepare` wrote the token files (default: cache)
    num_proc: int = 1  # text: tokenizing processes when a run prepares its data itself
    mask_prob: float = 0.15  # masked LM: the fraction of tokens chosen for prediction (BERT's 0.15)
    examples: int | None = None  # a generated corpus (glyphs): how many images it makes (default 50,000)


@dataclass
class TrainConfig:
    steps: int
    batch_size: int
    lr: float
    warmup: int = 0
    schedule: str = "linear"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: tuple = (0.9, 0.98)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    bf16: bool = False
    grad_checkpointing: bool = False
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 100
    keep_snapshots: bool = False  # also keep the model at every checkpoint (for similarity over training)
    threads: int | None = None
    micro_batch_size: int | None = None  # per process and forward pass (gradient accumulation); default: all of it
    compile: Any = False  # torch.compile the model: true (inductor) or a backend name
    peak_tflops: float | None = None  # per device, for the MFU column (default: known GPUs' dense bf16 peak)
    fsdp: bool = False  # shard model and optimizer across processes (accelerate's FSDP2); 1 process: no effect


@dataclass
class VCycleConfig:
    levels: int = 2
    scheme: str = "halving"  # halving | halving-stack | width-only | depth-only | similarity | a scheme JSON
    alpha: Any = 0.25  # a number in [0, 1], "adaptive" / "adaptive-row", or "search" (over alpha_grid)
    alpha_grid: list = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # alpha: search tries these
    search_batches: int = 4  # alpha: search scores each alpha on this many batches of the tuning split
    optimizer: str = "reset"  # reset (the paper) | carry (moments mapped by the growth operators)
    down_steps: list = field(default_factory=list)  # E_a for levels 1..K-1
    small_steps: int = 0  # the smallest model's steps
    up_steps: list = field(default_factory=list)  # continued steps for levels K-1..1 (last = level 1)
    lr: list | None = None  # peak LR per level 1..K (default: train.lr at every level)
    down_warmup: list | None = None  # warm-up steps of each E_a phase (default: the whole phase)
    small_warmup: int = 0
    small_schedule: str | None = None  # the small phase's LR shape (linear | cosine | constant); default train.schedule
    up_warmup: list | None = None
    tag: str = ""  # names a budget/LR variant: the run directory gets "-<tag>" (tuning runs)
    up_path: str = "copy"  # copy: depth de-coalescing copies layers (the paper); identity: new layers start as identity
    tie_break: float = 0.0  # noise (x each tensor's std) added to the de-coalesced model, to break duplicate units
    # A saved model ("{seed}" is the run's seed) merged with at level 1 instead of M1 after E_a: what the public
    # example script does (it merges with the fully trained baseline), to measure that leak; never the method.
    partner: str = ""


@dataclass
class StackConfig:
    """G_stack (Du et al. 2024): the config's model with 1/factor of its layers, trained for ``steps``
    on the full schedule, its whole stack copied ``factor`` times, then a fresh optimizer re-entering
    the schedule at that step through ``rewarmup`` steps, to ``train.steps``."""

    factor: int = 2
    steps: int = 0
    rewarmup: int = 0
    tag: str = ""


@dataclass
class StagedConfig:
    """Staged training (Shen et al. 2022): start from the config's model shrunk by the growths, train
    each stage for its ``steps``, grow x2 (``width`` or ``depth``, Adam state carried), and re-enter
    the full model's LR schedule at S_r = position / constant_op with a ``rewarmup``; the last stage
    runs to ``train.steps`` of that schedule."""

    grow: list = field(default_factory=lambda: ["width"])  # growths in order: width | depth
    steps: list = field(default_factory=list)  # steps of each stage before its growth
    rewarmup: int = 0  # W_r
    constant_op: list | None = None  # S_small / S_large at equal loss per growth (default: the paper's)
    depth_where: str = "alternate"  # new blocks: alternate (2i+1) or append
    trigger: bool = False  # grow when the loss curve says so (B.6); each stage's steps are then its most
    thresholds: list | None = None  # the trigger's slope threshold per growth (default: the paper's)
    tag: str = ""


@dataclass
class RunConfig:
    experiment: str
    task: str
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    seed: int = 0
    vcycle: VCycleConfig | None = None
    staged: StagedConfig | None = None
    stack: StackConfig | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "vcycle": VCycleConfig,
            "staged": StagedConfig, "stack": StackConfig}
METHOD_SECTIONS = ("vcycle", "staged", "stack")  # sections only some methods read


def flatten_config(d: dict | None, prefix: str = ""):
    """``(dotted key, value)`` for every leaf of a config mapping (tuples as lists, as YAML stores them)."""
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            yield from flatten_config(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", list(v) if isinstance(v, tuple) else v


def default_value(dotted: str) -> Any:
    """The default of a ``section.key`` setting (``dataclasses.MISSING`` for required ones)."""
    section, _, key = dotted.partition(".")
    for f in dataclasses.fields(SECTIONS.get(section, RunConfig) if key else RunConfig):
        if f.name == (key or section):
            return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dataclasses.MISSING


def _check_keys(data: Any, cls, where: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; allowed: {sorted(names)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        raise ConfigError(f"missing key(s) {missing} in {where}")


def _build(cls, data: Any, where: str):
    _check_keys(data, cls, where)
    return cls(**data)


def _integer(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value


def _positive(value, name: str, zero_ok: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} integer, got {value!r}")


def _number(value, name: str, low: float, high: float = float("inf"), low_open: bool = False,
            high_open: bool = False) -> None:
    """A real number in the interval from ``low`` to ``high`` (open where said)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == float('inf') else ']'}"
        raise ConfigError(f"{name} must be a number in {interval}, got {value!r}")


def _flag(value, name: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")


def parse_config(raw: dict, source: str = "config") -> RunConfig:
    _check_keys(raw, RunConfig, f"the top level of {source}")
    cfg = RunConfig(
        experiment=raw["experiment"] if isinstance(raw["experiment"], str) else str(raw["experiment"]),
        task=raw["task"],
        model=_build(ModelConfig, raw["model"], "model"),
        data=_build(DataConfig, raw["data"], "data"),
        train=_build(TrainConfig, raw["train"], "train"),
        seed=_integer(raw.get("seed", 0), "seed"),
        vcycle=_build(VCycleConfig, raw["vcycle"], "vcycle") if raw.get("vcycle") is not None else None,
        staged=_build(StagedConfig, raw["staged"], "staged") if raw.get("staged") is not None else None,
        stack=_build(StackConfig, raw["stack"], "stack") if raw.get("stack") is not None else None,
    )
    validate(cfg)
    return cfg


def _compile_backends() -> set[str]:
    import torch

    return set(torch.compiler.list_backends(exclude_tags=()))


def validate(cfg: RunConfig) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*", cfg.experiment):
        raise ConfigError(f"experiment names a directory: letters, digits and _ . + - only, not starting with '.', "
                          f"got {cfg.experiment!r}")
    if cfg.seed < 0:
        raise ConfigError(f"seed must be a non-negative integer (it seeds numpy and torch), got {cfg.seed}")
    if cfg.task not in TASKS:
        raise ConfigError(f"task must be one of {sorted(TASKS)}, got {cfg.task!r}")
    family = FAMILIES.get(cfg.model.family)  # (an unknown family is named by validate_model)
    if family is not None and family.task != cfg.task:
        fits = sorted(name for name, f in FAMILIES.items() if f.task == cfg.task)
        raise ConfigError(f"task {cfg.task} trains {fits} models, not {cfg.model.family}")
    validate_model(cfg.model)
    _validate_data(cfg)
    t = cfg.train
    _positive(t.steps, "train.steps")
    _positive(t.batch_size, "train.batch_size")
    _positive(t.warmup, "train.warmup", zero_ok=True)
    for name in ("eval_every", "eval_batches", "log_every", "checkpoint_every"):
        _positive(getattr(t, name), f"train.{name}")
    if t.threads is not None:
        _positive(t.threads, "train.threads")
    if t.micro_batch_size is not None:
        _positive(t.micro_batch_size, "train.micro_batch_size")
        if t.batch_size % t.micro_batch_size:
            raise ConfigError(f"train.micro_batch_size {t.micro_batch_size} does not divide train.batch_size "
                              f"{t.batch_size} (the global batch is accumulated from whole micro-batches)")
    if not (isinstance(t.compile, bool) or (isinstance(t.compile, str) and t.compile)):
        raise ConfigError(f"train.compile must be true, false or a torch.compile backend name, got {t.compile!r}")
    if isinstance(t.compile, str) and t.compile not in _compile_backends():
        raise ConfigError(f"train.compile: torch.compile has no backend {t.compile!r}; it has "
                          f"{sorted(_compile_backends())} (or true for the default)")
    if t.peak_tflops is not None:
        _number(t.peak_tflops, "train.peak_tflops", 0, low_open=True)
    if t.grad_clip is not None:
        _number(t.grad_clip, "train.grad_clip (null or 0 turns clipping off)", 0)
    _number(t.weight_decay, "train.weight_decay", 0)
    _number(t.min_lr_ratio, "train.min_lr_ratio", 0, 1)
    _number(t.eps, "train.eps", 0, low_open=True)
    if not isinstance(t.betas, (list, tuple)) or len(t.betas) != 2:
        raise ConfigError(f"train.betas must be two numbers, got {t.betas!r}")
    for i, b in enumerate(t.betas):
        _number(b, f"train.betas[{i}]", 0, 1, high_open=True)
    for name in ("bf16", "grad_checkpointing", "keep_snapshots", "fsdp"):
        _flag(getattr(t, name), f"train.{name}")
    if t.warmup > t.steps:
        raise ConfigError(f"train.warmup {t.warmup} exceeds train.steps {t.steps}")
    if t.schedule not in ("linear", "cosine", "constant"):
        raise ConfigError(f"train.schedule must be linear, cosine or constant, got {t.schedule!r}")
    _number(t.lr, "train.lr", 0, low_open=True)
    if cfg.vcycle is not None:
        _validate_vcycle(cfg)
    if cfg.staged is not None:
        _validate_staged(cfg)
    if cfg.stack is not None:
        st = cfg.stack
        _positive(st.factor, "stack.factor")
        _positive(st.steps, "stack.steps")
        _positive(st.rewarmup, "stack.rewarmup", zero_ok=True)
        if st.factor < 2:
            raise ConfigError(f"stack.factor must be >= 2, got {st.factor}")
        if not isinstance(st.tag, str) or (st.tag and not re.fullmatch(r"[A-Za-z0-9_.+-]+", st.tag)):
            raise ConfigError(f"stack.tag names a run directory: letters, digits and _ . + - only, got {st.tag!r}")


def validate_model(m: ModelConfig) -> None:
    """The model section alone (``mlresearch new`` checks its flags with it too)."""
    if m.family not in FAMILIES:
        raise ConfigError(f"model.family must be one of {sorted(FAMILIES)}, got {m.family!r}")
    for name in ("layers", "heads", "hidden"):
        _positive(getattr(m, name), f"model.{name}")
    if m.hidden % m.heads:
        raise ConfigError(f"model.hidden {m.hidden} is not divisible by model.heads {m.heads}")
    for name in ("ffn", "kv_heads"):
        if getattr(m, name) is not None:
            _positive(getattr(m, name), f"model.{name}")
    if m.kv_heads and m.heads % m.kv_heads:
        raise ConfigError(f"model.heads {m.heads} is not divisible by model.kv_heads {m.kv_heads}")
    if not isinstance(m.options, dict):
        raise ConfigError(f"model.options must be a mapping, got {m.options!r}")
    problem = FAMILIES[m.family].option_problem(m.options)
    if problem:
        raise ConfigError(f"model.options for {m.family}: {problem}")


def _validate_data(cfg: RunConfig) -> None:
    d = cfg.data
    _positive(d.seq_len, "data.seq_len")
    _positive(d.vocab_size, "data.vocab_size")
    if d.tokenizer not in ("train", "gpt2"):
        raise ConfigError(f"data.tokenizer must be 'train' or 'gpt2', got {d.tokenizer!r}")
    _number(d.val_fraction, "data.val_fraction", 0, 1, low_open=True, high_open=True)
    _number(d.test_fraction, "data.test_fraction", 0, 1, high_open=True)
    _number(d.tune_fraction, "data.tune_fraction", 0, 1, high_open=True)
    if d.val_fraction + d.test_fraction + d.tune_fraction >= 1:
        raise ConfigError(f"data.val_fraction + data.test_fraction + data.tune_fraction must leave documents to train "
                          f"on, got {d.val_fraction} + {d.test_fraction} + {d.tune_fraction}")
    _positive(d.num_proc, "data.num_proc")
    _number(d.mask_prob, "data.mask_prob", 0, 1, low_open=True, high_open=True)
    if d.prepared_dir is not None and not isinstance(d.prepared_dir, str):
        raise ConfigError(f"data.prepared_dir must be a path, got {d.prepared_dir!r}")
    for name in ("max_documents", "img_size", "examples"):
        if getattr(d, name) is not None:
            _positive(getattr(d, name), f"data.{name}")
    if _TASKS[cfg.task].sequences:
        if not isinstance(d.corpus, list) or not d.corpus or not all(isinstance(c, str) for c in d.corpus):
            raise ConfigError(f"data.corpus must be a list of corpus names, e.g. [bible, bbc] (or --set "
                              f"'data.corpus=[bible]'), got {d.corpus!r}")
        for key in ("n_positions", "max_position_embeddings"):  # the position table must cover a sequence
            n = cfg.model.options.get(key)
            if n is not None and (not isinstance(n, int) or n < d.seq_len):
                raise ConfigError(f"model.options.{key} {n!r} is smaller than data.seq_len {d.seq_len}")
        vocab = cfg.model.options.get("vocab_size")
        planned = 50257 if d.tokenizer == "gpt2" else d.vocab_size
        if vocab is not None and (not isinstance(vocab, int) or vocab < planned):
            raise ConfigError(f"model.options.vocab_size {vocab!r} is smaller than the tokenizer's {planned} tokens")


def _validate_staged(cfg: RunConfig) -> None:
    st = cfg.staged
    if not isinstance(st.grow, list) or not st.grow or any(g not in ("width", "depth") for g in st.grow):
        raise ConfigError(f"staged.grow must be a non-empty list of 'width' / 'depth', got {st.grow!r}")
    if not isinstance(st.steps, list) or len(st.steps) != len(st.grow):
        raise ConfigError(f"staged.steps needs one entry per growth ({len(st.grow)}), got {st.steps!r}")
    for i, s in enumerate(st.steps):
        _positive(s, f"staged.steps[{i}]")
    _positive(st.rewarmup, "staged.rewarmup", zero_ok=True)
    if st.constant_op is not None:
        if not isinstance(st.constant_op, list) or len(st.constant_op) != len(st.grow):
            raise ConfigError(f"staged.constant_op needs one entry per growth, got {st.constant_op!r}")
        for i, c in enumerate(st.constant_op):
            _number(c, f"staged.constant_op[{i}]", 0, low_open=True)
    _flag(st.trigger, "staged.trigger")
    if st.thresholds is not None:
        if not isinstance(st.thresholds, list) or len(st.thresholds) != len(st.grow):
            raise ConfigError(f"staged.thresholds needs one slope per growth ({len(st.grow)}), got {st.thresholds!r}")
        for i, t in enumerate(st.thresholds):
            _number(t, f"staged.thresholds[{i}]", float("-inf"), 0, high_open=True)
    if st.depth_where not in ("alternate", "append"):
        raise ConfigError(f"staged.depth_where must be 'alternate' or 'append', got {st.depth_where!r}")
    if not isinstance(st.tag, str) or (st.tag and not re.fullmatch(r"[A-Za-z0-9_.+-]+", st.tag)):
        raise ConfigError(f"staged.tag names a run directory: letters, digits and _ . + - only, got {st.tag!r}")
    # The shapes (they must halve) and the budget are checked when the staged plan is built: they
    # involve the model and train sections, which a run of another method may change freely.


def _validate_vcycle(cfg: RunConfig) -> None:
    v = cfg.vcycle
    if isinstance(v.levels, bool) or v.levels not in (2, 3, 4):
        raise ConfigError(f"vcycle.levels must be 2, 3 or 4, got {v.levels}")
    k = v.levels - 1
    for name in ("down_steps", "up_steps"):
        seq = getattr(v, name)
        if not isinstance(seq, list) or len(seq) != k:
            raise ConfigError(f"vcycle.{name} needs one entry per level above the smallest ({k}), got {seq!r}")
        for i, s in enumerate(seq):
            _positive(s, f"vcycle.{name}[{i}]", zero_ok=name == "down_steps")
    _positive(v.small_steps, "vcycle.small_steps")
    for name, n in (("lr", v.levels), ("down_warmup", k), ("up_warmup", k)):
        seq = getattr(v, name)
        if seq is not None and (not isinstance(seq, list) or len(seq) != n):
            raise ConfigError(f"vcycle.{name} needs {n} entries, got {seq!r}")
    for i, lr in enumerate(v.lr or []):
        _number(lr, f"vcycle.lr[{i}]", 0, low_open=True)
    for name in ("down_warmup", "up_warmup"):
        for i, w in enumerate(getattr(v, name) or []):
            _positive(w, f"vcycle.{name}[{i}]", zero_ok=True)
    _positive(v.small_warmup, "vcycle.small_warmup", zero_ok=True)
    if v.small_warmup > v.small_steps:
        raise ConfigError(f"vcycle.small_warmup {v.small_warmup} exceeds vcycle.small_steps {v.small_steps}")
    if not isinstance(v.partner, str):
        raise ConfigError(f"vcycle.partner must be a model directory (or empty), got {v.partner!r}")
    if v.small_schedule not in (None, "linear", "cosine", "constant"):
        raise ConfigError(f"vcycle.small_schedule must be linear, cosine or constant (or unset: train.schedule), "
                          f"got {v.small_schedule!r}")
    if v.down_warmup and any(w > s for w, s in zip(v.down_warmup, v.down_steps)):
        raise ConfigError("vcycle.down_warmup exceeds its phase's down_steps")
    if v.up_warmup and any(w > s for w, s in zip(v.up_warmup, v.up_steps)):
        raise ConfigError("vcycle.up_warmup exceeds its phase's up_steps")
    if not isinstance(v.tag, str) or not isinstance(v.scheme, str):
        raise ConfigError(f"vcycle.tag and vcycle.scheme must be strings, got {v.tag!r} and {v.scheme!r}")
    if v.tag and not re.fullmatch(r"[A-Za-z0-9_.+-]+", v.tag):
        raise ConfigError(f"vcycle.tag names a run directory: letters, digits and _ . + - only, got {v.tag!r}")
    if v.up_path not in ("copy", "identity"):
        raise ConfigError(f"vcycle.up_path must be 'copy' or 'identity', got {v.up_path!r}")
    _number(v.tie_break, "vcycle.tie_break", 0)
    if v.optimizer not in ("reset", "carry"):
        raise ConfigError(f"vcycle.optimizer must be 'reset' or 'carry', got {v.optimizer!r}")
    alpha = v.alpha
    if isinstance(alpha, str):
        if alpha not in ("adaptive", "adaptive-row", "search"):
            raise ConfigError(f"vcycle.alpha must be a number in [0, 1], 'adaptive', 'adaptive-row' or 'search', "
                              f"got {alpha!r}")
        if alpha == "search" and not cfg.data.tune_fraction:
            raise ConfigError("vcycle.alpha: search chooses alpha on a tuning split held out of training and of the "
                              "validation split; set data.tune_fraction > 0 (e.g. 0.02)")
    elif isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
        raise ConfigError(f"vcycle.alpha must lie in [0, 1], got {alpha!r}")
    if not isinstance(v.alpha_grid, list) or not v.alpha_grid:
        raise ConfigError(f"vcycle.alpha_grid must be a non-empty list of numbers in [0, 1], got {v.alpha_grid!r}")
    for i, a in enumerate(v.alpha_grid):
        _number(a, f"vcycle.alpha_grid[{i}]", 0, 1)
    _positive(v.search_batches, "vcycle.search_batches")
    named = ("halving", "halving-stack", "width-only", "depth-only", "similarity")
    if v.scheme not in named and Path(v.scheme).suffix != ".json":
        raise ConfigError(f"vcycle.scheme must be one of {named} or a .json path, got {v.scheme!r}")
    # Whether the scheme fits every level (it involves the model section) and the budget (train.steps)
    # are checked when a plan that reads this section is built (methods.py): a baseline run may
    # change the model or its steps without the V-cycle's settings standing in its way.


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    raw = read_structured(path, "config file", ConfigError, fmt="yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides or []:
        _override(raw, item)
    return parse_config(raw, str(path))


def _override(raw: dict, item: str) -> None:
    """``a.b.c=value`` with a YAML-parsed value."""
    key, sep, value = item.partition("=")
    if not sep:
        raise ConfigError(f"override must look like key.path=value, got {item!r}")
    node = raw
    parts = key.split(".")
    for p in parts[:-1]:
        if node.get(p) is None:
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {p} is not a mapping")
    try:
        node[parts[-1]] = parse_yaml(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({str(exc).splitlines()[0]})") from None
