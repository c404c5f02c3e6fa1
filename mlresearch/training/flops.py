"""The FLOPs ledger's analytic count: matrix-multiply FLOPs of one training example.

Forward FLOPs per token (a multiply-add counts 2), for a model with L layers, hidden d, H query
heads and KV key/value heads of size h, FFN width f, vocabulary V and T tokens per example:

    2 * [ d*(H + 2*KV)*h  (q, k, v)  +  H*h*d  (output)  +  m*d*f  (MLP; m = 2, or 3 for SwiGLU) ] * L
  + 2 * 2 * T * H * h * L      (attention scores Q K^T and weighted values A V, full T x T)
  + 2 * d * V                  (LM head / MLM decoder, every position; BERT adds its d x d transform)

ViT: T = patches + class/register tokens; the patch embedding adds 2 * (C p^2) d per patch and
the classifier 2 * d * classes once per image. Training = forward + backward = 3x forward,
except the patch embedding (its input needs no gradient: 2x). Embedding look-ups, norms,
softmax and activations are not counted (as ``torch.utils.flop_counter`` does not count them);
a test checks this count against ``FlopCounterMode`` within 2%.
"""

from __future__ import annotations

from torch import nn

from ..families import family_of


def forward_flops_per_example(model: nn.Module, seq_len: int | None = None) -> dict[str, float]:
    """Forward matmul FLOPs of one example, by part (works on meta-device models); the family
    knows its parts (MLP matrices, head transform, patch embedding)."""
    return family_of(model).forward_flops(model, seq_len)


def train_flops_per_example(model: nn.Module, seq_len: int | None = None) -> float:
    parts = forward_flops_per_example(model, seq_len)
    return 3 * (parts["linear"] + parts["attention"] + parts["head"]) + 2 * parts["patch_embed"]


def planned_ledger(cfg) -> dict:
    """FLOPs a config plans to spend, per phase, from models built on the meta device."""
    import torch

    from ..families import FAMILIES
    from .models import level_sizes, model_options, model_sizes

    vocab = 50257 if cfg.data.tokenizer == "gpt2" else cfg.data.vocab_size
    family = FAMILIES[cfg.model.family]
    seq = None if cfg.task == "image_cls" else cfg.data.seq_len
    sizes = level_sizes(cfg) if cfg.vcycle else [model_sizes(cfg)]
    per_example = []
    for s in sizes:
        with torch.device("meta"), family.skip_init():
            per_example.append(train_flops_per_example(family.new(s, **model_options(cfg, vocab)), seq))
    b = cfg.train.batch_size
    out = {"per_example": per_example, "baseline": cfg.train.steps * b * per_example[0]}
    if cfg.vcycle:
        v, K = cfg.vcycle, cfg.vcycle.levels
        phases = {f"down{k}": v.down_steps[k - 1] * b * per_example[k - 1] for k in range(1, K)}
        phases["small"] = v.small_steps * b * per_example[K - 1]
        phases.update({f"up{k}": v.up_steps[K - 1 - k] * b * per_example[k - 1] for k in range(K - 1, 0, -1)})
        out["vcycle_phases"] = phases
        out["vcycle"] = sum(phases.values())
        out["planned_saving_pct"] = 100 * (1 - out["vcycle"] / out["baseline"])
    return out
