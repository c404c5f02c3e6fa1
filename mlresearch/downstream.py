"""Downstream checks of finished runs, the tiny-scale stand-ins for the paper's GLUE, zero-shot
perplexity and ImageNet top-1:

- causal LM: zero-shot perplexity on a text the run never trained on (Shakespeare by default);
- masked LM: fine-tune on BBC News topic classification, accuracy on articles held out of
  pre-training (the run's own validation + test documents);
- image classification: top-1 on the held-out test split (the run's own final test evaluation),
  and a transfer check: a linear probe on the model's features of an image set it never trained
  on (MNIST-5k, or the glyphs set for a run that trained on MNIST), beside the same probe on pixels.

A baseline and a V-cycle of the same seed share data split and tokenizer, so their numbers
compare directly. Results go to ``<run>/downstream.json`` with the evaluation's settings and commit.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .checkpoint import load_model
from .families import family_of
from .data import corpora
from .data.datasets import image_corpus, text_split
from .data.text import DataError, split_indices
from .results import provenance, write_json
from .tasks import task_of
from .training.config import load_config
from .training.models import data_settings
from .training.record import RunRecord


@dataclass
class DownstreamConfig:
    text: str = "shakespeare"  # zero-shot text (a corpus name) for causal LMs
    ppl_blocks: int = 512  # evenly spaced blocks of the text's token stream
    finetune_steps: int = 150  # BBC topic fine-tuning of masked LMs (1.2 epochs; fixed a priori, same for all runs)
    finetune_batch: int = 16
    finetune_seq_len: int = 64  # an article's first 62 tokens: headline and lead
    finetune_lr: float = 3e-4  # `mlresearch downstream --finetune-lr` sets it (experiments/select_finetune_lr.py)
    finetune_warmup: int = 15
    seed: int = 0  # classifier-head init and batch order; the transfer set's probe/test split
    transfer: tuple[str, ...] = ("mnist", "glyphs")  # the first of these a run did not train on is its transfer set
    transfer_images: int = 5000  # (a generated transfer set makes this many; MNIST-5k has 5,000)
    transfer_test_fraction: float = 0.2
    threads: int = 2

    def __post_init__(self) -> None:
        if self.finetune_steps <= self.finetune_warmup:
            raise ValueError(f"--finetune-steps {self.finetune_steps} must exceed the fine-tuning warm-up of "
                             f"{self.finetune_warmup} steps")


@contextmanager
def torch_threads(n: int | None):
    """torch's intra-op threads set to ``n`` (unchanged when None or 0) for the block, then put back:
    an evaluation called from a notebook or another run must not leave the process's setting changed."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def finished_run(run: Path):
    """A finished run's (config, data section as it ran, record, final model directory): what an
    evaluation after training (downstream, word order) needs to rebuild its data and model."""
    record = RunRecord.read(run, FileNotFoundError)
    model_dir = run / "final_model"
    if not model_dir.exists():
        raise FileNotFoundError(f"{run} is not a finished run: final_model is missing")
    cfg = load_config(run / "config.yaml")
    # The config names the corpora the run trained on: an absent corpus is an error, never skipped
    # (runs recorded before that were corrected; see their provenance.json "corrected").
    return cfg, data_settings(cfg), record, model_dir


