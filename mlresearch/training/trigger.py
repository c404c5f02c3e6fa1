"""When to grow or stop (staged training, B.6): the slope of log10(validation loss) against
log10(compute), smoothed by a 5-point running mean. Once past its steepest point, the first
point whose slope rises above a threshold is where to act:

    width growth -0.0475, depth growth -0.0575, both -0.03, stop (optimality) -0.052.
"""

from __future__ import annotations

import numpy as np

THRESHOLDS = {"width": -0.0475, "depth": -0.0575, "depth_width": -0.03, "optimality": -0.052}


def loglog_slope(compute, loss, window: int = 5) -> np.ndarray:
    """d log10(loss) / d log10(compute) at every point, smoothed by a centred running mean."""
    c, l = np.asarray(compute, float), np.asarray(loss, float)
    if c.shape != l.shape or c.ndim != 1 or len(c) < 3:
        raise ValueError("compute and loss must be 1-D sequences of the same length (at least 3 points)")
    if np.any(c <= 0) or np.any(l <= 0) or np.any(np.diff(c) <= 0):
        raise ValueError("compute must be positive and increasing, loss positive")
    slope = np.gradient(np.log10(l), np.log10(c))
    if window > 1:
        kernel = np.ones(window) / window
        pad = window // 2
        padded = np.pad(slope, (pad, window - 1 - pad), mode="edge")
        slope = np.convolve(padded, kernel, mode="valid")
    return slope


def trigger_index(compute, loss, threshold: float | str, window: int = 5) -> int | None:
    """Index of the first point after the steepest slope where the slope exceeds ``threshold``."""
    t = THRESHOLDS[threshold] if isinstance(threshold, str) else float(threshold)
    slope = loglog_slope(compute, loss, window)
    steepest = int(np.argmin(slope))
    after = np.nonzero(slope[steepest:] > t)[0]
    return steepest + int(after[0]) if len(after) else None


def advise(compute, loss, grow: str | None = "width", window: int = 5) -> str:
    """``"grow"`` once the slope reaches ``grow``'s threshold (``None``: the final model, which is
    told ``"stop"`` at the optimality threshold), else ``"continue"``."""
    key = grow or "optimality"
    return ("grow" if grow else "stop") if trigger_index(compute, loss, key, window) is not None else "continue"
