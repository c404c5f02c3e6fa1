"""What a family is: a declarative table of parameter axes plus a few architecture facts.

A family names, for every parameter, the role of each tensor dimension (see
:mod:`mlresearch.operators.axes`), says where the blocks live (the layer axis), and knows how to
read and change its sizes in a config and build a model from it. All operators (coalesce,
de-coalesce, interpolate, growth, optimizer-state maps) are written once against this interface.

The special role ``"final_norm"`` marks the norm that feeds the output head: it behaves as a
normal hidden output when the head is untied, and as a hidden *input* (split on de-coalescing)
when the head is tied to the input embedding. Splitting the norm instead of scaling the tied
embedding keeps the function exact (the reference code's x0.5 embedding does not).
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, UnsupportedModelError


@dataclass(frozen=True)
class Sizes:
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    ffn: int
    head_dim: int

    def replace(self, **changes: int) -> "Sizes":
        return replace(self, **changes)

    @property
    def key(self) -> str:
        """The shape as tables name it: 2L/128d/4h (and /<ffn>f when not 4 x hidden); the step-time
        table and the small-model controls are keyed by it."""
        return f"{self.layers}L/{self.hidden}d/{self.heads}h" + ("" if self.ffn == 4 * self.hidden else f"/{self.ffn}f")


@dataclass(frozen=True)
class Recipe:
    """How to build a model again: its class and its config (an HF config or a kwargs dict)."""

    cls: type
    config: Any


@dataclass(frozen=True)
class Located:
    layer: int | None  # block index, or None for parameters outside the blocks
    rel: str  # name inside the block (or the full name)
    roles: tuple


def _compile(table: dict[str, tuple]) -> list[tuple[re.Pattern, tuple]]:
    return [(re.compile(pattern), roles) for pattern, roles in table.items()]


class Family:
    """Base class. Subclasses fill in the tables and the config facts."""

    name: str = ""
    layers: str = ""  # dotted path of the nn.ModuleList of blocks
    block_params: dict[str, tuple] = {}  # regex on the name inside a block -> roles per dim
    top_params: dict[str, tuple] = {}  # regex on the full name -> roles per dim
    residual_writers: str = ""  # regex: block params whose output is added to the residual stream
    norm_position: str = "pre"  # "pre": x + f(norm(x)), zero writers make a block the identity
    attention_output: str = ""  # block module whose input is the concatenated per-head attention output
    task: str = ""  # what its models are trained for: causal_lm, masked_lm or image_cls
    mlp_matrices: int = 2  # weight matrices in an MLP (3 for SwiGLU: gate, up, down)
    head_transform: bool = False  # a d x d transform before the output head (BERT's MLM head)
    # Dotted paths of the module that maps inputs to the last hidden states and of the output head that
    # maps them to logits, for a family whose loss reads the logits at a few positions only (masked LM):
    # the execution "+maskedhead" runs the head at those positions alone (training/speed.py). "": no split.
    encoder: str = ""
    output_head: str = ""

    def __init__(self) -> None:
        self._block = _compile(self.block_params)
        self._top = _compile(self.top_params)

    # ---- facts each family supplies -------------------------------------------------
    def matches(self, model: nn.Module) -> bool:
        raise NotImplementedError

    def recipe(self, model: nn.Module) -> Recipe:
        raise NotImplementedError

    def sizes(self, model_or_recipe: nn.Module | Recipe) -> Sizes:
        raise NotImplementedError

    def resize(self, recipe: Recipe, sizes: Sizes) -> Recipe:
        raise NotImplementedError

    def build(self, recipe: Recipe) -> nn.Module:
        raise NotImplementedError

    def head_tied(self, model: nn.Module) -> bool:
        return False

    def new(self, sizes: Sizes, **options: Any) -> nn.Module:
        """A randomly initialised model of ``sizes``; ``options`` go to its config/constructor."""
        raise NotImplementedError

    def option_problem(self, options: dict) -> str | None:
        """Why ``options`` cannot go to :meth:`new` (None when they can)."""
        raise NotImplementedError

    def save(self, model: nn.Module, directory) -> None:
        raise NotImplementedError

    def saved_by(self, config: dict) -> bool:
        """Whether a model directory's ``config.json`` is one :meth:`save` of this family wrote."""
        raise NotImplementedError

    def load(self, directory, config: dict) -> nn.Module:
        """The model :meth:`save` wrote to ``directory`` (its ``config.json`` already read and
        checked: no code shipped with it, readable weights). Weights and config must agree exactly:
        a missing, extra or reshaped tensor is a :class:`CheckpointError`, never a silent repair."""
        raise NotImplementedError

    def random_inputs(self, model: nn.Module, batch: int, seq_len: int, generator: torch.Generator) -> dict:
        """A batch of random inputs ``model`` takes (token ids of its vocabulary)."""
        vocab = model.get_input_embeddings().weight.shape[0]
        return {"input_ids": torch.randint(0, vocab, (batch, seq_len), generator=generator)}

    def data_options(self, vocab_size: int | None, seq_len: int, special: dict) -> dict:
        """Config/constructor options the data decides (vocabulary, positions, special tokens)."""
        raise NotImplementedError

    def forward_with_attention(self, model: nn.Module, inputs: dict) -> tuple[torch.Tensor, list, torch.Tensor]:
        """Run ``model`` once: (output, per-layer attention maps (B, H, T, T), real-token mask (B, T))."""
        raise NotImplementedError

    def attention_kernel(self, model: nn.Module) -> str:
        """How ``model`` computes attention in training: ``"sdpa"`` (PyTorch's fused
        scaled_dot_product_attention, flash/memory-efficient kernels on a GPU) or another name."""
        raise NotImplementedError

    def forward_flops(self, model: nn.Module, seq_len: int | None) -> dict[str, float]:
        """Forward matmul FLOPs of one example by part (see :mod:`mlresearch.training.flops`);
        language models here, image models override. Works on meta-device models."""
        if seq_len is None:
            raise ValueError("language models need seq_len")
        s, t = self.sizes(model), seq_len
        vocab = model.get_output_embeddings().weight.shape[0]
        head = 2 * s.hidden * vocab * t + (2 * s.hidden * s.hidden * t if self.head_transform else 0)
        return {**self._block_flops(s, t), "head": float(head), "patch_embed": 0.0}

    def _block_flops(self, s: Sizes, tokens: int) -> dict[str, float]:
        per_layer_token = 2 * (s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden
                               + self.mlp_matrices * s.hidden * s.ffn)
        return {"linear": float(per_layer_token * s.layers * tokens),
                "attention": float(2 * 2 * tokens * tokens * s.heads * s.head_dim * s.layers)}

    # ---- shared machinery ----------------------------------------------------------
    def _recipe(self, model_or_recipe: nn.Module | Recipe) -> Recipe:
        return model_or_recipe if isinstance(model_or_recipe, Recipe) else self.recipe(model_or_recipe)

    def writes_residual(self, rel: str) -> bool:
        return bool(self.residual_writers) and re.fullmatch(self.residual_writers, rel) is not None

    def layer_name(self, layer: int, rel: str) -> str:
        return f"{self.layers}.{layer}.{rel}"

    def locate(self, name: str, tied: bool) -> Located:
        """Find a parameter's layer and axis roles; unknown names are an error, not a skip."""
        prefix = self.layers + "."
        if name.startswith(prefix):
            index, rel = name[len(prefix):].split(".", 1)
            layer, table = int(index), self._block
        else:
            layer, rel, table = None, name, self._top
        for pattern, roles in table:
            if pattern.fullmatch(rel):
                roles = tuple(("hidden_in" if tied else "hidden") if r == "final_norm" else r for r in roles)
                return Located(layer, rel, roles)
        raise UnsupportedModelError(
            f"family {self.name!r} has no axis rule for parameter {name!r}; "
            "the model uses a feature this family spec does not cover"
        )

    def instantiate(self, recipe: Recipe, state: dict[str, torch.Tensor], like: nn.Module) -> nn.Module:
        """Build the model on the meta device and adopt ``state`` (no random init, no copy).

        Buffers (causal masks, rotary frequencies, position ids) are taken from ``like`` by name,
        or from ``like``'s first block for block buffers when depth changed.
        """
        with torch.device("meta"), self.skip_init():
            model = self.build(recipe)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected:
            raise RuntimeError(f"{self.name}: mapped parameters the new model does not have: {unexpected}")
        self.tie(model)
        source = dict(like.named_buffers())
        for module_name, module in model.named_modules():
            for buffer_name, buffer in list(module._buffers.items()):
                if buffer is None or not buffer.is_meta:
                    continue
                full = f"{module_name}.{buffer_name}" if module_name else buffer_name
                found = source.get(full)
                if found is None and full.startswith(self.layers + "."):
                    found = source.get(self.layer_name(0, full[len(self.layers) + 1:].split(".", 1)[1]))
                if found is None or found.shape != buffer.shape:
                    raise RuntimeError(f"{self.name}: no source for buffer {full} of shape {tuple(buffer.shape)}")
                module._buffers[buffer_name] = found.clone()
        left = [n for n, _ in model.named_parameters() if n not in state]  # (works on the meta device too)
        if left:
            raise RuntimeError(f"{self.name}: parameters left unset after mapping: {left} (missing: {missing})")
        model.train(like.training)
        return model

    def tie(self, model: nn.Module) -> None:
        pass

    def skip_init(self):
        """A context in which building a model skips weight initialisation (it is replaced)."""
        return contextlib.nullcontext()


