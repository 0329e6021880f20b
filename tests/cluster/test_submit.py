"""`mlproject.submit` without a cluster: the script it writes, and the settings it refuses before sbatch."""

from __future__ import annotations

import os
import shlex

import pytest

from mlproject import submit
from mlproject.cluster.slurm import RENDEZVOUS, check_in_job
from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology
from tests.cluster import NO_PLAN

GPU_4X8 = ["cluster.nodes=4", "cluster.gpus_per_node=8", "trainer=gpu", "strategy=ddp", "data.batch_size=256"]


def test_dry_run_four_nodes_of_eight_gpus(capsys, compose_cfg, no_sbatch):
    assert submit.main(["--dry-run", *GPU_4X8]) == 0
    script = capsys.readouterr().out
    header = {line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")}
    assert {"--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--signal=USR1@120", "--requeue"} <= header
    assert all(line in script.splitlines() for line in RENDEZVOUS)
    assert "# trainer.num_nodes=4 trainer.devices=8: 32 processes" in script
    # The job runs train with these overrides in every task; composed as it will, the Trainer agrees with the header.
    srun = shlex.split(script.splitlines()[-1])
    assert srun[:2] == ["srun", "--kill-on-bad-exit=1"]
    overrides = srun[srun.index("mlproject.train") + 1 :]
    assert overrides[0] == "cluster=slurm" and "ckpt_path=auto" in overrides
    cfg = compose_cfg(*overrides)
    assert (cfg.trainer.num_nodes, cfg.trainer.devices, Topology.of(cfg).world_size) == (4, 8, 32)
    assert cfg.callbacks.requeue._target_ == "mlproject.cluster.slurm_requeue.Requeue"
    assert cfg.trainer.plugins[0].auto_requeue is False  # one requeue owner: the callback


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.devices=4", "trainer.devices=4 but cluster.tasks_per_node=8"),
        ("trainer.num_nodes=2", "trainer.num_nodes=2 but cluster.nodes=4"),
        ("cluster.tasks_per_node=4", "one process per GPU"),
        ("trainer=cpu", "use trainer=gpu"),
        ("strategy=single", "use strategy=ddp"),
        ("data.batch_size=100", "must divide by world size 32"),
        ("cluster.nodes=two", "cluster.nodes='two' should be a whole number >= 1"),
    ],
)
def test_mismatch_is_refused_before_submission(capsys, no_sbatch, override, message):
    assert submit.main([*GPU_4X8, override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_submit_needs_a_scheduler(capsys, no_sbatch):
    assert submit.main(["cluster=local"]) == 2
    assert "use cluster=slurm" in capsys.readouterr().err


def test_train_with_cluster_slurm_outside_a_job_is_refused(compose_cfg, monkeypatch):
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    cfg = compose_cfg("cluster=slurm", "cluster.gpus_per_node=0", "cluster.tasks_per_node=2", "trainer=cpu")
    with pytest.raises(ConfigError, match="mlproject.submit"):
        check_in_job(cfg)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    check_in_job(cfg)  # inside an srun task it is fine


@pytest.mark.parametrize(("override", "run_id"), [([], "4242"), (["run_id=abc"], "abc")], ids=["job", "given"])
def test_submit_names_the_directories_the_job_writes(capsys, tmp_path, monkeypatch, override, run_id):
    """A stand-in sbatch on PATH keeps the script and answers job id 4242: the script's log path keeps a '%' of
    paths.log_dir literal (sbatch reads %<letter> in it), and the run directory printed is the job's."""
    bin_dir, log_dir = tmp_path / "bin", tmp_path / "100%"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ncat > {tmp_path}/job.sh\necho 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert submit.main([*NO_PLAN, "trainer=gpu", f"paths.log_dir={log_dir}", *override]) == 0
    assert f"#SBATCH --output={tmp_path}/100%%/train/slurm/%j.out\n" in (tmp_path / "job.sh").read_text()
    assert capsys.readouterr().out == (
        f"submitted SLURM job 4242\n  log: {log_dir}/train/slurm/4242.out\n"
        f"  run directory: {log_dir}/train/runs/{run_id}\n"
    )
