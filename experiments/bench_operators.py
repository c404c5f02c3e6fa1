"""Operator speed on a GPT-2-124M-shaped model (12 layers, 768 hidden, vocab 50257), CPU.

Prints the time of coalesce, de-coalesce and interpolate (halving scheme), and their ratio to a
plain ``copy.deepcopy`` of the model's state dict measured in the same run (median of repeats).

    python experiments/bench_operators.py [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from mlresearch.operators import Scheme, coalesce, decoalesce, interpolate


def timed(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        result = None  # free the previous result before timing the next call
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    model = GPT2LMHeadModel(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    scheme = Scheme.halving(model)

    t_copy, _ = timed(lambda: copy.deepcopy(model.state_dict()), args.repeats)
    t_coal, small = timed(lambda: coalesce(model, scheme), args.repeats)
    t_deco, big = timed(lambda: decoalesce(small, scheme), args.repeats)
    t_ip, _ = timed(lambda: interpolate(model, big, alpha=0.25), args.repeats)
    total = t_coal + t_deco + t_ip

    rows = {
        "deepcopy(state_dict)": t_copy,
        "coalesce": t_coal,
        "decoalesce": t_deco,
        "interpolate": t_ip,
        "all three": total,
    }
    print(f"GPT-2 12L/768/50257 ({n_params / 1e6:.1f} M params), {args.threads} threads, "
          f"median of {args.repeats}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    for name, t in rows.items():
        print(f"  {name:22s} {t * 1000:8.1f} ms   {t / t_copy:5.2f}x copy")
    print(f"target: all three within 3x of the copy -> {'met' if total <= 3 * t_copy else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": rows, "ratio_to_copy": {k: v / t_copy for k, v in rows.items()},
                       "threads": args.threads, "params": n_params}, f, indent=2)


if __name__ == "__main__":
    main()
