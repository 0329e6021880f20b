"""The warm interpreter (tests/helpers/warm.py) forks only where a fork is sound: from a server with one thread, for
a request whose hash seed is the server's; anything else runs cold, in the real interpreter."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mlproject.core.constants import PROJECT_ROOT
from tests.helpers import warm
from tests.helpers.processes import clean_env

SEED = "7"  # the servers' hash seed: fixed, so that a warm child's hashes can be compared with a cold one's
PROBE = "import json, os, sys; print(json.dumps([os.getpid(), os.getppid(), hash('w'), sys.flags.hash_randomization]))"


@pytest.fixture(scope="module")
def servers():
    """{"plain": (stand-in, server), "threaded": ...}: a server as the suite starts it, and one with a second thread."""
    env = clean_env(PYTHONHASHSEED=SEED)
    started = {"plain": warm.start(PROJECT_ROOT, env), "threaded": warm.start(PROJECT_ROOT, env, main=__name__)}
    yield started
    for stand_in, server in started.values():
        server.kill()
        server.wait()
        shutil.rmtree(Path(stand_in).parent, ignore_errors=True)


def probe(python: str, **env: str) -> tuple[int, list]:
    """(the pid Popen gave, [pid, parent pid, hash('w'), hash randomization] as the probe saw them)."""
    with subprocess.Popen(
        [python, "-c", PROBE], cwd=PROJECT_ROOT, env=clean_env(**env), stdout=subprocess.PIPE, text=True
    ) as proc:
        out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0
    return proc.pid, json.loads(out)


def cold_hash(seed: str) -> int:
    return probe(sys.executable, PYTHONHASHSEED=seed)[1][2]


def test_a_request_with_the_servers_environment_is_forked_and_shares_its_hash_seed(servers):
    stand_in, server = servers["plain"]
    popen_pid, (pid, parent, value, _) = probe(stand_in, PYTHONHASHSEED=SEED)
    assert pid != popen_pid and parent == server.pid  # a fork of the server, not the process Popen started
    assert value == cold_hash(SEED)
    # every forked child has the server's seed: a second one hashes alike (cold children with an unset seed
    # would not), which is why CI runs the multi-process proofs cold too
    assert probe(stand_in, PYTHONHASHSEED=SEED)[1][2] == value


def test_a_request_with_another_hash_seed_runs_cold(servers):
    stand_in, server = servers["plain"]
    popen_pid, (pid, parent, value, _) = probe(stand_in, PYTHONHASHSEED="8")
    assert pid == popen_pid and parent != server.pid  # the stand-in exec'd the real interpreter
    assert value == cold_hash("8") != cold_hash(SEED)
    popen_pid, (pid, _, _, randomized) = probe(stand_in, PYTHONHASHSEED="random")
    assert pid == popen_pid and randomized


def test_a_server_with_a_second_thread_forks_nothing(servers):
    stand_in, server = servers["threaded"]
    popen_pid, (pid, parent, value, _) = probe(stand_in, PYTHONHASHSEED=SEED)
    assert pid == popen_pid and parent != server.pid  # refused: the stand-in ran cold
    assert value == cold_hash(SEED)
    assert server.poll() is None  # and the server still serves


def test_one_thread_counts_this_processs_threads():
    code = "import threading, tests.helpers.warm as w; a = w.one_thread(); "
    code += "threading.Thread(target=threading.Event().wait, daemon=True).start(); print(a, w.one_thread())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["True", "False"], proc.stderr


if __name__ == "__main__":  # the threaded server: warm.start(..., main=__name__) runs this module as its own
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    sys.path[0] = str(PROJECT_ROOT)
    warm.run_child(warm.serve(*sys.argv[1:3]))
