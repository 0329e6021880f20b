"""A checkpoint monitor that differs across ranks (a rank's own step loss) stops the run at the first validation,
on every rank, with one line; a torchmetrics value (val/acc, the default) goes through."""

from __future__ import annotations

import pytest

from tests.helpers.processes import FAST, run


@pytest.mark.slow
def test_a_monitor_that_differs_across_ranks_is_refused_in_one_line(tmp_path):
    limits = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=2", "test=false"]
    overrides = [*FAST, *limits, "trainer.devices=2", "callbacks.model_checkpoint.monitor=train/loss"]
    proc = run("train", *overrides, log_dir=tmp_path, check=False)
    assert proc.returncode != 0
    assert "a callback monitors 'train/loss', which differs across ranks" in proc.stdout + proc.stderr
