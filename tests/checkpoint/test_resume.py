"""A killed run resumed with ckpt_path=auto ends bitwise equal to a straight run (CPU, fp32, same config)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.checkpoint.helpers import (
    STEPS_PER_EPOCH,
    assert_bitwise,
    assert_export_matches,
    epoch_metrics,
    kill_at,
    run_dir,
    strategy,
    train,
    wait_until_gone,
    weights,
)
from tests.helpers.processes import together

EVERY_7_STEPS = ["callbacks.last_checkpoint.every_n_train_steps=7"]
TIMEOUT = 30  # strategy.timeout (seconds) in the fault test: survivors must exit within TIMEOUT + 60 s


def straight_vs_interrupted(tmp_path, setup: list[str], kill_rank: int | None, mid_kill_rank: int | None) -> None:
    """One straight run; one killed after its epoch-2 checkpoint; one killed mid-epoch 3 with a checkpoint
    every 7 steps. Both interrupted runs resume with ckpt_path=auto under the same run_id. The three start
    together, each under a log dir of its own (whose processes the mid-epoch kill waits for)."""
    logs = {name: tmp_path / name for name in ("straight", "epoch", "mid")}

    def killed_after_epoch_2() -> None:
        # killed when epoch 3 starts, i.e. after the epoch-2 checkpoint (epochs count from 0 in the logs)
        stamp = tmp_path / "killed_at"
        kill = kill_at(2 * STEPS_PER_EPOCH, kill_rank, stamp)
        proc = train(logs["epoch"], "epoch", *setup, "ckpt_path=auto", *kill, check=False)
        assert proc.returncode != 0, "the killed run should fail"
        assert time.time() - float(stamp.read_text()) < TIMEOUT + 60, "the surviving rank should exit, not hang"
        assert weights(run_dir(logs["epoch"], "epoch") / "checkpoints" / "last.ckpt")  # the last one is intact
        train(logs["epoch"], "epoch", *setup, "ckpt_path=auto")

    def killed_mid_epoch() -> None:
        # killed mid-epoch at step 47: the last checkpoint is from step 42, 5 steps into epoch 3
        kill = kill_at(47, mid_kill_rank)
        proc = train(logs["mid"], "mid", *setup, *EVERY_7_STEPS, "ckpt_path=auto", *kill, check=False)
        assert proc.returncode != 0
        # ranks that outlive the launcher (rank 0) exit by themselves
        wait_until_gone(f"paths.log_dir={logs['mid']}", TIMEOUT + 60)
        train(logs["mid"], "mid", *setup, *EVERY_7_STEPS, "ckpt_path=auto")

    together(lambda: train(logs["straight"], "straight", *setup), killed_after_epoch_2, killed_mid_epoch)
    straight, epoch, mid = (run_dir(log_dir, name) for name, log_dir in logs.items())
    assert_bitwise(weights(straight / "checkpoints" / "last.ckpt"), weights(epoch / "checkpoints" / "last.ckpt"))
    assert epoch_metrics(epoch) == epoch_metrics(straight)
    assert_bitwise(weights(straight / "checkpoints" / "last.ckpt"), weights(mid / "checkpoints" / "last.ckpt"))
    # train/acc of the epoch resumed mid-way counts its batches from before the kill too (RunState)
    assert epoch_metrics(mid) == epoch_metrics(straight)

    assert_export_matches(straight / "checkpoints" / "last.ckpt", tmp_path / "model.pt", torch.rand(8, 1, 8, 8))


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 5 (ddp: 10) processes, 3 at a time; slow on a loaded machine
def test_single_resume_is_bitwise(tmp_path):
    straight_vs_interrupted(tmp_path, strategy("single"), kill_rank=None, mid_kill_rank=None)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 5 (ddp: 10) processes, 3 at a time; slow on a loaded machine
def test_ddp_resume_is_bitwise_after_one_rank_dies(tmp_path):
    """ddp on 2 processes: the first interruption SIGKILLs rank 1 only, the second rank 0 only (the launcher);
    each time the other rank must exit within strategy.timeout + 60 s, not hang."""
    setup = [*strategy("ddp", 2), f"strategy.timeout={TIMEOUT}"]
    straight_vs_interrupted(tmp_path, setup, kill_rank=1, mid_kill_rank=0)
