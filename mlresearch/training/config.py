"""Run configs: YAML files validated into dataclasses, with errors that name the bad key.

A config has ``experiment``, ``seed``, ``task``, ``model``, ``data``, ``train`` (the baseline's
budget and optimiser) and one section per method that has settings of its own, named after the
method (``vcycle``, ``staged``, ``stack``). This module knows none of those: each method's file
defines its settings class and registers it with :func:`method_settings`; ``RunConfig.methods``
holds the sections a config gives, by the method's name. See ``experiments/configs/*.yaml``.
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
from .schedules import SCHEDULE_KINDS

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

    def validate(self) -> None:
        """The model section alone (``mlresearch new`` checks its flags with it too)."""
        m = self
        if m.family not in FAMILIES:
            raise ConfigError(f"model.family must be one of {sorted(FAMILIES)}, got {m.family!r}")
        for name in ("layers", "heads", "hidden"):
            positive(getattr(m, name), f"model.{name}")
        if m.hidden % m.heads:
            raise ConfigError(f"model.hidden {m.hidden} is not divisible by model.heads {m.heads}")
        for name in ("ffn", "kv_heads"):
            if getattr(m, name) is not None:
                positive(getattr(m, name), f"model.{name}")
        if m.kv_heads and m.heads % m.kv_heads:
            raise ConfigError(f"model.heads {m.heads} is not divisible by model.kv_heads {m.kv_heads}")
        if not isinstance(m.options, dict):
            raise ConfigError(f"model.options must be a mapping, got {m.options!r}")
        problem = FAMILIES[m.family].option_problem(m.options)
        if problem:
            raise ConfigError(f"model.options for {m.family}: {problem}")


# train.speed (training/speed.py): one execution for every phase, or "auto", each phase's measured fastest
# (+1thread: the phase on one intra-op thread, for shapes too small to split across cores; +graphs: a GPU
# replays each step as CUDA graphs, for shapes bound by kernel launches; +maskedhead: a masked LM's output layer
# at the masked positions only; +nativegelu: PyTorch's kernel for GELU's tanh form where transformers composes it)
SPEEDS = ("eager", "eager+fused", "compiled", "compiled+fused", "compiled+graphs", "compiled+graphs+fused",
          "eager+1thread", "eager+fused+1thread", "compiled+1thread", "compiled+fused+1thread",
          "eager+maskedhead", "eager+fused+maskedhead", "eager+maskedhead+1thread", "eager+fused+maskedhead+1thread",
          "eager+nativegelu", "eager+fused+nativegelu", "eager+nativegelu+1thread", "eager+fused+nativegelu+1thread",
          "eager+maskedhead+nativegelu", "eager+fused+maskedhead+nativegelu", "eager+maskedhead+nativegelu+1thread",
          "eager+fused+maskedhead+nativegelu+1thread", "auto")


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
    examples: int | None = None  # a generated corpus: how many images it makes (glyphs: 50,000; fractals: 100 a class)
    classes: int | None = None  # fractals: how many classes (iterated function systems; default 100)
    colour: bool = False  # fractals: RGB images of a random hue (default grey)

    def validate(self, cfg: "RunConfig") -> None:
        """Also reads the task (does it train on sequences?) and the model's position and vocabulary options."""
        d = self
        positive(d.seq_len, "data.seq_len")
        positive(d.vocab_size, "data.vocab_size")
        one_of(d.tokenizer, "data.tokenizer", ("train", "gpt2"))
        number(d.val_fraction, "data.val_fraction", 0, 1, low_open=True, high_open=True)
        number(d.test_fraction, "data.test_fraction", 0, 1, high_open=True)
        number(d.tune_fraction, "data.tune_fraction", 0, 1, high_open=True)
        if d.val_fraction + d.test_fraction + d.tune_fraction >= 1:
            raise ConfigError(f"data.val_fraction + data.test_fraction + data.tune_fraction must leave documents to train "
                              f"on, got {d.val_fraction} + {d.test_fraction} + {d.tune_fraction}")
        positive(d.num_proc, "data.num_proc")
        number(d.mask_prob, "data.mask_prob", 0, 1, low_open=True, high_open=True)
        if d.prepared_dir is not None and not isinstance(d.prepared_dir, str):
            raise ConfigError(f"data.prepared_dir must be a path, got {d.prepared_dir!r}")
        if not isinstance(d.colour, bool):
            raise ConfigError(f"data.colour must be true or false, got {d.colour!r}")
        for name in ("max_documents", "img_size", "examples", "classes"):
            if getattr(d, name) is not None:
                positive(getattr(d, name), f"data.{name}")
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
    speed: str = "eager"  # compile? AdamW's fused kernel? "auto": chosen per model shape by a measured trial

    def validate(self) -> None:
        t = self
        positive(t.steps, "train.steps")
        positive(t.batch_size, "train.batch_size")
        positive(t.warmup, "train.warmup", zero_ok=True)
        for name in ("eval_every", "eval_batches", "log_every", "checkpoint_every"):
            positive(getattr(t, name), f"train.{name}")
        if t.threads is not None:
            positive(t.threads, "train.threads")
        if t.micro_batch_size is not None:
            positive(t.micro_batch_size, "train.micro_batch_size")
            if t.batch_size % t.micro_batch_size:
                raise ConfigError(f"train.micro_batch_size {t.micro_batch_size} does not divide train.batch_size "
                                  f"{t.batch_size} (the global batch is accumulated from whole micro-batches)")
        one_of(t.speed, "train.speed", SPEEDS)
        if t.speed != "eager" and t.compile:
            raise ConfigError(f"train.speed: {t.speed} says whether to compile; leave train.compile false with it")
        if not (isinstance(t.compile, bool) or (isinstance(t.compile, str) and t.compile)):
            raise ConfigError(f"train.compile must be true, false or a torch.compile backend name, got {t.compile!r}")
        if isinstance(t.compile, str) and t.compile not in _compile_backends():
            raise ConfigError(f"train.compile: torch.compile has no backend {t.compile!r}; it has "
                              f"{sorted(_compile_backends())} (or true for the default)")
        if t.peak_tflops is not None:
            number(t.peak_tflops, "train.peak_tflops", 0, low_open=True)
        if t.grad_clip is not None:
            number(t.grad_clip, "train.grad_clip (null or 0 turns clipping off)", 0)
        number(t.weight_decay, "train.weight_decay", 0)
        number(t.min_lr_ratio, "train.min_lr_ratio", 0, 1)
        number(t.eps, "train.eps", 0, low_open=True)
        if not isinstance(t.betas, (list, tuple)) or len(t.betas) != 2:
            raise ConfigError(f"train.betas must be two numbers, got {t.betas!r}")
        for i, b in enumerate(t.betas):
            number(b, f"train.betas[{i}]", 0, 1, high_open=True)
        for name in ("bf16", "grad_checkpointing", "keep_snapshots", "fsdp"):
            flag(getattr(t, name), f"train.{name}")
        if t.warmup > t.steps:
            raise ConfigError(f"train.warmup {t.warmup} exceeds train.steps {t.steps}")
        one_of(t.schedule, "train.schedule", SCHEDULE_KINDS)
        number(t.lr, "train.lr", 0, low_open=True)


