"""Capture what similarity analysis compares: the residual stream after each block, each
layer's per-head attention probabilities, and each head's output (before the output projection).

- Hidden states and head outputs come from forward hooks on the blocks and on each block's
  attention-output projection (named by the family spec), so no model code changes.
- Attention maps come from the family (:meth:`~mlresearch.families.Family.forward_with_attention`):
  HF models return them under eager attention (set for the call, then restored); for timm's fused
  attention a pre-hook on ``attn`` recomputes ``softmax(q k^T * scale)`` with the module's own
  weights, which leaves the model's outputs unchanged.
- Masks: ``mask`` marks real tokens (the ``attention_mask`` of the inputs, all true for images).
  Padded key positions get zero probability in HF's maps; padded query rows are excluded by the
  metrics. Causal models' maps are lower-triangular (future keys are zero).
"""

from __future__ import annotations

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


@torch.no_grad()
def capture(model: nn.Module, inputs: dict) -> Capture:
    """Run ``model`` on ``inputs`` once and collect hidden states, attention maps and head outputs."""
    family = family_of(model)
    sizes = family.sizes(model)
    blocks = _module(model, family.layers)
    out = Capture()
    handles = []
    for block in blocks:
        handles.append(block.register_forward_hook(
            lambda m, a, o: out.hidden.append((o[0] if isinstance(o, tuple) else o).detach())))
        handles.append(_module(block, family.attention_output).register_forward_pre_hook(
            lambda m, a: out.heads.append(a[0].detach().unflatten(-1, (sizes.heads, -1)))))
    was_training = model.training
    model.eval()
    try:  # how the maps are obtained is the family's fact (eager HF attention, recomputed timm maps)
        out.output, out.attentions, out.mask = family.forward_with_attention(model, inputs)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return out
