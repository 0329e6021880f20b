"""An object-storage endpoint that is unreachable from the start, or goes down under a run, ends it in one line
naming the path and the cause, leaves no partial checkpoint and keeps the previous one (as test_storage_errors.py's
full disk and read-only folder)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from mlproject.checkpoint.convert import load_full
from tests.checkpoint.conftest import BUCKET
from tests.checkpoint.test_storage_errors import EVERY_2, fault, one_line
from tests.helpers.processes import clean_env, free_port, run

# a TCP forwarder to the S3 endpoint (argv: listen port, target port), killed to make the endpoint unreachable
FORWARDER = """
import socket, sys, threading
def pipe(a, b):
    while data := a.recv(65536):
        b.sendall(data)
    b.close()
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    client, _ = server.accept()
    upstream = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
"""


def test_an_unreachable_endpoint_ends_in_one_line_and_keeps_the_previous_checkpoint(s3, tmp_path):
    """Unreachable from the start: refused before training. Unreachable from step 3: the save of step 4 fails,
    and step 2's checkpoint stays in the bucket. One attempt per request (AWS_MAX_ATTEMPTS) keeps it fast."""
    s3_port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    closed, port = free_port(), free_port()
    at = [*EVERY_2, "run_id=s3", f"paths.ckpt_dir=s3://{BUCKET}/run"]
    env = clean_env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed}", AWS_MAX_ATTEMPTS="1")
    proc = run("train", *at, log_dir=tmp_path, env=env, check=False)
    one_line(proc, f"cannot use paths.ckpt_dir=s3://{BUCKET}/run: Could not connect to the endpoint URL")

    forwarder = subprocess.Popen([sys.executable, "-c", FORWARDER, str(port), str(s3_port)], stderr=subprocess.DEVNULL)
    try:
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            time.sleep(0.05)
        env = clean_env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_MAX_ATTEMPTS="1")
        proc = run("train", *at, *fault("outage", pid=forwarder.pid, port=port), log_dir=tmp_path, env=env, check=False)
    finally:
        forwarder.kill()
        forwarder.wait()
    one_line(
        proc,
        f"could not save checkpoint s3://{BUCKET}/run/last.ckpt (the previous one is kept): ",
        "check the endpoint (AWS_ENDPOINT_URL)",
    )
    assert not s3.exists(f"{BUCKET}/run/last.ckpt.tmp")
    assert load_full(f"s3://{BUCKET}/run/last.ckpt")["global_step"] == 2
    assert (
        "could not save checkpoint" in (tmp_path / "train/runs/s3/train.log").read_text()
    )  # a run that trained keeps its logs
