"""A NaN is never hidden: a NaN loss in evaluation is reported as NaN (a diverged model must not look fine),
and a non-finite training loss stops the run (or is skipped, if asked) before any checkpoint holds its weights."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from lightning.pytorch import Callback
from torchmetrics import MeanMetric

from mlproject.core.constants import EXIT_DIVERGED
from tests.helpers.processes import FAST, read_metrics, run, run_dirs

POISON = "+callbacks.poison._target_=tests.helpers.callbacks.PoisonLoss"


def test_eval_loss_is_the_mean_and_keeps_nan():
    """The examples' eval loss (models/classifier.py, models/gpt.py): a torchmetrics MeanMetric of per-sample (or
    per-token) losses without its NaN check (a host-device sync per update), in float64; the mean over every
    sample however they were split, and a NaN in any of them shows."""
    logits, target = torch.randn(6, 5, dtype=torch.float64), torch.tensor([1, 2, 3, 4, 4, 4])
    losses = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    split = [MeanMetric(nan_strategy="disable").set_dtype(torch.float64) for _ in range(2)]
    split[0].update(losses[:4])
    split[1].update(losses[4:])
    split[0].merge_state(split[1])  # what the sync across ranks does
    torch.testing.assert_close(split[0].compute(), losses.mean())
    split[0].update(torch.tensor([math.nan, 1.0]))
    assert split[0].compute().isnan()


class PoisonWeights(Callback):
    """Test-only: NaN weights from the second batch of every evaluation on (the first stays finite: a loss
    that dropped NaNs would then look finite)."""

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == 1:
            with torch.no_grad():
                for p in pl_module.net.parameters():
                    p.fill_(math.nan)

    on_test_batch_start = on_validation_batch_start


@pytest.mark.slow
def test_nan_loss_shows_in_logs_and_metrics_json(tmp_path):
    overrides = ["trainer.limit_train_batches=2", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]
    run(
        "train",
        *FAST,
        "trainer.max_epochs=1",
        *overrides,
        "+callbacks.nan._target_=tests.test_nan.PoisonWeights",
        log_dir=tmp_path,
    )
    (run_dir,) = run_dirs(tmp_path)
    assert math.isnan(read_metrics(run_dir)["test/loss"])
    (logged,) = run_dir.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(logged.open()) if r.get("val/loss")]
    assert rows and all(math.isnan(float(r["val/loss"])) for r in rows)


def last_checkpoint(log_dir) -> dict:
    (run_dir,) = run_dirs(log_dir)
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def error_lines(proc) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_nonfinite_loss_on_one_rank_stops_every_rank_and_keeps_the_last_good_checkpoint(tmp_path):
    """ddp on 2 processes, NaN on rank 1 at step 5. Checks every 4 steps (at 4: all finite) and a checkpoint
    every 3 steps: the save at step 6 comes before the next check and must check for itself."""
    proc = run(
        "train",
        *FAST,
        "strategy=ddp",
        "trainer.devices=2",
        "trainer.max_steps=12",
        "trainer.limit_val_batches=2",
        "test=false",
        "cluster.signal_check_every_n_steps=4",
        "callbacks.last_checkpoint.every_n_train_steps=3",
        POISON,
        "+callbacks.poison.steps=[5]",
        "+callbacks.poison.rank=1",
        log_dir=tmp_path,
        check=False,
    )
    assert proc.returncode == EXIT_DIVERGED, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert line.startswith("error: training diverged: non-finite loss at step 5;"), line
    ckpt = last_checkpoint(tmp_path)
    assert ckpt["global_step"] == 3
    assert all(v.isfinite().all() for v in ckpt["state_dict"].values() if v.is_floating_point())


@pytest.mark.slow
def test_skipped_nonfinite_steps_leave_finite_weights_up_to_the_limit(tmp_path):
    """divergence.skip: NaN losses at steps 2 and 4, at most 1 skip allowed. Step 2 is skipped and training
    goes on with finite weights (the checkpoint at step 4); the second skip is one too many."""
    proc = run(
        "train",
        *FAST,
        "trainer.max_steps=12",
        "trainer.limit_val_batches=2",
        "test=false",
        "divergence.skip=true",
        "divergence.max_skipped=1",
        "cluster.signal_check_every_n_steps=1",
        "callbacks.last_checkpoint.every_n_train_steps=2",
        POISON,
        "+callbacks.poison.steps=[2,4]",
        log_dir=tmp_path,
        check=False,
    )
    assert proc.returncode == EXIT_DIVERGED, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped 1 step(s) with a non-finite loss so far, the first at step 2" in proc.stdout + proc.stderr
    (line,) = error_lines(proc)
    expected = "error: training diverged: 2 steps with a non-finite loss skipped, more than divergence.max_skipped=1"
    assert line.startswith(expected), line
    ckpt = last_checkpoint(tmp_path)
    assert ckpt["global_step"] == 4  # after the skipped step 2 and the good step 3
    assert all(v.isfinite().all() for v in ckpt["state_dict"].values() if v.is_floating_point())