class HFFamily(Family):
    """A Hugging Face transformers family: sizes live in ``model.config`` under these keys."""

    classes: tuple[str, ...] = ()  # model classes this spec describes; the first is built by new()
    config_class: str = ""
    # Sizes field -> config attribute; the names most HF configs use (a config without one: derived)
    config_keys: dict[str, str] = {"layers": "num_hidden_layers", "heads": "num_attention_heads",
                                   "kv_heads": "num_key_value_heads", "hidden": "hidden_size",
                                   "ffn": "intermediate_size", "head_dim": "head_dim"}
    positions_key: str = "max_position_embeddings"  # config attribute: the longest sequence
    sequence_classifier: str = ""  # the transformers class that fine-tunes its encoder on labels (downstream)
    classifier_fresh: tuple[str, ...] = ()  # name prefixes of its parameters the saved model does not have
    per_layer_keys: tuple[str, ...] = ("layer_types",)  # config lists with one entry per layer
    task = "causal_lm"

    def data_options(self, vocab_size: int | None, seq_len: int, special: dict) -> dict:
        eos = special.get("eos", 0)
        return {"vocab_size": vocab_size, self.positions_key: seq_len, "bos_token_id": eos, "eos_token_id": eos}

    def forward_with_attention(self, model: nn.Module, inputs: dict):
        """HF models return attention maps with ``output_attentions=True`` under eager attention
        (set for the call, then restored); padded keys get zero probability."""
        before = getattr(model.config, "_attn_implementation", None)
        model.set_attn_implementation("eager")
        try:
            result = model(**inputs, output_attentions=True)
        finally:
            if before and before != "eager":
                model.set_attn_implementation(before)
        mask = inputs.get("attention_mask")
        mask = mask.bool() if mask is not None else torch.ones_like(inputs["input_ids"], dtype=torch.bool)
        return result.logits, [a.detach() for a in result.attentions], mask

    def matches(self, model: nn.Module) -> bool:
        return type(model).__name__ in self.classes and hasattr(model, "config")

    def recipe(self, model: nn.Module) -> Recipe:
        return Recipe(type(model), model.config)

    def _get(self, config: Any, field: str) -> int:
        key = self.config_keys.get(field)
        return getattr(config, key, None) if key else None

    def sizes(self, model_or_recipe: nn.Module | Recipe) -> Sizes:
        config = self._recipe(model_or_recipe).config
        heads = self._get(config, "heads")
        hidden = self._get(config, "hidden")
        kv = self._get(config, "kv_heads") or heads
        ffn = self._get(config, "ffn") or 4 * hidden
        head_dim = self._get(config, "head_dim") or hidden // heads
        return Sizes(self._get(config, "layers"), heads, kv, hidden, ffn, head_dim)

    def resize(self, recipe: Recipe, sizes: Sizes) -> Recipe:
        config = copy.deepcopy(recipe.config)
        old_layers = self._get(config, "layers")
        for field, key in self.config_keys.items():
            if getattr(config, key, None) is not None or field in ("layers", "heads", "hidden", "ffn"):
                setattr(config, key, getattr(sizes, field))
        for key in self.per_layer_keys:  # per-layer settings (Qwen's layer_types) follow the depth
            values = getattr(config, key, None)
            if values is not None and len(values) == old_layers and sizes.layers != old_layers:
                if len(set(values)) > 1:
                    raise UnsupportedModelError(f"{self.name}: config.{key} differs between layers ({sorted(set(values))}); "
                                                "changing the depth of such a model is not supported")
                setattr(config, key, [values[0]] * sizes.layers)
        return Recipe(recipe.cls, config)

    def build(self, recipe: Recipe) -> nn.Module:
        return recipe.cls(recipe.config)

    def option_problem(self, options: dict) -> str | None:
        """Why ``options`` cannot go to this family's config: a key the config class does not have
        (HF configs keep any keyword silently), or one the model section owns (its sizes)."""
        import transformers

        config_cls = getattr(transformers, self.config_class)
        known = set(config_cls().to_dict()) | {"attn_implementation"}
        # head_dim is not among them: the model section has no head_dim (a decoupled one, as Qwen3's, is an option)
        sizes = {key for field, key in self.config_keys.items() if field != "head_dim"}
        owned = sorted(sizes & set(options))
        if owned:
            return f"{owned} set the model's size: use the model section (layers, heads, hidden, ffn, kv_heads)"
        # The probe config has the family's default sizes, so transformers may warn about a value that
        # is fine at the run's own sizes (token ids past a small vocabulary): the probe stays quiet.
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:  # a key the config consumes (a legacy name such as GPT-NeoX's rotary_pct) is known too
            kept = set(config_cls(**{k: v for k, v in options.items() if k != "attn_implementation"}).to_dict())
        except Exception as exc:  # noqa: BLE001 -- configs raise many types for a bad value
            return f"{self.config_class} refuses {options}: {type(exc).__name__}: {exc}"
        finally:
            transformers.logging.set_verbosity(verbosity)
        unknown = sorted(k for k in set(options) - known if k in kept)
        return f"{self.config_class} has no {unknown}" if unknown else None

    def new(self, sizes: Sizes, **options: Any) -> nn.Module:
        import transformers

        config_cls = getattr(transformers, self.config_class)
        defaults = config_cls()  # keys this config does not know (BERT's kv heads) stay unset
        values = {key: getattr(sizes, field) for field, key in self.config_keys.items()
                  if field in ("layers", "heads", "hidden", "ffn") or getattr(defaults, key, None) is not None}
        options = {"attn_implementation": "sdpa", **options}  # fused attention unless the config says otherwise
        return getattr(transformers, self.classes[0])(config_cls(**{**values, **options}))

    def attention_kernel(self, model: nn.Module) -> str:
        return model.config._attn_implementation

    def head_tied(self, model: nn.Module) -> bool:
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        return out is not None and inp is not None and out.weight is inp.weight

    def tie(self, model: nn.Module) -> None:
        model.tie_weights()

    def skip_init(self):
        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # older transformers: initialising on meta is only slower
            return contextlib.nullcontext()
        return no_init_weights()

    def save(self, model: nn.Module, directory) -> None:
        model.save_pretrained(directory)

    def saved_by(self, config: dict) -> bool:
        archs = config.get("architectures")
        return isinstance(archs, list) and len(archs) == 1 and archs[0] in getattr(self, "classes", ())

    def load_classifier(self, directory, num_labels: int) -> nn.Module:
        """The saved model's encoder under a fresh ``num_labels``-way classification head (for a
        downstream fine-tuning check). A classifier parameter the saved model should have filled but
        did not (missing outside ``classifier_fresh``, or of another shape) is a :class:`CheckpointError`."""
        import transformers

        if not self.sequence_classifier:
            raise UnsupportedModelError(f"family {self.name!r} has no sequence classifier for a downstream check")
        cls = getattr(transformers, self.sequence_classifier)
        model, info = cls.from_pretrained(str(directory), num_labels=num_labels, trust_remote_code=False,
                                          output_loading_info=True)
        unfilled = sorted(k for k in info.get("missing_keys") or [] if not k.startswith(self.classifier_fresh))
        if unfilled or info.get("mismatched_keys"):
            raise CheckpointError(f"{directory}: the saved model does not fill the classifier's encoder (missing "
                                  f"{unfilled[:4]}, of another shape {sorted(info.get('mismatched_keys') or [])[:4]})")
        return model

    def load(self, directory, config: dict) -> nn.Module:
        import transformers
        from transformers.utils import logging as hf_logging

        cls = getattr(transformers, config["architectures"][0])
        # The weights must be exactly what the config describes: from_pretrained would otherwise drop
        # extra tensors (more layers than the config says) and randomly initialise missing ones.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report would repeat, in a table, what the error below says
        try:
            model, info = cls.from_pretrained(str(directory), output_loading_info=True, trust_remote_code=False)
        finally:
            hf_logging.set_verbosity(verbosity)
        problems = [f"{what} {sorted(map(str, names))[:4]}{' ...' if len(names) > 4 else ''}"
                    for what, names in (("missing", info.get("missing_keys") or []),
                                        ("not in the config", info.get("unexpected_keys") or []),
                                        ("of another shape", info.get("mismatched_keys") or [])) if names]
        if problems:
            raise CheckpointError(f"checkpoint {directory}: config.json and model.safetensors disagree (weights "
                                  f"{'; '.join(problems)})")
        return model


