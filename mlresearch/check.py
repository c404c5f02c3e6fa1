"""``mlresearch check MODEL_DIR``: run every operator on a saved model and say which promises hold.

Each operator is run on the model (fp32, eval mode) and measured on a few inputs (random token ids
or images, or the ones given): the largest logit change relative to the largest logit, the change
of the loss (cross-entropy against the input tokens, or against random labels for images), the
round-trip error and the parameter counts. A *promise* is what the README says an operator keeps:

- width de-coalescing keeps the function, and ``coalesce(decoalesce(m)) == m``;
- width growth keeps the function;
- identity depth growth keeps the function of a pre-norm model (not of a post-norm one: reported,
  not promised).

Coalescing and depth de-coalescing (copying layers) change the function by design: measured, not
promised. The exit code is non-zero when a promised property fails.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .families import family_of
from .operators import Scheme, coalesce, decoalesce
from .operators.growth import NotLossPreservingWarning, depth_growth, width_growth

FUNCTION_TOLERANCE = 1e-4  # relative logit change allowed for a function-preserving map (fp32)
ROUND_TRIP_TOLERANCE = 1e-6  # largest parameter error of a round trip, relative to the largest parameter


@dataclass
class Row:
    operator: str
    params: int
    logit_change: float | None  # max |Δlogit| / max |logit| against the model it was mapped from
    loss_change: float | None
    promise: str  # what is promised ("" when nothing is)
    held: bool | None  # None when nothing is promised


def random_inputs(model: nn.Module, batch: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    return family_of(model).random_inputs(model, batch, seq_len, torch.Generator().manual_seed(seed))


@torch.no_grad()
def _measure(model: nn.Module, inputs: dict) -> tuple[torch.Tensor, float]:
    """(logits, loss) of ``model`` on ``inputs``."""
    model.eval()
    if "x" in inputs:
        logits = model(inputs["x"])
        labels = torch.arange(logits.shape[0]) % logits.shape[-1]
    else:
        logits = model(input_ids=inputs["input_ids"]).logits
        labels = inputs["input_ids"]
    loss = nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten()).item()
    return logits.float(), loss


def _compare(reference, model, inputs) -> tuple[float, float]:
    ref_logits, ref_loss = reference
    logits, loss = _measure(model, inputs)
    return ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item(), loss - ref_loss


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_model(model: nn.Module, scheme: Scheme | None = None, inputs: dict | None = None) -> tuple[list[Row], str]:
    """Run every operator on ``model``; returns the rows and a one-line description of the run."""
    model = model.float().eval()
    family = family_of(model)
    sizes = family.sizes(model)
    scheme = scheme or Scheme.halving(model)
    inputs = inputs or random_inputs(model)
    base = _measure(model, inputs)
    rows = [Row("(the model)", _count(model), None, None, "", None)]
    small = coalesce(model, scheme)
    rows.append(Row("coalesce", _count(small), *_compare(base, small, inputs), "", None))

    if scheme.width is not None:
        width = Scheme(width=scheme.width, kv_heads=scheme.kv_heads, ffn=scheme.ffn)
        narrow = coalesce(model, width)
        narrow_ref = _measure(narrow, inputs)
        up = decoalesce(narrow, width)
        change, loss = _compare(narrow_ref, up, inputs)
        rows.append(Row("width de-coalesce", _count(up), change, loss,
                        f"function kept (<= {FUNCTION_TOLERANCE:g})", change <= FUNCTION_TOLERANCE))
        back = coalesce(up, width)
        scale = max(p.abs().max().item() for p in narrow.parameters())
        error = max((a - b).abs().max().item() for a, b in zip(narrow.parameters(), back.parameters())) / scale
        rows.append(Row("round trip coalesce(decoalesce)", _count(back), None, None,
                        f"exact (param error {error:.1e} <= {ROUND_TRIP_TOLERANCE:g})", error <= ROUND_TRIP_TOLERANCE))
    if scheme.depth is not None:
        depth = Scheme(depth=scheme.depth)
        shallow = coalesce(model, depth)
        change, loss = _compare(_measure(shallow, inputs), decoalesce(shallow, depth), inputs)
        rows.append(Row("depth de-coalesce (copy)", _count(model), change, loss, "", None))

    grown = width_growth(model).build(model)
    change, loss = _compare(base, grown, inputs)
    rows.append(Row("grow width x2", _count(grown), change, loss, f"function kept (<= {FUNCTION_TOLERANCE:g})",
                    change <= FUNCTION_TOLERANCE))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotLossPreservingWarning)
        deep = depth_growth(model).build(model)
    change, loss = _compare(base, deep, inputs)
    pre = family.norm_position == "pre"
    rows.append(Row("grow depth x2 (identity)", _count(deep), change, loss,
                    f"function kept (<= {FUNCTION_TOLERANCE:g})" if pre else "", change <= FUNCTION_TOLERANCE if pre else None))
    what = (f"{family.name}: {sizes.layers} layers, {sizes.heads} heads ({sizes.kv_heads} key/value), hidden {sizes.hidden}, "
            f"FFN {sizes.ffn}, head_dim {sizes.head_dim}; scheme {scheme.to_dict()}")
    return rows, what


def format_rows(rows: list[Row]) -> str:
    def num(x):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2e}"

    lines = [f"{'operator':34} {'params':>12} {'max|dlogit|/max|logit|':>23} {'dloss':>10}  promise -> held"]
    for r in rows:
        verdict = "" if r.held is None else ("HELD" if r.held else "NOT HELD")
        promise = f"{r.promise} -> {verdict}" if r.promise else "(measured, not promised)"
        lines.append(f"{r.operator:34} {r.params:>12,} {num(r.logit_change):>23} {num(r.loss_change):>10}  {promise}")
    return "\n".join(lines)
