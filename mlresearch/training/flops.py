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


def eval_flops_per_example(model: nn.Module, seq_len: int | None = None) -> float:
    """One forward pass (evaluating a choice: a searched alpha's merge on tuning batches)."""
    return sum(forward_flops_per_example(model, seq_len).values())


# Dense bf16 tensor-core peaks (TFLOP/s per device) from the vendors' data sheets, by device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0, "V100": 125.0}


def peak_flops(device, configured_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one ``device`` for the MFU column: the configured value, else a CUDA device's
    data-sheet peak by name, else None (a CPU has no such number here: no MFU is logged)."""
    if configured_tflops:
        return configured_tflops * 1e12
    import torch

    if getattr(device, "type", device) == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None
