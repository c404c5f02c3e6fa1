"""Tasks: what an example is, how a batch becomes a loss, and what is reported beside it.

A run names its task (``causal_lm``, ``masked_lm``, ``image_cls``); everything that differs between
tasks outside a model family (the loss and the accuracy it counts, whether examples are token
sequences of ``data.seq_len``, how a batch is drawn, the downstream number shown in tables) is a
fact of the task object here, so the engine, the FLOPs ledger and the study never branch on a task
name. A new task is one subclass and one entry in :data:`TASKS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class TextLayout:
    """How a text task's token stream is made: the tokenizer trained for it, its special tokens (the
    vocabulary's first ids, in this order) and the names the data calls them by (``data.special``),
    the token that ends each document in the stream, and the tokens around each block (none: a
    block is ``seq_len`` tokens of the stream)."""

    tokenizer: str  # "bpe" (byte-level BPE) or "wordpiece" (lower-cased WordPiece)
    special: tuple[str, ...]
    names: tuple[str, ...]
    end: str
    wrap: tuple[str, str] | None = None

    def body(self, seq_len: int) -> int:
        """Tokens of the stream in one block of ``seq_len``."""
        return seq_len - len(self.wrap or ())


@dataclass(frozen=True)
class Downstream:
    """A task's check after training (``mlresearch downstream``): ``check``, the name of its function in
    :data:`mlresearch.downstream.CHECKS`; ``key``, its number in ``downstream.json``; ``label``, the
    study tables' column; ``digits``, the decimals the tables print it to."""

    check: str
    key: str
    label: str
    digits: int


@dataclass(frozen=True)
class Task:
    name: str
    sequences: bool  # examples are token sequences of data.seq_len (FLOPs and tokens count per token)
    accuracy: bool  # evaluation also counts correct predictions (reported as <split>_acc)
    downstream: Downstream
    text: TextLayout | None = None  # a text task's token stream (None: examples are images)

    def seq_len(self, cfg) -> int | None:
        """Tokens per example for the FLOPs count (None: an image, counted per patch by its family)."""
        return cfg.data.seq_len if self.sequences else None

    def loss(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean loss, number of correct predictions when the task counts them)."""
        raise NotImplementedError

    def logits(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, the logits at every position the loss predicts, one row each)."""
        raise NotImplementedError

    def distilled_loss(self, model: nn.Module, teacher: nn.Module, batch: dict, weight: float) -> torch.Tensor:
        """Knowledge Inheritance's loss: (1 - weight) * the task loss + weight * KL(teacher || model)
        over the predicted positions (the teacher's forward pass without gradients)."""
        loss, student = self.logits(model, batch)
        if not len(student):  # nothing predicted in this micro-batch (no masked token)
            return loss
        with torch.no_grad():
            _, target = self.logits(teacher, batch)
        kl = nn.functional.kl_div(student.float().log_softmax(-1), target.float().log_softmax(-1), log_target=True,
                                  reduction="batchmean")
        return (1 - weight) * loss + weight * kl

    def batch(self, data, split: str, idx: np.ndarray, step: int, seed: int, part: tuple[int, int] = (0, 1)) -> dict:
        """Model inputs and labels for examples ``idx`` of ``split``: a pure function of its arguments.
        ``part`` (rank, world): ``idx`` is rows ``rank::world`` of the step's global batch, so random
        choices (masks) are those rows of the global batch's, the same on any number of processes."""
        raise NotImplementedError

    def data_settings(self, cfg, settings: dict) -> dict:
        """The data section as the loader takes it (a task may fill in what the model decides)."""
        return settings


class CausalLM(Task):
    def loss(self, model, batch):
        return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss, None

    def logits(self, model, batch):  # position t predicts token t + 1 (the model shifts the labels)
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        return out.loss, out.logits[:, :-1].flatten(0, 1)

    def batch(self, data, split, idx, step, seed, part=(0, 1)):
        ids = torch.from_numpy(data.split(split)[0][idx])
        return {"input_ids": ids, "labels": ids}


class MaskedLM(CausalLM):
    def logits(self, model, batch):  # the masked positions only
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        return out.loss, out.logits[batch["labels"] != -100]

    def batch(self, data, split, idx, step, seed, part=(0, 1)):
        return mask_tokens(torch.from_numpy(data.split(split)[0][idx]), data, step, seed, part)


def mask_tokens(ids: torch.Tensor, data, step: int, seed: int, part: tuple[int, int] = (0, 1)) -> dict:
    """BERT's masking of token blocks ``ids``, seeded by (seed, step): ``data.mask_prob`` of the
    tokens chosen (BERT's 15% by default), of those 80% [MASK], 10% a random token, 10% kept;
    labels -100 elsewhere. ``part`` (rank, world): ``ids`` are rows ``rank::world`` of the step's
    global batch; the draws are made for the whole global batch and these rows taken, so every
    process masks its examples differently and exactly as one process would have."""
    rank, world = part
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    shape = (ids.shape[0] * world, *ids.shape[1:])
    mine = slice(rank, None, world)
    special = torch.zeros_like(ids, dtype=torch.bool)
    for k in ("cls", "sep", "pad"):
        special |= ids == data.special[k]
    chosen = (torch.rand(shape, generator=g)[mine] < data.mask_prob) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(shape, generator=g)[mine]
    inputs = ids.clone()
    inputs[chosen & (roll < 0.8)] = data.special["mask"]
    random_tok = torch.randint(0, data.vocab_size, shape, generator=g)[mine]
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = random_tok[swap]
    return {"input_ids": inputs, "labels": labels}


class ImageClassification(Task):
    def loss(self, model, batch):
        logits = model(batch["x"])
        return nn.functional.cross_entropy(logits, batch["labels"]), (logits.argmax(-1) == batch["labels"]).sum()

    def logits(self, model, batch):
        logits = model(batch["x"])
        return nn.functional.cross_entropy(logits, batch["labels"]), logits

    def batch(self, data, split, idx, step, seed, part=(0, 1)):
        x, y = data.split(split)
        return {"x": torch.from_numpy(np.ascontiguousarray(x[idx])), "labels": torch.from_numpy(y[idx])}

    def data_settings(self, cfg, settings):
        """Images are loaded at the model's input size unless ``data.img_size`` says otherwise."""
        if not settings.get("img_size"):
            settings["img_size"] = cfg.model.options.get("img_size", 28)
        return settings


TASKS: dict[str, Task] = {
    "causal_lm": CausalLM("causal_lm", sequences=True, accuracy=False, downstream=Downstream("zero_shot_perplexity", "perplexity", "zero-shot ppl", 1),
                          text=TextLayout("bpe", ("<|endoftext|>",), ("eos",), end="eos")),
    "masked_lm": MaskedLM("masked_lm", sequences=True, accuracy=False, downstream=Downstream("bbc_topic_accuracy", "accuracy", "BBC topic acc", 3),
                          text=TextLayout("wordpiece", ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
                                          ("pad", "unk", "cls", "sep", "mask"), end="sep", wrap=("cls", "sep"))),
    "image_cls": ImageClassification("image_cls", sequences=False, accuracy=True,
                                     downstream=Downstream("image_top1", "accuracy", "test top-1", 3)),
}


def task_of(name: str) -> Task:
    if name not in TASKS:
        from .errors import MLResearchError

        raise MLResearchError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name]
