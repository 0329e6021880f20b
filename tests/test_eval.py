"""`make eval CKPT=...` takes data and model from the checkpoint's own run; the command line still wins."""

from __future__ import annotations

import pytest

from mlproject.core.constants import CONFIG_DIR
from mlproject.train import train
from tests.helpers.processes import read_metrics, run_dirs, run_in_process

# every recipe that runs on the CPU: each names an example's data and model, none of them eval's defaults
EXPERIMENTS = [
    p.stem for p in sorted(CONFIG_DIR.glob("experiment/*.yaml")) if "override /trainer: gpu" not in p.read_text()
]
ONE_BATCH = [f"trainer.limit_{split}_batches=1" for split in ("train", "val")]


@pytest.fixture(params=EXPERIMENTS)
def checkpoint(request, compose_cfg, tmp_path):
    """A 1-step checkpoint of the recipe, trained in this process with a batch size no default has."""
    overrides = ["trainer=cpu", "trainer.max_epochs=1", "~logger", "extras.print_config=false", "test=false"]
    train(compose_cfg(f"experiment={request.param}", "data.batch_size=6", *overrides, *ONE_BATCH))
    return request.param, tmp_path / "checkpoints" / "last.ckpt"


def eval_samples(checkpoint, log_dir, *overrides: str) -> float:
    args = [f"ckpt_path={checkpoint}", "trainer=cpu", "extras.print_config=false", "trainer.limit_test_batches=2"]
    code, stderr = run_in_process("eval", *args, *overrides, log_dir=log_dir)
    assert code in (0, None), stderr
    (run_dir,) = run_dirs(log_dir, "eval")
    return read_metrics(run_dir)["test/samples"]


def test_eval_takes_data_and_model_from_the_checkpoint(checkpoint, compose_cfg, tmp_path):
    experiment, path = checkpoint
    assert eval_samples(path, tmp_path / "plain") == 2 * 6  # the checkpoint's batch size, not eval's default
    assert eval_samples(path, tmp_path / "key", "data.batch_size=4") == 2 * 4  # the command line wins
    recipe = compose_cfg(f"experiment={experiment}", config_name="eval").data.batch_size
    assert eval_samples(path, tmp_path / "recipe", f"experiment={experiment}") == 2 * recipe  # and a recipe
