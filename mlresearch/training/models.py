"""Models and schemes from a run config."""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from ..families import FAMILIES, Sizes
from ..operators import Scheme, make_plan
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
                device: str | torch.device | None = None, level: int = 1, sizes: Sizes | None = None) -> nn.Module:
    """A randomly initialised model of the config's size (``level`` k > 1: the V-cycle's level-k size;
    ``sizes``: that size)."""
    family = FAMILIES[cfg.model.family]
    sizes = sizes or (model_sizes(cfg) if level == 1 else level_sizes(cfg)[level - 1])
    if device is not None:
        with torch.device(device):
            return family.new(sizes, **model_options(cfg, vocab_size, special))
    return family.new(sizes, **model_options(cfg, vocab_size, special))


def scheme_for(cfg: RunConfig, model: nn.Module | None = None, sizes: Sizes | None = None,
               batches: list[dict] | None = None) -> Scheme:
    """The scheme that coalesces a model of this level (the fixed halving patterns adapt to size;
    ``similarity`` measures the model on ``batches``; without a model it stands in for halving,
    which gives the same sizes)."""
    name = cfg.vcycle.scheme
    kw = {"heads": sizes.heads, "layers": sizes.layers} if model is None else {}
    if name == "similarity":
        if model is None:
            return Scheme.halving(**kw)
        from ..analysis.schemes import scheme_from_similarity  # analysis sits above training: no cycle

        return scheme_from_similarity(model, batches or [])
    if name == "halving":
        return Scheme.halving(model, **kw)
    if name == "halving-stack":
        return Scheme.halving(model, depth="stack", **kw)
    if name == "width-only":
        return Scheme.halving(model, depth=None, **kw)
    if name == "depth-only":
        return Scheme.halving(model, width=False, **kw)
    if cfg.vcycle.levels != 2:
        raise ConfigError("a scheme file fits one model size; use it with vcycle.levels: 2")
    return Scheme.from_json(name)


def level_sizes(cfg: RunConfig) -> list[Sizes]:
    """Sizes of the models at levels 1..K (raises if the scheme does not fit a level)."""
    from ..errors import SchemeError

    sizes = [model_sizes(cfg)]
    for level in range(1, cfg.vcycle.levels):
        try:
            scheme = scheme_for(cfg, sizes=sizes[-1])
            sizes.append(make_plan(sizes[-1], scheme, down=True).small)
        except SchemeError as exc:
            raise ConfigError(f"vcycle.scheme does not fit the level-{level} model {sizes[-1]}: {exc}") from exc
    return sizes


def staged_sizes(cfg: RunConfig) -> list[Sizes]:
    """The model's size in each stage of staged training: the config's model shrunk by every growth,
    then grown back one growth at a time (the last entry is the config's size)."""
    st, sizes = cfg.staged, [model_sizes(cfg)]
    for grow in reversed(st.grow):
        s = sizes[0]
        if grow == "width":
            if s.heads % 2 or s.kv_heads % 2 or s.hidden % 2 or s.ffn % 2:
                raise ConfigError(f"staged width growth needs an even number of heads, KV heads, hidden and FFN "
                                  f"units at every stage; {s} is not")
            sizes.insert(0, s.replace(heads=s.heads // 2, kv_heads=s.kv_heads // 2, hidden=s.hidden // 2,
                                      ffn=s.ffn // 2))
        else:
            if s.layers % 2:
                raise ConfigError(f"staged depth growth needs an even number of layers at every stage; {s} is not")
            sizes.insert(0, s.replace(layers=s.layers // 2))
    return sizes


def staged_schedule(cfg: RunConfig) -> list[tuple[int, int]]:
    """Per stage, (where it enters the full model's LR schedule, how many steps it trains): stage 0
    starts at 0; after a growth the schedule is re-entered at S_r = position / constant_op (B.5)."""
    from .schedules import CONSTANT_OP

    st, out, position = cfg.staged, [], 0
    constants = st.constant_op or [CONSTANT_OP[g] for g in st.grow]
    for steps, c in zip(st.steps, constants):
        out.append((position, steps))
        position = int(round((position + steps) / c))
    out.append((position, cfg.train.steps - position))
    return out


def parameter_counts(cfg: RunConfig, vocab_size: int | None = None) -> dict[str, int]:
    """The full model's parameters, all and non-embedding (token and position embeddings left out,
    as scaling laws count them; a head tied to the embedding is counted once), built on the meta
    device (nothing allocated). ``vocab_size``: the data's, else the config's."""
    model = build_model(cfg, vocab_size or cfg.data.vocab_size or None, device="meta")
    params = {id(p): p.numel() for p in model.parameters()}
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return {"parameters": sum(params.values()),
            "non_embedding_parameters": sum(n for i, n in params.items() if i not in embedding)}