class MethodSettings:
    """A method's own config section (a dataclass in the method's file, registered with
    :func:`method_settings`): ``validate`` checks it with errors naming the key; ``full_model_lr``
    gives the ``--set`` overrides that move its full-size model's peak LR to ``lr`` (a study's tuned
    baseline LR), where the section sets an LR of its own."""

    def validate(self, cfg: "RunConfig") -> None:
        pass

    def full_model_lr(self, lr: float) -> list[str]:
        return []


SETTINGS: dict[str, type] = {}  # method name -> its settings class (registered by the method's own file)


def method_settings(name: str):
    """Register the decorated :class:`MethodSettings` dataclass as method ``name``'s config section."""
    def register(cls):
        SETTINGS[name] = cls
        return cls
    return register


@dataclass
class RunConfig:
    experiment: str
    task: str
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    seed: int = 0
    methods: dict = field(default_factory=dict)  # method name -> its settings (the sections the config gives)

    def __getattr__(self, name: str) -> Any:
        """``cfg.vcycle``: the settings of a registered method, None when the config has no such section."""
        if name in SETTINGS:
            return self.__dict__.get("methods", {}).get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def to_dict(self) -> dict:
        """The config as its YAML file holds it: one top-level section per registered method (null if absent)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "methods"}
        out = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in out.items()}
        return {**out, **{name: dataclasses.asdict(self.methods[name]) if name in self.methods else None
                          for name in SETTINGS}}


def sections() -> dict[str, type]:
    """Every config section's dataclass: model, data, train and each registered method's settings."""
    return {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, **SETTINGS}


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
    if not key and section in SETTINGS:
        return None
    for f in dataclasses.fields(sections().get(section, RunConfig) if key else RunConfig):
        if f.name == (key or section):
            return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dataclasses.MISSING


def _check_keys(data: Any, cls, where: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    if cls is RunConfig:  # the top level: the fixed sections and one per registered method
        names = (names - {"methods"}) | set(SETTINGS)
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


def integer(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value


def positive(value, name: str, zero_ok: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} integer, got {value!r}")


def number(value, name: str, low: float, high: float = float("inf"), low_open: bool = False,
            high_open: bool = False) -> None:
    """A real number in the interval from ``low`` to ``high`` (open where said)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open or high == float('inf') else ']'}"
        raise ConfigError(f"{name} must be a number in {interval}, got {value!r}")


