"""Training throughput of the engine against a bare PyTorch loop, same model and batches, same run.

The bare loop is the minimum: forward, backward, clip, AdamW step, LR step, zero_grad on
pre-built batches. The engine adds batch assembly, accelerate, logging and the FLOPs ledger
(evaluation and checkpoints are pushed past the end). Prints steps/s and the ratio.

    python experiments/bench_engine.py [--config experiments/configs/gpt2_tiny.yaml] [--steps 40]
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from mlresearch.data.datasets import batch_indices, load_data, make_batch
from mlresearch.results import REPO
from mlresearch.training.config import load_config
from mlresearch.training.engine import Ledger, MetricsLog, RunState, compute_loss, new_optimizer, train_phase
from mlresearch.training.phase import Phase
from mlresearch.training.models import build_model
from mlresearch.training.schedules import WarmupDecay


def bare_loop(model, cfg, batches):
    opt = new_optimizer(model, cfg, cfg.train.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupDecay(cfg.train.warmup, len(batches), cfg.train.schedule))
    start = time.perf_counter()
    for batch in batches:
        loss, _ = compute_loss(model, batch, cfg.task)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "experiments/configs/gpt2_tiny.yaml"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from accelerate import Accelerator

    cfg = load_config(args.config, [f"train.steps={args.steps}", "train.warmup=4", "vcycle=null",
                                    f"train.eval_every={10**9}", "train.eval_batches=1",
                                    f"train.checkpoint_every={10**9}"])
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    data = load_data(cfg.task, asdict(cfg.data), cfg.seed)
    torch.manual_seed(0)
    model = build_model(cfg, data.vocab_size or None, data.special).train()
    batches = [make_batch(data, "train", batch_indices(len(data.train), cfg.train.batch_size, s, cfg.seed), s, cfg.seed)
               for s in range(args.steps)]
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    bare, eng = [], []
    for _ in range(args.rounds):  # interleaved, so drift hits both alike
        bare.append(bare_loop(copy.deepcopy(model), cfg, batches))
        with tempfile.TemporaryDirectory() as tmp:
            state = RunState(Ledger(), MetricsLog(Path(tmp) / "metrics.jsonl"))
            tick = time.perf_counter()
            train_phase(copy.deepcopy(model), None, Phase("bench", 1, args.steps, cfg.train.lr, 4), data, cfg,
                        accelerator, state, Path(tmp) / "ck")
            # includes the final 1-batch evaluation and checkpoint every phase ends with
            eng.append(time.perf_counter() - tick)
    b, e = min(bare), min(eng)
    print(f"{cfg.experiment}: {args.steps} steps x batch {cfg.train.batch_size}, {torch.get_num_threads()} threads, "
          f"best of {args.rounds}")
    print(f"  bare loop  {args.steps / b:6.2f} steps/s")
    print(f"  engine     {args.steps / e:6.2f} steps/s")
    print(f"  engine / bare = {b / e:.3f}  (target >= 0.95)")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
