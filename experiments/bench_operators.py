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
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result  # free it before the next call
    return statistics.median(times), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    model = GPT2LMHeadModel(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    scheme = Scheme.halving(model)

    small = coalesce(model, scheme)
    big = decoalesce(small, scheme)
    steps = {
        "deepcopy(state_dict)": lambda: copy.deepcopy(model.state_dict()),
        "coalesce": lambda: coalesce(model, scheme),
        "decoalesce": lambda: decoalesce(small, scheme),
        "interpolate": lambda: interpolate(model, big, alpha=0.25),
    }
    # Interleaved rounds, so that drift in the machine's speed hits every step alike.
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, fn in steps.items():
            times[name].append(timed(fn, 1)[0])
    med = {name: statistics.median(ts) for name, ts in times.items()}
    t_copy = med["deepcopy(state_dict)"]
    total = med["coalesce"] + med["decoalesce"] + med["interpolate"]

    rows = dict(med, **{"all three": total})
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
