"""How much does the BBC topic check move with its own fine-tuning seed alone?

The masked-LM downstream check (`mlresearch downstream`) fine-tunes once, with seed 0 (classifier-head
init and batch order). Runs of nearly equal pre-training loss have scored ~0.1 apart on it, so before a
gap between two methods is read as real, this refits the *same* pre-trained models with other
fine-tuning seeds and writes every score to ``results/tables/downstream_noise.csv`` (run, fine-tuning
seed, accuracy, git commit), each run with the recipe its ``downstream.json`` records. Resumable: a
(run, seed) already in the table is not refit. Seed 0 must reproduce that ``downstream.json`` (checked).

    nice python experiments/downstream_noise.py results/bert_mask40_15k/baseline-seed0 \\
        results/bert_mask40_15k/staged-width-seed0 --seeds 5
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pandas as pd

from mlresearch.checkpoint import atomic_write_text
from mlresearch.downstream import DownstreamConfig, bbc_topic_accuracy, torch_threads
from mlresearch.results import REPO, provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="finished masked-LM run directories")
    ap.add_argument("--seeds", type=int, default=5, help="fine-tuning seeds 0 .. N-1")
    ap.add_argument("--out", default="results/tables/downstream_noise.csv")
    args = ap.parse_args()
    records = {}
    for r in (Path(r).resolve() for r in args.runs):
        if not (r / "downstream.json").exists():
            raise SystemExit(f"{r}: no downstream.json (run `mlresearch downstream {r}` first)")
        records[r] = json.loads((r / "downstream.json").read_text())
        if records[r]["task"] != "bbc_topics":
            raise SystemExit(f"{r}: not a masked-LM run; only the BBC fine-tuning check has a fine-tuning seed")
    out = REPO / args.out
    table = pd.read_csv(out) if out.exists() else pd.DataFrame(columns=["run", "finetune_seed", "accuracy", "git_commit"])
    commit = provenance({}, 0)["git_commit"]
    out.parent.mkdir(parents=True, exist_ok=True)
    for r, recorded in records.items():
        name = str(r.relative_to(REPO / "results")) if r.is_relative_to(REPO / "results") else str(r)
        base = DownstreamConfig(**recorded["provenance"]["config"])  # the recipe the run was scored with
        with torch_threads(base.threads):
            for seed in range(args.seeds):
                if ((table.run == name) & (table.finetune_seed == seed)).any():
                    continue
                acc = bbc_topic_accuracy(r, replace(base, seed=seed))["accuracy"]
                if seed == base.seed and acc != recorded["accuracy"]:
                    raise SystemExit(f"{name}: fine-tuning seed {seed} scored {acc:.4f}, its downstream.json "
                                     f"{recorded['accuracy']:.4f}: the check is not reproducible here")
                row = pd.DataFrame([{"run": name, "finetune_seed": seed, "accuracy": acc, "git_commit": commit}])
                table = row if table.empty else pd.concat([table, row], ignore_index=True)
                atomic_write_text(out, table.sort_values(["run", "finetune_seed"]).to_csv(index=False))
                print(f"{name} fine-tuning seed {seed}: accuracy {acc:.4f}")
    for name, g in table.groupby("run"):
        print(f"{name}: mean {g.accuracy.mean():.3f}, sd {g.accuracy.std(ddof=1):.3f}, "
              f"range {g.accuracy.min():.3f} - {g.accuracy.max():.3f} over {len(g)} fine-tuning seeds")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
