"""The schedule of a real run on the digits example counts optimizer steps, and the run prints the scaled LR."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from mlproject.train import train
from mlproject.training.optim import warmup_cosine

LRS: list[float] = []  # what RecordLR saw in the last in-process run


class RecordLR(Callback):
    """The LR of every optimizer step, read just before the step."""

    def on_fit_start(self, trainer, pl_module):
        LRS.clear()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        LRS.append(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("accumulate", [1, 4])
def test_the_run_prints_the_scaled_lr_and_the_schedule_counts_optimizer_steps(compose_cfg, caplog, accumulate):
    """digits, trainer=cpu, one process: the global batch of 64 whatever the accumulation, so the same LR;
    warmup and the cosine are counted in optimizer steps."""
    cfg = compose_cfg(
        "trainer=cpu",
        "data=digits",
        "model=digits",
        "extras.print_config=false",
        "callbacks=none",
        "+callbacks.lr._target_=tests.test_lr_schedule.RecordLR",
        "logger=csv",
        "test=false",
        "trainer.max_epochs=2",
        "trainer.limit_val_batches=0",
        f"trainer.accumulate_grad_batches={accumulate}",
        "data.batch_size=64",
        "model.optimizer.lr_scaling=sqrt",
        "model.optimizer.base_batch_size=16",
        "model.scheduler.warmup_fraction=0.25",
    )
    with caplog.at_level(logging.INFO, logger="mlproject.training.optim"):
        train(cfg)
    micro = 64 // accumulate
    # 2 epochs of the 1,237 training digits in whole micro-batches; Lightning also steps on an epoch's last,
    # incomplete accumulation (77 micro-batches of 16 make 20 optimizer steps)
    steps = 2 * math.ceil((1797 - 200 - 360) // micro / accumulate)
    assert len(LRS) == steps
    lr = 0.005 * math.sqrt(64 / 16)
    line = f"effective batch 64 ({micro} per device x 1 data-parallel rank(s) x {accumulate} accumulation); "
    line += f"lr {lr:.6g} = 0.005 x sqrt(64/16); warmup {round(0.25 * steps)} of {steps} optimizer steps"
    assert line in caplog.text
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = warmup_cosine(opt, steps, round(0.25 * steps), min_lr_ratio=0.05)
    expected = []
    for _ in range(steps):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert pytest.approx(expected, rel=1e-12) == LRS  # one schedule step per optimizer step
