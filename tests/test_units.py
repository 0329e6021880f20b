"""Small pieces with exact expected values."""

from __future__ import annotations

import math

import pytest
import torch

from mlproject.config import ConfigError, per_device_batch_size
from mlproject.data.base import PAD, EvalSampler, Indexed
from mlproject.models.optim import warmup_cosine


@pytest.mark.parametrize(("n", "world"), [(1, 3), (2, 3), (9, 2), (10, 2), (7, 3), (200, 3)])
def test_eval_sampler_counts_each_sample_once(n, world):
    data = list(range(n))
    shards = [list(EvalSampler(data, world, r)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of forward passes
    real = sorted(i for s in shards for i in s if i != PAD)
    assert real == data  # each sample exactly once, none repeated


def test_padding_sample_is_masked():
    x, y, idx = Indexed([(torch.ones(2), torch.tensor(3))])[PAD]
    assert idx == PAD and y.item() == -100


def test_per_device_batch_size():
    assert per_device_batch_size(64, 2, 2) == 16
    with pytest.raises(ConfigError, match="multiple of 6"):
        per_device_batch_size(64, 3, 2)


def test_warmup_cosine_schedule():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = warmup_cosine(opt, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(110):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[-1] > 0.1 and opt.param_groups[0]["lr"] == pytest.approx(0.1)
