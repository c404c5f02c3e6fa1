"""Word-order sensitivity of a trained language model: how much its validation loss rises when the
tokens of every block are shuffled (inputs and labels moved together, special tokens left in place).

Why: a masked LM on its bag-of-words plateau predicts a masked token from *which* tokens are in the
block, not *where* they are, so shuffling leaves its loss unchanged (gain ~ 0). Only once attention
uses position does shuffling cost loss. A full model still on that plateau has not yet used what its
capacity buys over a small model, so the regime check (``mlresearch study SPEC --stage regime``) reports the gain of
both runs next to the margin. A causal LM reads order through its mask from the first step, so its
gain is large at once; the number is meant for comparing runs of one task.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class WordOrder:
    ordered: float  # mean validation loss on the blocks as they are
    shuffled: float  # ... with every block's non-special tokens permuted
    blocks: int

    @property
    def gain(self) -> float:
        """Loss the model loses when order is destroyed: > 0 when it uses word order."""
        return self.shuffled - self.ordered


def shuffle_blocks(batch: dict, fixed: torch.Tensor, generator: torch.Generator) -> dict:
    """``batch`` with each row's positions not in ``fixed`` (bool, rows x positions) permuted, the same
    permutation for every tensor of that shape (inputs, labels, masks), so the set of (token, label)
    pairs of a row is unchanged and only their order is lost."""
    rows, length = fixed.shape
    order = torch.arange(length).repeat(rows, 1)
    for r in range(rows):
        free = torch.nonzero(~fixed[r]).flatten()
        order[r, free] = free[torch.randperm(len(free), generator=generator)]
    return {k: torch.gather(v, 1, order) if torch.is_tensor(v) and v.shape == fixed.shape else v
            for k, v in batch.items()}


def word_order(model: nn.Module, data, task, batches: int = 8, batch_size: int = 32, seed: int = 0) -> WordOrder:
    """Mean loss of ``model`` over the first ``batches`` x ``batch_size`` validation blocks, as they
    are and shuffled (:func:`shuffle_blocks`); the task draws the batch (a masked LM's masks are
    chosen before shuffling, so both losses score the same masked tokens)."""
    n = min(batches * batch_size, len(data.val))
    if n == 0:
        raise ValueError("the validation split has no blocks")
    special = torch.tensor(sorted(set(data.special.values())))
    g = torch.Generator().manual_seed(seed)
    model.eval()
    totals = np.zeros(2)
    with torch.no_grad():
        for i, start in enumerate(range(0, n, batch_size)):
            idx = np.arange(start, min(start + batch_size, n))
            batch = task.batch(data, "val", idx, step=i, seed=seed)
            fixed = torch.isin(torch.from_numpy(data.val[idx]), special)
            for j, b in enumerate((batch, shuffle_blocks(batch, fixed, g))):
                totals[j] += float(task.loss(model, b)[0]) * len(idx)
    return WordOrder(float(totals[0] / n), float(totals[1] / n), n)


def run_word_order(run: str | Path, batches: int = 8) -> WordOrder:
    """:func:`word_order` of a finished run's final model on its own validation split."""
    from ..checkpoint import load_model
    from ..data.datasets import load_data
    from ..downstream import finished_run, torch_threads
    from ..tasks import task_of

    cfg, data_cfg, _, model_dir = finished_run(Path(run))
    task = task_of(cfg.task)
    if not task.sequences:
        raise ValueError(f"{run}: word order needs a sequence task, not {cfg.task!r}")
    with torch_threads(cfg.train.threads):
        return word_order(load_model(model_dir), load_data(cfg.task, data_cfg, cfg.seed), task, batches=batches,
                          seed=cfg.seed)
