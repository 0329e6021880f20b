"""Gradient accumulation under DDP all-reduces gradients once per optimizer step, not once per micro-batch.

Lightning runs the other micro-batches' backward under DDP's `no_sync`; this counts the all-reduces of a real
2-process run (tests/helpers/callbacks.py: CountGradientAllReduces).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.processes import FAST, run


@pytest.mark.slow
def test_one_gradient_all_reduce_per_optimizer_step(tmp_path):
    path = tmp_path / "counts.pt"
    run(
        "train",
        *FAST,
        "trainer.max_epochs=1",
        "strategy=ddp",
        "trainer.devices=2",
        "trainer.accumulate_grad_batches=4",
        "trainer.limit_train_batches=16",  # 16 micro-batches: 4 optimizer steps
        "trainer.limit_val_batches=0",
        "test=false",
        "callbacks=none",
        "+callbacks.count._target_=tests.helpers.callbacks.CountGradientAllReduces",
        f"+callbacks.count.path={path}",
        log_dir=tmp_path,
    )
    counts = dict(torch.load(path))
    assert sorted(counts) == list(range(16))
    buckets = counts[3]  # the digits CNN fits in one 25 MiB bucket
    assert buckets == 1
    assert counts == {i: buckets if i % 4 == 3 else 0 for i in range(16)}  # the last micro-batch of each step only
