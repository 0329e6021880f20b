"""Bad input ends with one clear line naming the fix, a non-zero exit, and no traceback."""

from __future__ import annotations

import pytest

from tests.helpers.processes import clean_env, run, run_dirs, run_in_process

CASES = {
    "unknown option": (["model=resnet"], "Available options in 'model': digits"),
    "unknown key": (["trainer.max_epoch=3"], "+trainer.max_epoch=3"),
    "wrong type": (["trainer.max_epochs=ten"], "trainer.max_epochs='ten' must be of type int"),
    "batch not divisible": (["strategy=ddp", "trainer.devices=3"], "use a multiple of 3"),
    "missing checkpoint": (["ckpt_path=nope.ckpt"], "ckpt_path=nope.ckpt does not exist"),
    "single with devices": (["trainer.devices=2"], "use strategy=ddp"),
    "unsynced monitor": (["callbacks.model_checkpoint.monitor=train/loss"], "not synced across ranks"),
    "fsdp without configure_model": (["strategy=fsdp", "trainer.devices=2"], "has none; use strategy=ddp"),
    "group set to null": (["logger=null"], "use ~<group>, e.g. ~logger"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_override_gives_one_line(case, tmp_path):
    overrides, expected = CASES[case]
    code, stderr = run_in_process("train", "trainer=cpu", *overrides, "extras.print_config=false", log_dir=tmp_path)
    assert code == 2
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0]
    assert "Traceback" not in stderr
    assert not any(d.joinpath("checkpoints").exists() for d in run_dirs(tmp_path))  # nothing half-written


def test_gpu_asked_for_where_none_is_visible(tmp_path):
    """A process of its own: the host's GPUs are hidden from it, so the case holds on a GPU host too."""
    env = clean_env(CUDA_VISIBLE_DEVICES="")
    proc = run("train", "trainer=gpu", "extras.print_config=false", log_dir=tmp_path, check=False, env=env)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: trainer.accelerator=gpu but no CUDA GPU is visible; use trainer=cpu."
    ), proc.stderr


def test_eval_without_checkpoint(tmp_path):
    code, stderr = run_in_process("eval", log_dir=tmp_path)
    assert code == 2 and "ckpt_path" in stderr and "Traceback" not in stderr