def zero_shot_perplexity(run: str | Path, dc: DownstreamConfig = DownstreamConfig()) -> dict:
    run = Path(run)
    cfg, data_cfg, _, model_dir = finished_run(run)
    if dc.text in data_cfg.get("corpus", []):
        raise DataError(f"{run} trained on {dc.text!r}: zero-shot perplexity needs a text it never saw")
    if dc.text not in corpora.TEXT_CORPORA:
        raise DataError(f"unknown zero-shot text {dc.text!r}; known: {sorted(corpora.TEXT_CORPORA)}")
    ts = text_split(cfg.task, data_cfg, cfg.seed)
    docs = corpora.TEXT_CORPORA[dc.text]()
    ids: list[int] = []
    for enc in ts.tokenizer.encode_batch(list(docs), add_special_tokens=False):
        ids.extend(enc.ids + [ts.special["eos"]])
    seq = int(data_cfg["seq_len"])
    n_blocks = len(ids) // seq
    if n_blocks == 0:
        raise DataError(f"{dc.text!r} has fewer than {seq} tokens")
    picks = np.unique(np.linspace(0, n_blocks - 1, min(dc.ppl_blocks, n_blocks)).round().astype(int))
    blocks = torch.tensor(np.asarray(ids[: n_blocks * seq]).reshape(n_blocks, seq)[picks])
    model = load_model(model_dir).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), 32):
            x = blocks[i:i + 32]
            logits = model(input_ids=x).logits[:, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="sum").item()
            count += x[:, 1:].numel()
    per_token = nll / count
    bytes_per_token = sum(len(d.encode("utf-8")) for d in docs) / len(ids)
    return {"text": dc.text, "tokens": count, "nll_per_token": per_token, "perplexity": math.exp(per_token),
            "bits_per_byte": per_token / math.log(2) / bytes_per_token}


