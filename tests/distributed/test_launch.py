"""Launches that cannot work fail before any process starts, with one line that says how to fix them."""

from __future__ import annotations

import pytest

from tests.conftest import run


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["hydra.mode=MULTIRUN", "strategy=ddp", "trainer.devices=2", "seed=1,2"], "cannot use strategy=ddp"),
        (["strategy=ddp", "trainer.num_nodes=2"], "pass the same run_id=<name> on every node"),
        (["strategy=deepspeed_stage_2", "trainer.precision=bf16-true"], "DeepSpeed keeps fp32 master weights"),
        (["strategy=deepspeed_stage_3_offload"], "on CPU use strategy=deepspeed_stage_3"),
    ],
    ids=["multirun-ddp", "nodes-without-run-id", "deepspeed-bf16-true", "offload-on-cpu"],
)
def test_impossible_launches_fail_up_front_with_one_line(tmp_path, overrides, message):
    proc = run("train", "trainer=cpu", *overrides, log_dir=tmp_path, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert not list(tmp_path.rglob("*.ckpt"))
