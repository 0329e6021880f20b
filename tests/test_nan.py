"""A NaN is never hidden: a NaN loss in evaluation is reported as NaN (a diverged model must not look fine)."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from lightning.pytorch import Callback

from mlproject.models.metrics import ClassificationMetrics, LanguageModelMetrics
from tests.helpers.processes import FAST, read_metrics, run, run_dirs


def test_loss_is_the_weighted_mean_and_keeps_nan():
    metrics = LanguageModelMetrics(vocab_size=5)
    logits, target = torch.randn(2, 3, 5), torch.tensor([[1, 2, 3], [4, 4, 4]])
    valid = torch.tensor([True, False])  # the 2nd sequence is padding
    metrics.update(logits, target, valid)
    expected = torch.nn.functional.cross_entropy(logits[0], target[0]).double()
    torch.testing.assert_close(metrics.loss.compute(), expected)
    assert metrics.samples.compute() == 1
    logits[0, 0, 0] = math.nan
    metrics.update(logits, target, valid)
    assert metrics.loss.compute().isnan()

    scores = ClassificationMetrics(num_classes=3)
    one_nan = torch.tensor([[math.nan] * 3, [0.0, 1.0, 2.0]])
    scores.update(one_nan, torch.tensor([0, 1]), torch.ones(2, dtype=torch.bool))
    assert scores.loss.compute().isnan()


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
    overrides = ["+trainer.limit_train_batches=2", "+trainer.limit_val_batches=2", "+trainer.limit_test_batches=2"]
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