def bbc_topic_accuracy(run: str | Path, dc: DownstreamConfig = DownstreamConfig(), select: bool = False) -> dict:
    """Fine-tune on the run's pre-training BBC articles, score the articles it never saw.

    ``select=True`` is for choosing the recipe: it scores a seeded 10% of the *training* articles
    instead (the held-out articles stay untouched) and fine-tunes on the other 90%.
    """
    import transformers

    run = Path(run)
    cfg, data_cfg, _, model_dir = finished_run(run)
    ts = text_split(cfg.task, data_cfg, cfg.seed)
    if "bbc" not in ts.spans:
        raise DataError(f"{run} did not pre-train with the BBC corpus: no held-out articles to classify")
    labels = corpora.bbc_news()[1]
    span = ts.spans["bbc"]
    train = [int(i) for i in ts.train if int(i) in span]
    held_out = [int(i) for i in np.concatenate([ts.val, ts.test]) if int(i) in span]
    if select:
        perm = np.random.default_rng(12345).permutation(len(train))
        cut = len(train) // 10
        train, held_out = [train[i] for i in perm[cut:]], [train[i] for i in perm[:cut]]
    seq, sp = min(dc.finetune_seq_len, int(data_cfg["seq_len"])), ts.special

    def encode(idx):
        x = np.full((len(idx), seq), sp["pad"], dtype=np.int64)
        for row, enc in enumerate(ts.tokenizer.encode_batch([ts.docs[i] for i in idx], add_special_tokens=False)):
            body = [sp["cls"], *enc.ids[: seq - 2], sp["sep"]]
            x[row, : len(body)] = body
        y = np.array([labels[i - span.start] for i in idx])
        return torch.from_numpy(x), torch.from_numpy(y)

    x_tr, y_tr = encode(train)
    x_te, y_te = encode(held_out)
    family = family_of(load_model(model_dir))  # the checked load: config and weights agree, no code run
    torch.manual_seed(dc.seed)
    transformers.logging.set_verbosity_error()  # the new classifier head's "newly initialized" notice
    model = family.load_classifier(model_dir, num_labels=5)
    opt = torch.optim.AdamW(model.parameters(), lr=dc.finetune_lr, weight_decay=0.01)
    decay = dc.finetune_steps - dc.finetune_warmup
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / dc.finetune_warmup, max(0.0, (dc.finetune_steps - s) / decay)))
    gen = torch.Generator().manual_seed(dc.seed)
    order = torch.cat([torch.randperm(len(train), generator=gen)
                       for _ in range(dc.finetune_steps * dc.finetune_batch // len(train) + 1)])
    model.train()
    for step in tqdm(range(dc.finetune_steps), desc=f"fine-tune {run.name}", leave=False):
        b = order[step * dc.finetune_batch:(step + 1) * dc.finetune_batch]
        out = model(input_ids=x_tr[b], attention_mask=(x_tr[b] != sp["pad"]).long(), labels=y_tr[b])
        if not torch.isfinite(out.loss):
            raise FloatingPointError(f"fine-tuning {run} hit a non-finite loss at step {step}")
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(input_ids=x, attention_mask=(x != sp["pad"]).long()).logits.argmax(-1)
                          for x in x_te.split(64)])
    return {"task": "bbc_topics" + ("_selection" if select else ""), "lr": dc.finetune_lr,
            "train_articles": len(train), "held_out_articles": len(held_out),
            "final_train_loss": out.loss.item(), "accuracy": (pred == y_te).float().mean().item()}


def image_top1(run: str | Path, dc: DownstreamConfig = DownstreamConfig()) -> dict:
    """The run's test top-1 (as its final evaluation recorded it) and :func:`linear_probe_transfer`."""
    _, data, record, model_dir = finished_run(Path(run))
    return {"task": "test_top1", "accuracy": record.test["test_acc"], **linear_probe_transfer(model_dir, data, dc)}


def image_features(model: torch.nn.Module, images: torch.Tensor, batch: int = 256) -> np.ndarray:
    """The pooled representation a timm model's classifier reads (its pre-logits), float64
    [n, hidden], of ``images`` resized to the model's input side and channels."""
    side, channels = model.patch_embed.img_size, model.patch_embed.proj.in_channels
    out = []
    with torch.no_grad():
        for start in range(0, len(images), batch):
            x = images[start:start + batch]
            if tuple(x.shape[-2:]) != tuple(side):
                x = torch.nn.functional.interpolate(x, size=tuple(side), mode="bilinear", align_corners=False)
            if x.shape[1] != channels:
                x = x.mean(1, keepdim=True).expand(-1, channels, -1, -1)
            out.append(model.forward_head(model.forward_features(x), pre_logits=True).double().numpy())
    return np.concatenate(out)


def probe_accuracy(train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]) -> float:
    """Test accuracy of a multinomial logistic regression (L2, C=1, on standardised inputs) fitted
    on ``train``: the usual linear probe."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    probe = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
    probe.fit(*train)
    return float(probe.score(*test))


def linear_probe_transfer(model_dir: Path, data: dict, dc: DownstreamConfig = DownstreamConfig()) -> dict:
    """Does what the model learned carry to images it never saw? A linear probe on its frozen
    features of the transfer set (``dc.transfer``: the first set the run did not train on), fitted
    on a seeded ``1 - dc.transfer_test_fraction`` of it and scored on the rest, beside the same
    probe on the raw pixels (the bar the features must clear to have added anything)."""
    trained_on = None if data.get("path") else data.get("corpus", "mnist")
    name = next((t for t in dc.transfer if t != trained_on), None)
    if name is None:
        raise DataError(f"no transfer set: the run trained on {trained_on}, the only one of {list(dc.transfer)}")
    entry = image_corpus({"corpus": name})
    section = {"corpus": name, **({"examples": dc.transfer_images} if entry.sized else {})}
    x, y, _ = entry.load(section, 28)
    train, _, test, _ = split_indices(len(x), dc.seed, 0.0, dc.transfer_test_fraction)
    features = image_features(load_model(model_dir).eval(), torch.from_numpy(np.asarray(x, np.float32)))
    pixels = np.asarray(x, np.float64).reshape(len(x), -1)
    return {"transfer": name, "transfer_train_images": len(train), "transfer_test_images": len(test),
            "transfer_accuracy": probe_accuracy((features[train], y[train]), (features[test], y[test])),
            "transfer_pixels_accuracy": probe_accuracy((pixels[train], y[train]), (pixels[test], y[test]))}


# Each task names its check (tasks.Downstream.check).
CHECKS = {"zero_shot_perplexity": zero_shot_perplexity, "bbc_topic_accuracy": bbc_topic_accuracy,
          "image_top1": image_top1}


def evaluate_run(run: str | Path, dc: DownstreamConfig = DownstreamConfig()) -> dict:
    """Run the check for the run's task and write ``<run>/downstream.json``."""
    run = Path(run)
    cfg, *_ = finished_run(run)
    with torch_threads(dc.threads):
        result = CHECKS[task_of(cfg.task).downstream.check](run, dc)
    record = {"run": run.name, "task": cfg.task, **result, "provenance": provenance(asdict(dc), dc.seed)}
    write_json(run / "downstream.json", record)
    return record
