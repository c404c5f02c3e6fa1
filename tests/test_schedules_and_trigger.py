"""LR restart after growth (staged training B.5) and the slope-based growth trigger (B.6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlresearch.training.schedules import CONSTANT_OP, Restart, WarmupDecay, restart_step
from mlresearch.training.trigger import THRESHOLDS, advise, loglog_slope, trigger_index

BASE = WarmupDecay(warmup=3000, total=250_000)


def test_restart_multiplier_worked_numbers():
    sched = Restart(BASE, restart_step=3319, rewarmup=200)
    assert sched(3318) == pytest.approx(0.9987, abs=1e-4)  # the base schedule before S_r
    assert sched(3319) == 0.0
    assert sched(3419) == pytest.approx(0.499, abs=1e-3)
    assert sched(3519) == pytest.approx(0.9979, abs=1e-4)
    for t in range(3319, 3519):  # linear ramp towards base(S_r + W_r)
        assert sched(t) == pytest.approx((t - 3319) / 200 * BASE(3519), abs=1e-12)
    for t in (3519, 3600, 10_000, 250_000):
        assert sched(t) == BASE(t)
    depth = Restart(BASE, restart_step=4449, rewarmup=150)
    assert depth(4449) == 0.0 and depth(4599) == pytest.approx(0.9935, abs=1e-4)


def test_restart_is_continuous_at_the_end_of_rewarmup():
    sched = Restart(WarmupDecay(100, 1000, kind="cosine"), restart_step=300, rewarmup=50)
    assert abs(sched(349) + (sched(349) - sched(348)) - sched(350)) < 1e-3


def test_constant_op_rule():
    assert restart_step(6249, "depth") == round(6249 / 1.412)
    assert restart_step(5894, "width") == round(5894 / CONSTANT_OP["width"])


def test_a_phase_reentering_the_schedule_drives_an_optimizer():
    """The engine's phase after growth: the base schedule entered at step 3319 through a 200-step
    re-warm-up, as a LambdaLR counting from 0."""
    from mlresearch.training.phase import Phase

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    phase = Phase("stage1", 2, 201, 0.1, BASE.warmup, horizon=BASE.total, start=3319, rewarmup=200)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, phase.schedule(BASE.kind, BASE.floor))
    lrs = []
    for _ in range(201):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[100] == pytest.approx(0.1 * 0.499, abs=1e-4)
    assert lrs[200] == pytest.approx(0.1 * BASE(3519))


def test_schedule_validation():
    with pytest.raises(ValueError, match="warmup"):
        WarmupDecay(warmup=10, total=5)
    with pytest.raises(ValueError, match="kind"):
        WarmupDecay(warmup=1, total=5, kind="step")


def power_law(compute, a=0.3, c0=1e3, floor=1.5):
    return (c0 / compute) ** a + floor


def test_slope_of_a_power_law_matches_the_analytic_slope():
    c = np.logspace(2, 8, 400)
    loss = power_law(c)
    analytic = -0.3 * (1e3 / c) ** 0.3 / loss
    np.testing.assert_allclose(loglog_slope(c, loss, window=1)[1:-1], analytic[1:-1], atol=2e-3)


@pytest.mark.parametrize("key", sorted(THRESHOLDS))
def test_trigger_fires_where_the_analytic_slope_crosses_the_threshold(key):
    c = np.logspace(0, 12, 600)
    loss = power_law(c)
    idx = trigger_index(c, loss, key)
    t = THRESHOLDS[key]
    # -a u / (u + floor) = t with u = (c0/c)^a  ->  u = -t floor / (a + t)
    u = -t * 1.5 / (0.3 + t)
    crossing = 1e3 / u ** (1 / 0.3)
    assert idx is not None
    assert abs(np.log10(c[idx]) - np.log10(crossing)) < 0.05


def test_advise():
    c = np.logspace(0, 3, 50)
    assert advise(c, power_law(c, c0=1e6), grow="width") == "continue"  # still steep
    c = np.logspace(0, 12, 200)
    assert advise(c, power_law(c), grow="depth") == "grow"
    assert advise(c, power_law(c), grow=None) == "stop"
    with pytest.raises(ValueError, match="increasing"):
        loglog_slope([3, 2, 1], [1, 1, 1])
