"""Resume checkpoints (last.ckpt, every N steps) and best-by-metric checkpoints never compete: the best are
ranked only right after a validation, and the test after fit says which checkpoint it loads and why."""

from __future__ import annotations

import csv
import re

import pytest
import torch

from tests.checkpoint.helpers import run_dir, train

# 3 epochs of 5 optimizer steps, a resume checkpoint every 2 steps: most of them fall between validations
SHORT = ["trainer.limit_train_batches=5", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]
SHORT += ["data.batch_size=16"]  # small steps for the GPT of a GPT-only project too
EVERY_2_STEPS = "callbacks.last_checkpoint.every_n_train_steps=2"


def step_of(ckpt) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]


def val_acc_by_step(run) -> dict[int, float]:
    """val/acc by the optimizer steps done when it was measured (the csv row's step is the last step's index)."""
    with open(run / "csv" / "metrics.csv") as f:
        return {int(row["step"]) + 1: float(row["val/acc"]) for row in csv.DictReader(f) if row.get("val/acc")}


def test_best_is_ranked_on_its_own_validation_and_tested(tmp_path):
    """With step checkpoints between validations, the tested checkpoint is the one whose validation scored
    best, never a later step's weights ranked on an earlier (stale) validation."""
    proc = train(tmp_path, "steps", *SHORT, EVERY_2_STEPS, test=True)
    run = run_dir(tmp_path, "steps")
    said = re.search(r"testing (\S+): the best by val/acc \(([\d.]+) at its validation\)", proc.stdout)
    tested, score = said.groups()
    validations = val_acc_by_step(run)
    assert sorted(validations) == [5, 10, 15]
    assert step_of(tested) in validations  # saved right after a validation
    assert validations[step_of(tested)] == max(validations.values()) == pytest.approx(float(score), abs=1e-4)
    assert step_of(run / "checkpoints" / "last.ckpt") == 15  # the resume checkpoint holds the end of training
    assert len(list((run / "checkpoints").iterdir())) == 2  # last.ckpt and the one best: no step checkpoints ranked


def test_without_validation_the_last_checkpoint_is_tested(tmp_path):
    proc = train(tmp_path, "noval", *SHORT, "trainer.limit_val_batches=0", "trainer.max_epochs=1", test=True)
    last = run_dir(tmp_path, "noval") / "checkpoints" / "last.ckpt"
    assert f"testing {last}: the last checkpoint: none was ranked by a metric (no validation ran)" in proc.stdout
    assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]
