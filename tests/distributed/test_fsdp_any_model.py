"""FSDP and HSDP shard a model without a parallel plan (model=digits: a CNN with BatchNorm) as one unit,
and SyncBatchNorm works under both: 20 steps on CPU processes train exactly like one process."""

from __future__ import annotations

import pytest

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
