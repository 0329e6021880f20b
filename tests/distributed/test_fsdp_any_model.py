"""FSDP and HSDP shard a model without a parallel plan (model=digits: a CNN with BatchNorm) as one unit,
and SyncBatchNorm works under both: 20 steps on CPU processes train exactly like one process."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import assert_same_training, train_steps


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=fsdp", "trainer.devices=2"],
        ["strategy=hsdp", "trainer.devices=4", "strategy.replicate_size=2"],
    ],
    ids=["fsdp", "hsdp"],
)
def test_sharded_cnn_with_syncbn_matches_single_process(tmp_path, single_reference, overrides):
    """The loss of every step within 1e-5 relative and every final parameter and BatchNorm buffer within
    1e-5 absolute, as DDP (tests/distributed/test_ddp.py). Lightning's ModelParallelStrategy skips the layer
    sync, so without ours BatchNorm would see each rank's share of the batch and the runs would differ."""
    got = train_steps(tmp_path, *overrides)
    assert_same_training(got, single_reference, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bf16_fsdp_keeps_batchnorm_fp32_and_trains_like_one_process(tmp_path, single_reference):
    """bf16 parameters (trainer=gpu's fsdp default) with BatchNorm, whose fp32 running statistics refuse bf16
    weights (seen on an H200): BatchNorm is a unit of its own kept in fp32, and the losses follow the fp32 single
    process to bf16's precision."""
    bf16 = ["trainer.precision=bf16-mixed", "strategy.fsdp.param_dtype=bfloat16"]
    got = train_steps(tmp_path, "strategy=fsdp", "trainer.devices=2", *bf16)
    losses, ref = torch.tensor(got["losses"]), torch.tensor(single_reference["losses"])
    torch.testing.assert_close(losses, ref, rtol=0.01, atol=0)  # measured: 0.1% at most
