"""A MASTER_PORT that another program holds ends the run before any rank starts, in one line naming the port and
the variable; a port that a finished run left in TIME_WAIT is free, as it is for the rendezvous store."""

from __future__ import annotations

import socket

import pytest

from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology
from mlproject.distributed.launch import check_master_port
from tests.helpers.processes import clean_env, run, run_dirs

DDP = ["trainer=cpu", "strategy=ddp", "trainer.devices=2"]  # refused before any rank starts: any example
FIX = "set MASTER_PORT to a free port, or unset it to have one picked"


def test_master_port_in_use_is_refused_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        proc = run("train", *DDP, log_dir=tmp_path, env=clean_env(MASTER_PORT=str(port)), check=False)
    assert proc.returncode == 2
    assert proc.stderr == f"error: MASTER_PORT={port} cannot be listened on here (address already in use); {FIX}.\n"
    assert not run_dirs(tmp_path)


def test_port_of_a_finished_run_is_free(compose_cfg, monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            server.accept()[0].close()  # the server's side closes first: its port stays in TIME_WAIT
            client.recv(1)
    with socket.socket() as plain, pytest.raises(OSError, match="in use"):
        plain.bind(("", port))  # TIME_WAIT indeed: a bind without SO_REUSEADDR is refused
    for var in (
        "LOCAL_RANK",
        "RANK",
        "NODE_RANK",
        "GROUP_RANK",
        # feature: slurm
        "SLURM_NTASKS",
        # /feature: slurm
    ):
        monkeypatch.delenv(var, raising=False)
    cfg = compose_cfg(*DDP)
    monkeypatch.setenv("MASTER_PORT", str(port))
    check_master_port(cfg, Topology.of(cfg))  # no error
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ConfigError) as refused:
        check_master_port(cfg, Topology.of(cfg))
    assert str(refused.value) == f"MASTER_PORT='http' is not a port number; {FIX}"
