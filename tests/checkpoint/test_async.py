"""Asynchronous saves (callbacks.model_checkpoint.async_save=true): the writer thread's guarantees in one
process, and a real run killed while saves are in flight resuming bitwise. The existing proofs run with
async saves too: MLPROJECT_TEST_ASYNC_SAVE=1 pytest tests/checkpoint/test_resume.py (helpers.train)."""

from __future__ import annotations

import threading

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from mlproject.checkpoint.convert import checkpoint_format
from mlproject.checkpoint.storage import AsyncCheckpointIO, replace_checkpoint, snapshot
from tests.checkpoint.helpers import (
    STEPS_PER_EPOCH,
    assert_bitwise,
    kill_at,
    run_dir,
    strategy,
    train,
    weights,
)
from tests.helpers.processes import together

ASYNC_EVERY_STEP = ["callbacks.model_checkpoint.async_save=true", "callbacks.last_checkpoint.every_n_train_steps=1"]


class GatedIO(TorchCheckpointIO):
    """Writes only once the test opens the gate: a save provably in flight."""

    def __init__(self):
        self.gate = threading.Event()

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.gate.wait(timeout=60)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_snapshot_is_a_copy_that_keeps_shared_storage():
    weight = torch.arange(6.0)
    checkpoint = {"state_dict": {"a": weight, "tied": weight.view(2, 3)}, "step": [torch.tensor(1), 2]}
    copy = snapshot(checkpoint)
    weight.add_(100)  # training goes on
    assert torch.equal(copy["state_dict"]["a"], torch.arange(6.0))
    assert (
        copy["state_dict"]["tied"].untyped_storage().data_ptr() == copy["state_dict"]["a"].untyped_storage().data_ptr()
    )
    assert copy["step"][1] == 2


def test_write_rename_and_removal_run_in_order_after_the_loop_moved_on(tmp_path):
    gated = GatedIO()
    io = AsyncCheckpointIO(gated)
    last, old_best = tmp_path / "last.ckpt", tmp_path / "epoch_000.ckpt"
    torch.save({"step": 1}, last)
    torch.save({"step": 0}, old_best)
    weight = torch.zeros(3)

    io.save_checkpoint({"w": weight}, f"{last}.tmp")  # returns at once: the write waits for the gate
    io.then(replace_checkpoint, f"{last}.tmp", last)
    io.remove_checkpoint(old_best)  # retention: only once the new checkpoint is in place
    weight.add_(1)
    assert torch.load(last)["step"] == 1 and old_best.exists()  # the previous checkpoints stay meanwhile
    gated.gate.set()
    io.teardown()  # what Strategy.teardown calls: everything flushed
    assert torch.equal(torch.load(last)["w"], torch.zeros(3))  # the state when saved, not after
    assert not old_best.exists() and not (tmp_path / "last.ckpt.tmp").exists()


class FullDiskIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        raise OSError(28, "No space left on device")


def test_a_failed_write_keeps_the_previous_checkpoint_and_is_raised(tmp_path):
    io = AsyncCheckpointIO(FullDiskIO())
    last = tmp_path / "last.ckpt"
    torch.save({"step": 1}, last)
    io.save_checkpoint({"w": torch.zeros(1)}, f"{last}.tmp")
    io.then(replace_checkpoint, f"{last}.tmp", last)  # skipped: the write failed
    with pytest.raises(OSError, match="No space left"):
        io.wait()  # the next save (or teardown) raises it
    assert torch.load(last)["step"] == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_killed_with_saves_in_flight_resumes_bitwise(tmp_path):
    """A save every step, so that each kill (at steps 25 and 47) lands with a write in flight. What is left
    under last.ckpt is a complete checkpoint, and the resumed run ends as the straight run does."""
    setup = [*strategy("single"), *ASYNC_EVERY_STEP]

    def killed_twice():
        for step in (STEPS_PER_EPOCH + 6, 2 * STEPS_PER_EPOCH + 9):
            proc = train(tmp_path, "killed", *setup, "ckpt_path=auto", *kill_at(step), check=False)
            assert proc.returncode != 0
            checkpoint_format(run_dir(tmp_path, "killed") / "checkpoints" / "last.ckpt")  # complete, not torn
        train(tmp_path, "killed", *setup, "ckpt_path=auto")

    together(lambda: train(tmp_path, "straight", *strategy("single")), killed_twice)
    assert_bitwise(
        weights(run_dir(tmp_path, "straight") / "checkpoints" / "last.ckpt"),
        weights(run_dir(tmp_path, "killed") / "checkpoints" / "last.ckpt"),
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp_run_killed_with_a_dcp_async_save_in_flight_resumes_bitwise(tmp_path):
    """strategy=fsdp on 2 processes (the digits CNN, sharded as one unit): shards written by
    torch.distributed.checkpoint.async_save, one every step; killed at step 9 of 18, resumed with ckpt_path=auto,
    it ends as the straight (sync) run does."""
    fsdp = [*strategy("fsdp", 2), "trainer.limit_train_batches=6"]  # 6 steps per epoch, 18 in all
    setup = [*fsdp, *ASYNC_EVERY_STEP]

    def killed():
        proc = train(tmp_path, "killed", *setup, "ckpt_path=auto", *kill_at(9), check=False)
        assert proc.returncode != 0
        assert checkpoint_format(run_dir(tmp_path, "killed") / "checkpoints" / "last.ckpt") == "sharded"
        train(tmp_path, "killed", *setup, "ckpt_path=auto")

    together(lambda: train(tmp_path, "straight", *fsdp), killed)
    assert_bitwise(
        weights(run_dir(tmp_path, "straight") / "checkpoints" / "last.ckpt"),
        weights(run_dir(tmp_path, "killed") / "checkpoints" / "last.ckpt"),
    )
