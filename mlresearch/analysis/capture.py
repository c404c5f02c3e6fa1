"""Capture what similarity analysis compares: the residual stream after each block, each
layer's per-head attention probabilities, and each head's output (before the output projection).

- Hidden states and head outputs come from forward hooks on the blocks and on each block's
  attention-output projection (named by the family spec), so no model code changes.
- HF models return attention maps with ``output_attentions=True`` under eager attention (set for
  the call, then restored). timm's fused attention returns none: a pre-hook on ``attn`` recomputes
  ``softmax(q k^T * scale)`` from its input with the module's own weights (and q/k norms), which
  leaves the model's outputs unchanged.
- Masks: ``mask`` marks real tokens (the ``attention_mask`` of the inputs, all true for images).
  Padded key positions get zero probability in HF's maps; padded query rows are excluded by the
  metrics. Causal models' maps are lower-triangular (future keys are zero).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..families import family_of


@dataclass
class Capture:
    hidden: list[torch.Tensor] = field(default_factory=list)  # per layer: (B, T, d)
    attentions: list[torch.Tensor] = field(default_factory=list)  # per layer: (B, H, T, T)
    heads: list[torch.Tensor] = field(default_factory=list)  # per layer: (B, T, H, head_dim)
    mask: torch.Tensor | None = None  # (B, T) bool, real tokens
    output: torch.Tensor | None = None  # the model's own output (logits)


def _module(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _vit_attention_hook(store: list):
    def hook(attn, args):
        x = args[0]
        b, n, _ = x.shape
        qkv = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
        store.append(torch.softmax((q * attn.scale) @ k.transpose(-2, -1), dim=-1))

    return hook


@contextmanager
def _eager_attention(model: nn.Module):
    before = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if before and before != "eager":
            model.set_attn_implementation(before)


@torch.no_grad()
def capture(model: nn.Module, inputs: dict) -> Capture:
    """Run ``model`` on ``inputs`` once and collect hidden states, attention maps and head outputs."""
    family = family_of(model)
    sizes = family.sizes(model)
    blocks = _module(model, family.layers)
    out = Capture()
    handles, attn_store = [], []
    for block in blocks:
        handles.append(block.register_forward_hook(
            lambda m, a, o: out.hidden.append((o[0] if isinstance(o, tuple) else o).detach())))
        handles.append(_module(block, family.attention_output).register_forward_pre_hook(
            lambda m, a: out.heads.append(a[0].detach().unflatten(-1, (sizes.heads, -1)))))
        if family.name == "vit":
            handles.append(block.attn.register_forward_pre_hook(_vit_attention_hook(attn_store)))
    was_training = model.training
    model.eval()
    try:
        if family.name == "vit":
            out.output = model(inputs["x"])
            out.attentions = attn_store
            b, t = out.hidden[0].shape[:2]
            out.mask = torch.ones(b, t, dtype=torch.bool)
        else:
            with _eager_attention(model):
                result = model(**inputs, output_attentions=True)
            out.output = result.logits
            out.attentions = [a.detach() for a in result.attentions]
            mask = inputs.get("attention_mask")
            out.mask = (mask.bool() if mask is not None else torch.ones_like(inputs["input_ids"], dtype=torch.bool))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return out
