"""SIGTERM to a local run (no scheduler): last.ckpt at the next optimizer step, exit 143, and `ckpt_path=auto`
continues bitwise."""

from __future__ import annotations

import pytest
import torch

from mlproject.core.constants import EXIT_SIGTERM
from tests.checkpoint.helpers import assert_bitwise, run_dir, train, weights
from tests.helpers.processes import together

# 2 epochs of 4 batches, 2 batches per optimizer step: 4 steps. The signal is checked after every step.
SETUP = [
    "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=2",
    "trainer.max_epochs=2",
    "trainer.accumulate_grad_batches=2",
    "cluster.signal_check_every_n_steps=1",
]
# SIGTERM at the end of the first batch: mid-accumulation, where no checkpoint may be taken
SIGTERM_FIRST_BATCH = [
    "+callbacks.signal._target_=tests.distributed.collectives.SendSignal",
    "+callbacks.signal.step=0",
    "+callbacks.signal.rank=0",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_saves_at_the_next_step_and_resumes_bitwise(tmp_path):
    signal_dir = tmp_path / "signal"
    signal_dir.mkdir()
    overrides = [*SETUP, "ckpt_path=auto"]
    sigterm = [*SIGTERM_FIRST_BATCH, f"+callbacks.signal.dir={signal_dir}"]
    _, proc = together(  # the straight run and the stopped one start together
        lambda: train(tmp_path, "straight", *SETUP),
        lambda: train(tmp_path, "stopped", *overrides, *sigterm, check=False),
    )
    assert proc.returncode == EXIT_SIGTERM, proc.stdout[-2000:] + proc.stderr[-2000:]
    ckpt = run_dir(tmp_path, "stopped") / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 1  # after the first optimizer step, not after the first batch
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"] == 2  # batches 0 and 1
    assert f"SIGTERM: saved {ckpt} at step 1; exiting with code 143" in proc.stdout + proc.stderr

    train(tmp_path, "stopped", *overrides)
    assert_bitwise(weights(run_dir(tmp_path, "straight") / "checkpoints" / "last.ckpt"), weights(ckpt))
