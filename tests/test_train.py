"""End-to-end runs of the entry points, as a user runs them (real processes, real data)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
import torch

from tests.helpers.processes import FAST, read_metrics, run, run_dirs


def test_default_run_is_accurate_and_quick(trained_run):
    """`make train` as shipped: >= 95% test accuracy on digits, every sample counted, in < 60 s."""
    metrics = read_metrics(trained_run)
    assert metrics["test/acc"] >= 0.95
    assert metrics["test/samples"] == 360
    names = ("acc", "f1", "auroc", "loss", "samples")
    assert set(metrics) == {f"{split}/{name}" for split in ("val", "test") for name in names}  # final val and test
    assert (trained_run / ".hydra" / "config.yaml").exists() and (trained_run / "train.log").exists()
    assert (trained_run / "csv" / "metrics.csv").exists()
    ckpts = {p.name for p in (trained_run / "checkpoints").iterdir()}
    assert "last.ckpt" in ckpts and len(ckpts) == 2  # last + the best by val/acc


def test_checkpoint_loads_with_weights_only(trained_run):
    ckpt = torch.load(trained_run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    hparams = ckpt["hyper_parameters"]
    assert hparams["net"]["_target_"] == "mlproject.models.components.cnn.SmallCNN"
    assert isinstance(hparams["optimizer"]["betas"], list)  # plain containers, not OmegaConf objects


def test_eval_reproduces_train_metrics(trained_run, tmp_path):
    """train tests the best checkpoint; eval of that same file gives the same numbers."""
    (best,) = [p for p in (trained_run / "checkpoints").iterdir() if p.name != "last.ckpt"]
    run("eval", f"ckpt_path={best}", "trainer=cpu", "extras.print_config=false", log_dir=tmp_path)
    (eval_dir,) = run_dirs(tmp_path, "eval")
    tested = {k: v for k, v in read_metrics(trained_run).items() if k.startswith("test/")}
    assert read_metrics(eval_dir) == pytest.approx(tested, abs=1e-6)


def test_fast_dev_run_without_loggers(tmp_path):
    proc = run("train", "debug=fdr", "trainer=cpu", "~logger", "extras.print_config=false", log_dir=tmp_path)
    (run_dir,) = run_dirs(tmp_path, "debug")
    assert read_metrics(run_dir)["test/samples"] == 64  # exactly one test batch
    # ~logger: no loggers, so the default LR monitor steps aside (Lightning would stop the run for it)
    assert "effective batch size 64 = 64 per device x 1 data-parallel rank(s)" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_ddp_two_processes_one_run_directory(tmp_path):
    start = time.monotonic()
    proc = run("train", *FAST, "strategy=ddp", "trainer.devices=2", log_dir=tmp_path)
    output = proc.stdout + proc.stderr
    (run_dir,) = run_dirs(tmp_path)  # both ranks wrote into one directory
    assert read_metrics(run_dir)["test/samples"] == 360
    assert "effective batch size 64 = 32 per device x 2 data-parallel rank(s)" in output
    assert "[rank 0]" in output and "[rank 1] effective" not in output  # run-level lines from rank 0 only
    assert not (tmp_path / "train" / "runs" / run_dir.name / ".hydra" / "config.yaml").read_text().count("ddp_process")
    assert time.monotonic() - start < 120


def test_make_help_lists_targets():
    out = subprocess.run(["make", "help"], capture_output=True, text=True, check=True).stdout
    listed = {line.split()[0] for line in re.sub(r"\x1b\[[0-9;]*m", "", out).splitlines() if line.strip()}
    assert {"install", "train", "eval", "test", "lint", "format", "clean"} <= listed


@pytest.mark.slow
def test_all_loggers_write_into_the_run_directory(tmp_path):
    """logger=many: every logger writes into the run directory."""
    proc = run(
        "train",
        "extras.print_config=false",
        "trainer=cpu",
        "logger=many",
        "debug=limit",
        "trainer.max_epochs=1",
        log_dir=tmp_path,
    )
    (run_dir,) = run_dirs(tmp_path, "debug")
    header = (run_dir / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"val/acc", "val/loss", "test/acc", "train/acc"} <= set(header)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    # feature: wandb
    assert "logging offline" in proc.stdout + proc.stderr
    assert list((run_dir / "wandb").glob("offline-run-*"))
    # /feature: wandb
    assert read_metrics(run_dir)["test/samples"] == 2 * 64  # limit_test_batches=2
    assert re.search(r"epoch 0/0 step 5 \[.*\] train/loss=\d", proc.stdout)  # plain line when not on a terminal
