"""Where one model shape's training step spends its time: ``torch.profiler`` over the engine's own
steps (as ``bench_shapes.py`` times them), the operators by their own CPU (or CUDA) time.

A small shape's step runs far below the machine's FLOP rate (docs/speed.md); this says which
operators take the difference, so the lever to try next is chosen by measurement.

    python experiments/profile_shape.py experiments/studies/gpt2_regime.yaml 2L/32d/1h [--steps 30 --rows 15]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from bench_shapes import seconds_per_step, study_shapes, timing_config
from mlresearch.data.datasets import load_data
from mlresearch.results import REPO
from mlresearch.study_runner import load_study
from mlresearch.training.models import data_settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="a study spec (experiments/studies/*.yaml)")
    ap.add_argument("shape", help="one of its shapes, e.g. 2L/32d/1h")
    ap.add_argument("--steps", type=int, default=30, help="profiled steps (after 5 unrecorded ones)")
    ap.add_argument("--rows", type=int, default=15, help="operators shown")
    ap.add_argument("--execution", default="eager", help="the train.speed execution to profile")
    args = ap.parse_args()
    spec = load_study(Path(args.spec))
    shapes = study_shapes(spec)
    if args.shape not in shapes:
        raise SystemExit(f"{args.shape} is not a shape of {Path(args.spec).name} (its shapes: {', '.join(shapes)})")
    cfg = timing_config(REPO / "experiments" / "configs" / f"{spec['config']}.yaml")
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    data = load_data(cfg.task, data_settings(cfg), cfg.seed)
    cuda, warmup = torch.cuda.is_available(), 5
    # Only the steps after the warm ones are recorded: a compiled phase compiles in its first step.
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 schedule=schedule(skip_first=warmup, wait=0, warmup=0, active=args.steps, repeat=1)) as prof:
        per_step = seconds_per_step(cfg, shapes[args.shape], data, args.steps, warmup, args.execution, prof.step)
    print(f"{args.shape} ({args.execution}, {torch.get_num_threads()} threads): {per_step * 1e3:.2f} ms a step "
          f"under the profiler, {args.steps} steps after {warmup} unrecorded ones")
    print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                    row_limit=args.rows))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
