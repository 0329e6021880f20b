"""The checkpoint tests' S3 endpoint: moto's standalone server on 127.0.0.1, started per test, with the real
s3fs client and the endpoint given the standard way (AWS_ENDPOINT_URL); credentials only from the environment."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import free_port

BUCKET = "ckpts"


@pytest.fixture
def s3(monkeypatch):
    """moto's server on a free port of 127.0.0.1 with one bucket; the environment every child run inherits."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        for key, value in {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(key, value)
        import s3fs

        # fsspec caches filesystems by their arguments, not the endpoint the environment names: this test's
        # in-process reads (load_full) would reach the previous test's server
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield fs
    finally:
        server.terminate()
        server.wait(timeout=30)


def net_weights(state_dict: dict) -> dict:
    return {k.removeprefix("net."): v for k, v in state_dict.items() if k.startswith("net.")}


def ckpt_dir(name: str) -> list[str]:
    return [f"paths.ckpt_dir=s3://{BUCKET}/{name}"]
