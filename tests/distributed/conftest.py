"""Short CPU runs whose per-step global loss and final weights are compared with one process's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.processes import run, run_dirs

STEPS = 20
# fp32, fixed seed, dropout 0, the same global batch (64) on any world size; SyncBN so that BatchNorm sees
# the global batch too (plain DDP normalises each rank's half-batch on its own, a different model).
EXACT = [
    "data=digits",
    "model=digits",
    "trainer=cpu",
    "callbacks=none",
    "~logger",
    "test=false",
    "extras.print_config=false",
    f"trainer.max_steps={STEPS}",
    "trainer.max_epochs=5",
    "trainer.limit_val_batches=0",
    "+trainer.enable_progress_bar=false",
    "trainer.sync_batchnorm=true",
    "model.net.channels=8",
    "model.net.dropout=0.0",
    "+callbacks.steps._target_=tests.helpers.callbacks.RecordSteps",
]

CHECKPOINT = ["+callbacks.steps.checkpoint=true"]  # also save the final checkpoint, as run_dir/last.ckpt


def train_steps(log_dir: Path, *overrides: str, env: dict | None = None, timeout: int = 300) -> dict:
    run("train", *EXACT, *overrides, log_dir=log_dir, env=env, timeout=timeout)
    (run_dir,) = run_dirs(log_dir)
    return {**torch.load(run_dir / "steps.pt"), "run_dir": run_dir}


def assert_same_training(got: dict, ref: dict, rtol: float, atol: float) -> None:
    """Every step's global loss within rtol, and every final parameter and buffer within atol."""
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
    assert got["state"].keys() == ref["state"].keys()
    for name, value in ref["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory) -> dict:
    return train_steps(tmp_path_factory.mktemp("single"), *CHECKPOINT)
