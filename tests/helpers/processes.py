"""Run the entry points as real processes, as a user would, and read back what a run wrote."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from mlproject.core.constants import PROJECT_ROOT

# Process groups of the runs now alive (each run's ranks share its group), for `together` to end them, and
# whether it is ending them (a run that starts meanwhile ends at once).
LIVE: set[int] = set()
STOP = threading.Event()
PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}

# The interpreter of child runs: warm where the template's tests/helpers/warm.py is (set by conftest) unless
# MLPROJECT_COLD_TESTS=1; this one otherwise.
PYTHON = sys.executable

# Runs in tests stay small: few epochs, no config tree, quiet warnings; on the CPU even where a GPU is visible.
FAST = ["extras.print_config=false", "trainer=cpu", "trainer.max_epochs=2"]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child run: no ids or ranks inherited from this process or a scheduler, and none of
    the variables of a `make test ARGS=...` that started the suite (a nested make would take them as its own)."""
    drop = (
        "MLPROJECT_RUN_ID",
        # feature: slurm
        "SLURM_",
        # /feature: slurm
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_",
        "NODE_RANK",
        "TORCHELASTIC",
        "HYDRA_FULL_ERROR",
        "_MLPROJECT",
    )
    env = {k: v for k, v in make_env().items() if not k.startswith(drop)}
    # One thread per process: the multi-process tests run several processes on few cores, where torch's
    # default thread pools only spin against each other, and inductor compiles in the process instead of starting
    # a pool of compile workers (each a new interpreter importing torch) in every process that compiles.
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    # feature: wandb
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    # /feature: wandb
    env.update(extra)
    return env


def with_path(folder: Path, **extra: str) -> dict[str, str]:
    """clean_env with a user's folder of code importable, before this suite's own PYTHONPATH (a generated project
    that is not installed finds its package through it)."""
    return clean_env(PYTHONPATH=os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p), **extra)


def run(
    module: str,
    *overrides: str,
    log_dir: Path,
    timeout: int = 240,
    check: bool = True,
    env: dict | None = None,
    cold: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m mlproject.<module> overrides...` writing under log_dir; fails loudly with its output. On a
    timeout the run's whole process group is killed: the ranks Lightning started besides the one it runs in.
    cold: the real interpreter, for a test that reads process ids or parentage (a warm run is a fork of the
    warm server, so its pid is not the one Popen returns, and the ranks it starts are the server's children)."""
    cmd = [sys.executable if cold else PYTHON, "-m", f"mlproject.{module}", f"paths.log_dir={log_dir}", *overrides]
    env = env or clean_env()
    with subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, text=True, start_new_session=True, **PIPES) as child:
        LIVE.add(child.pid)
        if STOP.is_set():
            kill_group(child.pid)
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(child.pid)
            raise
        finally:
            LIVE.discard(child.pid)
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def together(*calls: Callable[[], object]) -> list:
    """Call each of `calls` (runs that do not depend on each other, e.g. `lambda: run(...)`) in a thread of
    its own and wait for all; returns their results in order, or raises the first error. Their
    processes run one thread each (clean_env), so a few at once fill the CPUs instead of waiting for each
    other's interpreter start-up and single-process training. On an error, or when this thread is
    interrupted (pytest-timeout raises here), the runs still alive are killed rather than waited for."""
    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [pool.submit(call) for call in calls]
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                for future in (f for f in futures if f in done and f.exception()):
                    raise future.exception()
                return [future.result() for future in futures]
            except BaseException:
                STOP.set()
                for pid in list(LIVE):
                    kill_group(pid)
                raise
    finally:
        STOP.clear()


def run_dirs(log_dir: Path, task: str = "train") -> list[Path]:
    root = log_dir / task / "runs"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


def read_metrics(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "metrics.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, *args: str, world: int, timeout: int = 240) -> None:
    """Start `world` real processes of `script` as ranks of one gloo job on 127.0.0.1 (the environment
    torchrun would give them); Lightning sees LOCAL_RANK and launches nothing itself."""
    port = str(free_port())
    ranks = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world), NODE_RANK="0")
    envs = [clean_env(**ranks, RANK=str(r), LOCAL_RANK=str(r)) for r in range(world)]
    wait_all([[PYTHON, str(script), *args]] * world, envs, timeout)


# `fn(rank, *args)` in a process: the module-level function `fn` of an importable module, with JSON arguments
SPAWN = (
    "import importlib, json, sys; m, f, r, a = sys.argv[1:]; "
    "getattr(importlib.import_module(m), f)(int(r), *json.loads(a))"
)


def spawn(fn: Callable, *args, nprocs: int, timeout: int = 240) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs) from the warm interpreter: a spawned process is a new
    interpreter that imports torch and the test module (~5 CPU-s each)."""
    cmds = [[PYTHON, "-c", SPAWN, fn.__module__, fn.__qualname__, str(r), json.dumps(args)] for r in range(nprocs)]
    wait_all(cmds, [clean_env()] * nprocs, timeout)


def wait_all(cmds: list[list[str]], envs: list[dict], timeout: int) -> None:
    """Run the commands side by side; each must exit 0 (its output says why not)."""
    procs = [
        subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in zip(cmds, envs, strict=True)
    ]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"process {r} exited {p.returncode}:\n{out[-4000:]}"


def make_env() -> dict[str, str]:
    """This environment for a nested make. Under `make test ARGS=...` the outer make's command-line variables
    are in MAKEFLAGS (which a nested make takes as its own command line) and exported one by one: both go."""
    assigned = re.split(r"(?<!\\) ", os.environ.get("MAKEFLAGS", "").partition(" -- ")[2])
    drop = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", *(word.split("=", 1)[0] for word in assigned if "=" in word)}
    return {k: v for k, v in os.environ.items() if k not in drop}


def make_command(make_line: str) -> list[str]:
    """The arguments after `-m mlproject.<module>` of the command `make -n <make_line>` would run."""
    out = subprocess.run(
        ["make", "-n", *shlex.split(make_line)],
        cwd=PROJECT_ROOT,
        env=make_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (line,) = [ln for ln in out.splitlines() if " -m mlproject." in ln]
    return shlex.split(line)[3:]


def run_in_process(module: str, *overrides: str, log_dir: Path) -> tuple[int, str]:
    """`python -m mlproject.<module> overrides...` in this process, for runs that end before training:
    returns (exit code, stderr). No interpreter start-up or imports per run; the environment, sys.argv
    and Hydra's global state are restored afterwards."""
    import importlib
    import io

    from hydra.core.global_hydra import GlobalHydra

    main = importlib.import_module(f"mlproject.{module}").main
    argv, environ, err = sys.argv, dict(os.environ), io.StringIO()
    sys.argv = [f"mlproject.{module}", f"paths.log_dir={log_dir}", *overrides]
    os.environ.clear()
    os.environ.update(clean_env())
    try:
        with contextlib.redirect_stderr(err):
            main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
        GlobalHydra.instance().clear()
    return code, err.getvalue()
