"""Atomic writes, recovery after a crash between renames, and a clear error for a damaged checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mlproject.checkpoint.convert import checkpoint_format, load_full
from mlproject.checkpoint.resume import continue_run_of_checkpoint, resolve_ckpt_path
from mlproject.checkpoint.storage import replace_checkpoint
from mlproject.core.errors import CheckpointError
from tests.helpers.processes import run


def save(path: Path, value: float) -> None:
    torch.save({"state_dict": {"w": torch.full((4,), value)}}, path)


def shards(path: Path, value: float) -> None:
    path.mkdir()
    (path / "meta.pt").write_bytes(b"")
    (path / ".metadata").write_bytes(b"")
    (path / "__0_0.distcp").write_text(str(value))


def test_replace_files_and_directories(tmp_path):
    dst = tmp_path / "last.ckpt"
    save(tmp_path / "a", 1.0)
    replace_checkpoint(tmp_path / "a", dst)
    assert load_full(dst)["state_dict"]["w"][0] == 1.0
    shards(tmp_path / "b", 2.0)  # a sharded checkpoint replaces a file (e.g. ddp -> fsdp in one run)
    replace_checkpoint(tmp_path / "b", dst)
    assert checkpoint_format(dst) == "sharded" and (dst / "__0_0.distcp").read_text() == "2.0"
    shards(tmp_path / "c", 3.0)  # ... and a directory
    replace_checkpoint(tmp_path / "c", dst)
    assert (dst / "__0_0.distcp").read_text() == "3.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_auto_resumes_from_the_directory_moved_aside(tmp_path):
    """A crash between the two renames of a directory save leaves only last.ckpt.old: auto resumes from it."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    assert resolve_ckpt_path("auto", tmp_path) is None
    shards(ckpts / "last.ckpt.old", 1.0)
    assert resolve_ckpt_path("auto", tmp_path) == str(ckpts / "last.ckpt.old")
    shards(ckpts / "last.ckpt", 2.0)
    assert resolve_ckpt_path("auto", tmp_path) == str(ckpts / "last.ckpt")


@pytest.mark.slow
def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path):
    """A real run, SIGKILLed while the checkpoint of step 10 is half written: last.ckpt still holds step 5,
    and `ckpt_path=auto` resumes from it and leaves no partial file behind."""
    every5 = ["trainer=cpu", "extras.print_config=false", "run_id=killed", "test=false", "trainer.max_epochs=1"]
    every5.append("callbacks.last_checkpoint.every_n_train_steps=5")
    kill = ["+callbacks.kill._target_=tests.helpers.callbacks.KillMidSave", "+callbacks.kill.step=10"]
    proc = run("train", *every5, *kill, log_dir=tmp_path, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpts = tmp_path / "train" / "runs" / "killed" / "checkpoints"
    with pytest.raises(CheckpointError, match="truncated"):  # the save the kill cut short
        checkpoint_format(ckpts / "last.ckpt.tmp")
    assert load_full(ckpts / "last.ckpt")["global_step"] == 5  # the previous one, untouched
    run("train", *every5, "ckpt_path=auto", log_dir=tmp_path)
    assert load_full(ckpts / "last.ckpt")["global_step"] == 19  # one epoch of the digits
    assert not list(ckpts.glob("*.tmp"))


def test_truncated_checkpoint_is_one_clear_line(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    save(ckpt, 1.0)
    ckpt.write_bytes(ckpt.read_bytes()[:300])
    with pytest.raises(CheckpointError, match="last.ckpt is not a readable checkpoint"):
        checkpoint_format(ckpt)
    proc = run("train", f"ckpt_path={ckpt}", "trainer=cpu", "extras.print_config=false", log_dir=tmp_path, check=False)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr and str(ckpt) in last and "truncated" in last


def test_resuming_another_runs_checkpoint_continues_in_its_directory(monkeypatch):
    monkeypatch.delenv("MLPROJECT_RUN_ID", raising=False)
    continue_run_of_checkpoint(["trainer=cpu", "ckpt_path=logs/train/runs/my-run/checkpoints/last.ckpt"])
    assert os.environ["MLPROJECT_RUN_ID"] == "my-run"
    monkeypatch.delenv("MLPROJECT_RUN_ID")
    continue_run_of_checkpoint(["run_id=new", "ckpt_path=logs/train/runs/my-run/checkpoints/last.ckpt"])
    continue_run_of_checkpoint(["ckpt_path=/elsewhere/model.ckpt"])
    assert "MLPROJECT_RUN_ID" not in os.environ  # an explicit run_id wins; a foreign path names no run


# feature: deepspeed
def zero(path: Path, ranks: int, stage3: bool) -> Path:
    """The file layout of a DeepSpeed checkpoint directory (empty files: only names are read)."""
    (path / "checkpoint").mkdir(parents=True)
    (path / "latest").write_text("checkpoint")
    for r in range(ranks):
        (path / "checkpoint" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").touch()
        if stage3:
            (path / "checkpoint" / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").touch()
    if not stage3:
        (path / "checkpoint" / "mp_rank_00_model_states.pt").touch()
    return path


def test_deepspeed_engine_loads_only_its_own_layout(tmp_path):
    """The engine reads a DeepSpeed checkpoint of the same world size and ZeRO layout (stage 1 and 2 share
    one); ZeroStrategy converts any other checkpoint itself."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra")
    from mlproject.distributed.zero import loads_natively

    assert loads_natively(zero(tmp_path / "z2", 2, False), world=2, zero3=False)
    assert loads_natively(zero(tmp_path / "z3", 2, True), world=2, zero3=True)
    assert not loads_natively(tmp_path / "z2", world=1, zero3=False)
    assert not loads_natively(tmp_path / "z2", world=2, zero3=True)
    shards(tmp_path / "fsdp", 1.0)
    assert not loads_natively(tmp_path / "fsdp", world=2, zero3=False)


# /feature: deepspeed