def tag(value, name: str) -> None:
    """A ``tag`` setting: it names a run directory, so letters, digits and _ . + - only (or empty)."""
    if not isinstance(value, str) or (value and not re.fullmatch(r"[A-Za-z0-9_.+-]+", value)):
        raise ConfigError(f"{name} names a run directory: letters, digits and _ . + - only, got {value!r}")


def one_of(value, name: str, options: tuple, unset: str = "") -> None:
    """``value`` is one of ``options`` (the one list the validator and the code that reads the
    choice share); ``unset``: what leaving it unset (None) means, where it may be left unset."""
    if value is None and unset:
        return
    if isinstance(value, bool) or value not in options:
        listed = ", ".join(repr(o) for o in options[:-1]) + f" or {options[-1]!r}"
        raise ConfigError(f"{name} must be {listed}{f' (or unset: {unset})' if unset else ''}, got {value!r}")


def flag(value, name: str) -> None:
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
        seed=integer(raw.get("seed", 0), "seed"),
        methods={name: _build(cls, raw[name], name) for name, cls in SETTINGS.items() if raw.get(name) is not None},
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
    family = FAMILIES.get(cfg.model.family)  # (an unknown family is named by ModelConfig.validate)
    if family is not None and family.task != cfg.task:
        fits = sorted(name for name, f in FAMILIES.items() if f.task == cfg.task)
        raise ConfigError(f"task {cfg.task} trains {fits} models, not {cfg.model.family}")
    cfg.model.validate()
    cfg.data.validate(cfg)
    cfg.train.validate()
    if "+maskedhead" in cfg.train.speed and family is not None and not family.output_head:
        raise ConfigError(f"train.speed: {cfg.train.speed} runs a masked LM's output layer at the masked positions "
                          f"only; {cfg.model.family} models ({cfg.task}) have no head to run apart")
    for settings in cfg.methods.values():
        settings.validate(cfg)


def preset_path(name: str | Path, near: str | Path | None = None) -> Path:
    """A config given by path, or a preset by name: ``<name>.yaml`` in the nearest ``configs`` folder
    above ``near`` (a study spec in ``experiments/studies/`` -> ``experiments/configs/``), else in
    ``./experiments/configs/``, else in the source checkout's. So presets are found in a clone or a
    copy of ``experiments/`` whether the package is installed editable or not."""
    if str(name).endswith((".yaml", ".yml")) or Path(name).is_file():
        return Path(name)
    from ..results import REPO

    beside = [d / "configs" for d in Path(near).resolve().parents if (d / "configs").is_dir()][:1] if near else []
    bases = beside + [Path("experiments") / "configs", REPO / "experiments" / "configs"]
    for base in bases:
        if (base / f"{name}.yaml").is_file():
            return base / f"{name}.yaml"
    raise ConfigError(f"no preset {name!r}: looked for {name}.yaml in {', '.join(str(b) for b in dict.fromkeys(bases))}; "
                      "give a config file's path")


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
