"""Training dynamics right after width growth: is the grown model's loss curve the original's?

Trains a small GPT-2 on real text (King James Bible, byte-level tokens) for ``pre_steps``, grows
it x2 in width, then trains for ``post_steps`` on the *same batches*:

  original        the small model, its own optimizer continued
  grown_mapped    the grown model, AdamW state mapped (m -> m/2, v -> v/4, step kept)
  grown_matched   grown_mapped plus the first-step multipliers (lr/r, eps*c, wd*r), then restored
  grown_fresh     the grown model with a fresh AdamW (same hyper-parameters)

Writes results/growth_dynamics/<run>/{provenance.json, metrics.csv, summary.json, curves.png}.

    python experiments/growth_dynamics.py [--config experiments/configs/growth_dynamics.yaml]
"""

from __future__ import annotations

import argparse
import copy
import csv
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from mlresearch.data.corpora import bible_verses
from mlresearch.families import FAMILIES, Sizes
from mlresearch.operators import grow_width
from mlresearch.operators.optim import clear_step_multipliers
from mlresearch.results import REPO, provenance, write_json


def batches(tokens: torch.Tensor, n: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
        yield torch.stack([tokens[s:s + seq] for s in starts])


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def evaluate(model, val_batches):
    model.eval()
    with torch.no_grad():
        out = sum(lm_loss(model, b).item() for b in val_batches) / len(val_batches)
    model.train()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "experiments/configs/growth_dynamics.yaml"))
    parser.add_argument("--out", default=None, help="run directory (default results/growth_dynamics/<seed>)")
    args = parser.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    torch.manual_seed(cfg["seed"])
    torch.set_num_threads(cfg.get("threads", torch.get_num_threads()))

    text = "\n".join(bible_verses()).encode("utf-8")
    tokens = torch.tensor(list(text), dtype=torch.long)
    cut = int(len(tokens) * 0.95)  # fixed split: the last 5% of the book is validation
    train, val = tokens[:cut], tokens[cut:]
    val_batches = list(batches(val, cfg["val_batches"], cfg["batch"], cfg["seq"], seed=10_000))

    m = cfg["model"]
    sizes = Sizes(m["layers"], m["heads"], m["heads"], m["hidden"], 4 * m["hidden"], m["hidden"] // m["heads"])
    model = FAMILIES["gpt2"].new(sizes, vocab_size=256, n_positions=cfg["seq"], bos_token_id=0, eos_token_id=0,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg["lr"], weight_decay=cfg["weight_decay"], betas=tuple(cfg["betas"]))
    for ids in tqdm(batches(train, cfg["pre_steps"], cfg["batch"], cfg["seq"], cfg["seed"]),
                    total=cfg["pre_steps"], desc="small model"):
        opt.zero_grad()
        lm_loss(model, ids).backward()
        opt.step()

    runs = {"original": (model, opt)}
    runs["grown_mapped"] = grow_width(model, opt)
    runs["grown_matched"] = grow_width(model, opt, match_first_step=True)
    fresh_model = copy.deepcopy(runs["grown_mapped"][0])
    fd = [p for p in fresh_model.parameters() if p.dim() >= 2]
    fr = [p for p in fresh_model.parameters() if p.dim() < 2]
    runs["grown_fresh"] = (fresh_model, torch.optim.AdamW(
        [{"params": fd}, {"params": fr, "weight_decay": 0.0}],
        lr=cfg["lr"], weight_decay=cfg["weight_decay"], betas=tuple(cfg["betas"])))

    rows = []
    post = list(batches(train, cfg["post_steps"], cfg["batch"], cfg["seq"], cfg["seed"] + 1))
    for name, (net, optimizer) in runs.items():
        net.train()
        rows.append({"run": name, "step": 0, "train_loss": None, "val_loss": evaluate(net, val_batches)})
        for step, ids in enumerate(tqdm(post, desc=name), start=1):
            optimizer.zero_grad()
            loss = lm_loss(net, ids)
            loss.backward()
            optimizer.step()
            if step == 1:
                clear_step_multipliers(optimizer)  # grown_matched: multipliers for the first step only
            row = {"run": name, "step": step, "train_loss": loss.item(), "val_loss": None}
            if step % cfg["val_every"] == 0 or step == len(post):
                row["val_loss"] = evaluate(net, val_batches)
            rows.append(row)

    out = Path(args.out) if args.out else REPO / "results" / "growth_dynamics" / f"seed{cfg['seed']}"
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "provenance.json", provenance(cfg, cfg["seed"]))
    tmp = out / ".metrics.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["run", "step", "train_loss", "val_loss"])
        w.writeheader()
        w.writerows(rows)
    tmp.replace(out / "metrics.csv")
    summary = _summarise(rows)
    write_json(out / "summary.json", summary)
    _plot(rows, out / "curves.png")
    for name, s in summary.items():
        print(f"{name:14s} " + "  ".join(f"{k}={v:.4g}" for k, v in s.items()))
    print(f"wrote {out}")


def _summarise(rows):
    by = {}
    for r in rows:
        by.setdefault(r["run"], {})[r["step"]] = r
    base = by["original"]
    out = {}
    for name, series in by.items():
        s = {"val_loss_at_growth": series[0]["val_loss"], "final_val_loss": series[max(series)]["val_loss"]}
        if name != "original":
            gaps = [series[k]["train_loss"] - base[k]["train_loss"] for k in series if k > 0]
            # gaps[0] is measured before any update; gaps[1] after exactly one
            s["train_gap_after_1_update"] = gaps[1]
            s["train_gap_after_10_updates"] = gaps[10] if len(gaps) > 10 else float("nan")
            s["max_abs_train_gap"] = max(abs(x) for x in gaps)
            s["mean_train_gap_last10"] = sum(gaps[-10:]) / len(gaps[-10:])
            s["final_val_gap"] = s["final_val_loss"] - base[max(base)]["val_loss"]
        out[name] = s
    return out


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["run"] for r in rows):
        pts = [(r["step"], r["train_loss"]) for r in rows if r["run"] == name and r["train_loss"] is not None]
        ax.plot(*zip(*pts), label=name, lw=1)
        vpts = [(r["step"], r["val_loss"]) for r in rows if r["run"] == name and r["val_loss"] is not None]
        bx.plot(*zip(*vpts), marker="o", ms=3, label=name)
    ax.set(xlabel="step after growth", ylabel="train loss (same batches)", title="Training loss after width x2")
    bx.set(xlabel="step after growth", ylabel="validation loss", title="Validation loss")
    for a in (ax, bx):
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name("." + path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)


if __name__ == "__main__":
    main()
