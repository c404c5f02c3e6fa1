"""Choose the BBC topic fine-tuning LR for the BERT downstream check, without touching held-out articles.

Each candidate LR fine-tunes both tiny BERT *baselines* (seeds 0, 1) on 90% of their pre-training
BBC articles and scores the other 10%; the LR with the best mean accuracy is written, with every
score, to results/bert_tiny/finetune_lr.json. V-cycle runs play no part in the choice.

    python experiments/select_finetune_lr.py [--lrs 1e-4 3e-4 1e-3]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path

import torch

from mlresearch.downstream import DownstreamConfig, bbc_topic_accuracy
from mlresearch.results import REPO, provenance, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3])
    ap.add_argument("--runs", nargs="+", default=["results/bert_tiny/baseline-seed0", "results/bert_tiny/baseline-seed1"])
    ap.add_argument("--out", default="results/bert_tiny/finetune_lr.json")
    args = ap.parse_args()
    base = DownstreamConfig()
    torch.set_num_threads(base.threads)
    scores = {}
    for lr in args.lrs:
        dc = replace(base, finetune_lr=lr)
        scores[str(lr)] = {Path(r).name: bbc_topic_accuracy(REPO / r, dc, select=True)["accuracy"] for r in args.runs}
        print(f"lr {lr:g}: validation accuracy " + ", ".join(f"{k} {v:.3f}" for k, v in scores[str(lr)].items()))
    mean = {lr: sum(v.values()) / len(v) for lr, v in scores.items()}
    chosen = float(max(mean, key=mean.get))
    write_json(REPO / args.out, {"chosen_lr": chosen, "mean_validation_accuracy": mean, "scores": scores,
                                 "provenance": provenance({**asdict(base), "lrs": args.lrs, "runs": args.runs}, base.seed)})
    print(f"chosen lr {chosen:g} -> {args.out}")


if __name__ == "__main__":
    main()
