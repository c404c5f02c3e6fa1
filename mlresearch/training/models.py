"""Models and schemes from a run config."""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from ..families import FAMILIES, Sizes
from .config import ConfigError, RunConfig


def model_sizes(cfg: RunConfig) -> Sizes:
    m = cfg.model
    return Sizes(m.layers, m.heads, m.kv_heads or m.heads, m.hidden, m.ffn or 4 * m.hidden, m.hidden // m.heads)


def data_settings(cfg: RunConfig) -> dict:
    """The run's data section as :func:`~mlresearch.data.datasets.load_data` takes it (the task
    fills in what the model decides, such as an image's size)."""
    from ..tasks import task_of

    return task_of(cfg.task).data_settings(cfg, asdict(cfg.data))


def model_options(cfg: RunConfig, vocab_size: int | None, special: dict | None = None) -> dict:
    """Config/constructor options the data decides (vocabulary, positions, image shape), then the
    config's own ``model.options``."""
    opts = FAMILIES[cfg.model.family].data_options(vocab_size, cfg.data.seq_len, special or {})
    opts.update(cfg.model.options)
    return opts


def check_model_fits_data(cfg: RunConfig, data) -> None:
    """The model built for ``data`` can take it: its vocabulary covers the tokenizer's ids and its
    classifier the labels (otherwise training would stop mid-phase with an index error)."""
    opts = model_options(cfg, data.vocab_size or None, data.special)
    vocab = opts.get("vocab_size")
    if data.vocab_size and vocab is not None and vocab < data.vocab_size:
        raise ConfigError(f"model.options.vocab_size {vocab} is smaller than the tokenizer's {data.vocab_size} tokens")
    classes = opts.get("num_classes")
    labels = [y for y in (data.train_labels, data.val_labels, data.test_labels) if y is not None and len(y)]
    if classes is not None and labels:
        needed = max(int(y.max()) for y in labels) + 1
        if classes < needed:
            raise ConfigError(f"model.options.num_classes {classes} is smaller than the data's {needed} classes")
    try:  # a bad option value fails here, before the run directory exists, not at the first phase
        build_model(cfg, data.vocab_size or None, data.special, device="meta")
    except Exception as exc:  # noqa: BLE001 -- HF and timm raise many types for a bad option value
        raise ConfigError(f"model section {cfg.model.family} cannot be built: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())} "
                          f"(model.options {cfg.model.options})") from None


def build_model(cfg: RunConfig, vocab_size: int | None = 8192, special: dict | None = None,
                device: str | torch.device | None = None, sizes: Sizes | None = None) -> nn.Module:
    """A randomly initialised model of the config's size (or of ``sizes``, a method's smaller model)."""
    family = FAMILIES[cfg.model.family]
    sizes = sizes or model_sizes(cfg)
    if device is not None:
        with torch.device(device):
            return family.new(sizes, **model_options(cfg, vocab_size, special))
    return family.new(sizes, **model_options(cfg, vocab_size, special))


def parameter_counts(cfg: RunConfig, vocab_size: int | None = None) -> dict[str, int]:
    """The full model's parameters, all and non-embedding (token and position embeddings left out,
    as scaling laws count them; a head tied to the embedding is counted once), built on the meta
    device (nothing allocated). ``vocab_size``: the data's, else the config's."""
    model = build_model(cfg, vocab_size or cfg.data.vocab_size or None, device="meta")
    params = {id(p): p.numel() for p in model.parameters()}
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return {"parameters": sum(params.values()),
            "non_embedding_parameters": sum(n for i, n in params.items() if i not in embedding)}
