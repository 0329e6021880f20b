"""DDP over 2 CPU processes (ddp, ddp_spawn, 2 "nodes" on localhost) trains exactly like one process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mlproject.core.constants import PROJECT_ROOT
from tests.distributed.conftest import EXACT, assert_same_training, train_steps
from tests.helpers.processes import PYTHON, clean_env, free_port, run_dirs


@pytest.mark.slow
def test_ddp_two_processes_match_single_process_at_every_step(tmp_path, single_reference):
    """Same loss at each of 20 steps (1e-5 relative) and the same final weights (1e-5 absolute).

    BatchNorm is the one layer where per-rank batches change the maths; trainer.sync_batchnorm=true (on in
    both runs, a no-op for one process) makes it see the global batch, so any gap is a DDP bug: wrong
    gradient averaging, batch split, seeding, or schedule. tests/distributed/test_syncbn.py shows that
    without SyncBN the outputs differ.
    """
    got = train_steps(tmp_path, "strategy=ddp", "trainer.devices=2")
    assert_same_training(got, single_reference, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ddp_spawn_matches_single_process(tmp_path, single_reference):
    """The notebook-friendly launcher (processes started inside trainer.fit) trains the same model."""
    got = train_steps(tmp_path, "strategy=ddp_spawn", "trainer.devices=2")
    assert_same_training(got, single_reference, rtol=1e-5, atol=1e-5)


def run_nodes(commands: list[list[str]], envs: list[dict], timeout: int = 300) -> None:
    """Start every 'node' at once (they wait for each other at rendezvous) and require all to succeed."""
    procs = [
        subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in zip(commands, envs, strict=True)
    ]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]


@pytest.mark.slow
def test_two_nodes_by_env_world_2(tmp_path, single_reference):
    """NODE_RANK / MASTER_ADDR / MASTER_PORT, one process per node: one run directory, same training."""
    port = str(free_port())
    cmd = [PYTHON, "-m", "mlproject.train", *EXACT, f"paths.log_dir={tmp_path}"]
    cmd += ["strategy=ddp", "trainer.num_nodes=2", "trainer.devices=1", "run_id=two_nodes"]
    # Two "machines" share these cores: one thread each (Lightning would give each node all the cores).
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    envs = [clean_env(**env, NODE_RANK=str(r)) for r in range(2)]
    run_nodes([cmd, cmd], envs)
    (run_dir,) = run_dirs(tmp_path)
    assert_same_training(torch.load(run_dir / "steps.pt"), single_reference, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_two_nodes_by_torchrun_world_4(tmp_path, single_reference):
    """torchrun --nnodes 2 --nproc-per-node 2: 4 ranks, 16 samples each, still the single-process training."""
    port = str(free_port())
    cmds = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={r}", "--nproc-per-node=2"]
        + ["--master-addr=127.0.0.1", f"--master-port={port}", "-m", "mlproject.train", *EXACT]
        + [f"paths.log_dir={tmp_path}", "strategy=ddp", "trainer.num_nodes=2", "trainer.devices=2", "run_id=torchrun"]
        for r in range(2)
    ]
    run_nodes(cmds, [clean_env(), clean_env()])
    (run_dir,) = run_dirs(tmp_path)
    assert_same_training(torch.load(run_dir / "steps.pt"), single_reference, rtol=1e-5, atol=1e-5)
