"""Is a causal LM's output layer faster fused with its cross-entropy, in chunks of positions?

At width 32 the GPT-2 study's smallest shape spends about a fifth of its step in the log-softmax
over the 1,024-word vocabulary (docs/speed.md), memory traffic proportional to vocabulary x tokens
that a wider model hides. A fused head computes, chunk by chunk of positions, the logits, their
log-sum-exp, the loss and at once the gradients of the hidden states and the output weights
(softmax minus one-hot, times the weights and times the hidden states), so each chunk's logits
live only while they are in cache and are never written out whole. This times it against PyTorch's
``cross_entropy(h @ W.T, y)`` with its backward, on the study's shapes (2,032 positions: batch 16 x
127 predicted tokens; vocabulary 1,024), after checking both give the same loss and gradients.

    python experiments/probe_fused_head_loss.py [--widths 32 64 128 --chunks 128 256 512 1024 2032]

Run it on a quiet machine (nothing else running): it prints medians of 30 timed calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


class FusedHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of ``h @ W.T`` against ``y``, and both gradients, ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, h, w, y, chunk):
        n = h.shape[0]
        grad_h, grad_w = torch.empty_like(h), torch.zeros_like(w)
        total = h.new_zeros(())
        for start in range(0, n, chunk):
            hc, yc = h[start:start + chunk], y[start:start + chunk]
            logits = hc @ w.t()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, yc[:, None]).squeeze(1)).sum()
            p = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            p[torch.arange(p.shape[0]), yc] -= 1
            p.div_(n)
            torch.mm(p, w, out=grad_h[start:start + chunk])
            grad_w.addmm_(p.t(), hc)
        ctx.save_for_backward(grad_h, grad_w)
        return total / n

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * g, grad_w * g, None, None


def pytorch_loss(h, w, y):
    return nn.functional.cross_entropy(h @ w.t(), y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024, 2032])
    ap.add_argument("--positions", type=int, default=16 * 127)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; ms per forward + backward "
          "(median of 30 after 5 untimed)")
    for width in args.widths:
        h0, w0 = torch.randn(args.positions, width), torch.randn(args.vocab, width) * 0.02
        y = torch.randint(0, args.vocab, (args.positions,))

        def step(loss_fn, *extra):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            loss = loss_fn(h, w, y, *extra)
            loss.backward()
            return loss.detach(), h.grad, w.grad

        def ms(*call):
            times = []
            for _ in range(35):
                tick = time.perf_counter()
                step(*call)
                times.append(time.perf_counter() - tick)
            return 1e3 * statistics.median(times[5:])

        ref, fused = step(pytorch_loss), step(FusedHeadLoss.apply, 256)
        diffs = [float((a - b).abs().max()) for a, b in zip(ref, fused)]
        print(f"width {width}: |loss| {diffs[0]:.1e}, |grad h| {diffs[1]:.1e}, |grad W| {diffs[2]:.1e}; "
              f"PyTorch {ms(pytorch_loss):.2f} ms; fused, by chunk: "
              + ", ".join(f"{c}: {ms(FusedHeadLoss.apply, c):.2f}" for c in args.chunks))


if __name__ == "__main__":
    main()
