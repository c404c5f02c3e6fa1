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
    """FLOPs the config plans to spend: the baseline's and, with a vcycle section, the V-cycle's per
    phase; read off the methods' plans (:func:`mlresearch.training.methods.planned_ledger`)."""
    from .methods import planned_ledger as method_ledger

    base = method_ledger(cfg, "baseline")
    out = {"per_example": [base["phases"][0]["flops"] / base["phases"][0]["examples"]], "baseline": base["flops"]}
    if cfg.vcycle:
        vc = method_ledger(cfg, "vcycle")
        per_level = {p["level"]: p["flops"] / p["examples"] for p in vc["phases"]}
        out["per_example"] = [per_level.get(k, 0.0) for k in range(1, cfg.vcycle.levels + 1)]
        out["vcycle_phases"] = {p["phase"]: p["flops"] for p in vc["phases"]}
        out["vcycle"] = vc["flops"]
        out["planned_saving_pct"] = 100 * (1 - out["vcycle"] / out["baseline"])
    return out
