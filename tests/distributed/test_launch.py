"""Launches that cannot work fail before any process starts, with one line that says how to fix them; the
local ranks of a launch that can start early and end with the job."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from mlproject.distributed.launch import EXTERNAL_RANK_VARS, launched_externally
from tests.helpers.processes import run, run_dirs, run_in_process


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=ddp", "trainer.num_nodes=2"], "pass the same run_id=<name> on every node"),
        (["strategy=ddp", "trainer.num_nodes=2", "run_id=x"], "but MASTER_ADDR and NODE_RANK not set"),
        # feature: deepspeed
        (["strategy=deepspeed_stage_2", "trainer.precision=bf16-true"], "DeepSpeed keeps fp32 master weights"),
        (["strategy=deepspeed_stage_2", "trainer.precision=bf16-mixed"], "bf16 without autocast"),
        (["strategy=deepspeed_stage_3_offload"], "already are; use strategy=deepspeed_stage_3"),
        # /feature: deepspeed
    ],
    ids=[
        "nodes-without-run-id",
        "nodes-without-rendezvous",
        # feature: deepspeed
        "deepspeed-bf16-true",
        "deepspeed-bf16-on-cpu",
        "offload-on-cpu",
        # /feature: deepspeed
    ],
)
def test_impossible_launches_fail_up_front_with_one_line(tmp_path, overrides, message):
    code, stderr = run_in_process("train", "trainer=cpu", *overrides, log_dir=tmp_path)
    assert code == 2, stderr[-2000:]
    assert message in stderr
    assert not list(tmp_path.rglob("*.ckpt"))


TINY = [  # two optimizer steps of a small model, nothing else
    "trainer=cpu",
    "strategy=ddp",
    "trainer.devices=2",
    "callbacks=none",
    "~logger",
    "test=false",
    "extras.print_config=false",
    "trainer.max_steps=2",
    "trainer.limit_val_batches=0",
    "+trainer.enable_progress_bar=false",
    "model.net.channels=8",
]


def probe(path: Path) -> list[str]:
    return ["+callbacks.startup._target_=tests.distributed.startup.StartupTimes", f"+callbacks.startup.path={path}"]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads process start times from /proc")
def test_local_ranks_start_before_rank_0_builds_its_trainer(tmp_path):
    """strategy=ddp: rank 0 starts rank 1 right after preflight, not inside trainer.fit (Lightning's
    launcher): rank 1 is already running when rank 0 builds its callbacks, and both write one run directory."""
    run("train", *TINY, *probe(tmp_path / "startup"), log_dir=tmp_path, timeout=120, cold=True)
    ranks = [json.loads((tmp_path / "startup" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    assert ranks[1]["ppid"] == ranks[0]["pid"]  # rank 0 started rank 1 ...
    assert ranks[1]["pid"] in ranks[0]["children_when_built"]  # ... before it had a Trainer
    assert ranks[1]["started"] < ranks[0]["built"]
    (run_dir,) = run_dirs(tmp_path)
    assert {p.name for p in run_dir.glob("*.log")} == {"train.log", "train_ddp_process_1.log"}
    assert [p.parent for p in tmp_path.rglob(".hydra")] == [run_dir]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_rank_ends_the_job_at_once(tmp_path, rank):
    """Rank 1 SIGKILLed: rank 0 sees it within a second and exits non-zero. Rank 0 SIGKILLed: the kernel
    kills rank 1 (PR_SET_PDEATHSIG). Neither waits for strategy.timeout (300 s here)."""
    stamp = tmp_path / "killed_at"
    kill = ["+callbacks.kill._target_=tests.helpers.callbacks.KillAt", "+callbacks.kill.step=1"]
    kill += [f"+callbacks.kill.rank={rank}", f"+callbacks.kill.stamp={stamp}", "strategy.timeout=300"]
    proc = run("train", *TINY, *probe(tmp_path / "startup"), *kill, log_dir=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0
    if rank == 1:
        assert "error: local rank 1" in proc.stderr and "exited with code -9" in proc.stderr
    child = json.loads((tmp_path / "startup" / "rank1.json").read_text())["pid"]
    while alive(child) and time.time() < float(stamp.read_text()) + 20:
        time.sleep(0.1)
    assert not alive(child)
    assert time.time() - float(stamp.read_text()) < 20


LAUNCHER_VARS = [
    *EXTERNAL_RANK_VARS,
    # feature: slurm
    "SLURM_NTASKS",  # srun's
    # /feature: slurm
]


@pytest.mark.parametrize("var", LAUNCHER_VARS)
def test_ranks_started_by_another_launcher_start_none_themselves(monkeypatch, var):
    """Under another launcher (torchrun, MPI, jsrun, ...) every rank is started already: none may start more."""
    for v in LAUNCHER_VARS:
        monkeypatch.delenv(v, raising=False)
    assert not launched_externally()
    monkeypatch.setenv(var, "2")
    assert launched_externally()
