"""A run's directory is its own: safe names, one live run per directory (a lock), and removal only of what
this process created.

Hydra makes the run directory before the task runs and writes `.hydra/` into it, so the checks run in a Hydra
callback (configs/hydra/default.yaml) before that: a second run under a live run's `run_id` is refused before it
has touched the live run's files.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mlproject.core.errors import ConfigError
from mlproject.core.paths import refuse_url_paths

LOCK = "run.lock"
# A name is one path component, safe in a path, a shell line and a job name: no separator, no `..`, no newline.
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=,@-]*")
_created: set[str] = set()  # run directories this process made (absolute paths)
_locked: set[str] = set()  # run directories whose lock this process holds
_trained = [False]  # this process has taken an optimizer step: its run directory holds a run's logs


def check_names(cfg: DictConfig) -> None:
    """`run_id` and `task_name` name one folder each under `paths.log_dir`."""
    for key in ("task_name", "run_id"):
        value = str(OmegaConf.select(cfg, key, default=""))
        if not SAFE_NAME.fullmatch(value) or ".." in value:
            raise ConfigError(
                f"{key}={value!r} must be one folder name (letters, digits and _ . + = , @ -, no '/', '..' or "
                f"newline): it names a directory under paths.log_dir and goes into job scripts; e.g. {key}=my_run"
            )


# what the launchers that start a job's processes set to each one's rank
RANK_VARS = (
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    # feature: slurm
    "SLURM_PROCID",
    # /feature: slurm
)


def is_primary() -> bool:
    """The job's first process: the one a user or scheduler started as rank 0 (other ranks share its directory)."""
    return all(os.environ.get(v, "0") == "0" for v in RANK_VARS)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), which tells a reused pid from its first owner."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie has ended: only its exit status is left


def _alive(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # another machine's process: nothing here can tell
    if Path("/proc/self/stat").exists():
        return _start_time(owner["pid"]) == owner.get("start")
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        # feature: slurm
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        # /feature: slurm
        "command": " ".join(sys.argv),
    }


def lock(run_dir: Path) -> None:
    """Take `<run_dir>/run.lock`, or refuse in one line naming the live run that holds it. A lock whose owner has
    ended (a killed run, a job its scheduler requeued under the same id) is taken over, and said so."""
    path, me = run_dir / LOCK, _me()
    try:
        with open(path, "x") as f:  # exclusive create: of two runs starting together, one wins
            json.dump(me, f)
    except FileExistsError:
        owner = _read(path)
        if owner is None:  # written this instant by a run starting beside us, or left half-written by a crash
            time.sleep(0.5)
            owner = _read(path)
        ended = False  # the owner is this job before its scheduler requeued it: ended, whatever its pid says
        # feature: slurm
        ended = bool(owner and me["slurm_job_id"] and owner.get("slurm_job_id") == me["slurm_job_id"])
        # /feature: slurm
        if owner and not ended and _alive(owner):
            raise ConfigError(
                f"run directory {run_dir} is in use by another run (pid {owner['pid']} on {owner['host']}, since "
                f"{owner.get('since')}); give this run another run_id=, or wait for that one to end (if it has "
                f"ended without a trace, delete {path})"
            ) from None
        tmp = path.with_name(f"{LOCK}.{os.getpid()}")
        tmp.write_text(json.dumps(me))
        os.replace(tmp, path)
        if _read(path) != me:  # another run took it over in the same instant
            raise ConfigError(
                f"run directory {run_dir} was just taken by another run; give this run another run_id="
            ) from None
        who = f"pid {owner['pid']} on {owner['host']}" if owner else "an unreadable lock"
        print(f"warning: {run_dir}: took over the lock of {who}, which is no longer running", file=sys.stderr)
    _locked.add(str(run_dir))
    atexit.register(unlock, run_dir)


def unlock(run_dir: Path) -> None:
    """Remove the lock if this process still holds it."""
    path = Path(run_dir) / LOCK
    if str(run_dir) in _locked and (_read(path) or {}).get("pid") == os.getpid():
        path.unlink(missing_ok=True)
    _locked.discard(str(run_dir))


def claim(run_dir: str | Path) -> None:
    """Before Hydra makes `run_dir`: note whether this process creates it, and lock it (the job's first process)."""
    run_dir = Path(os.path.abspath(run_dir))
    _trained[0] = False  # a new run: an earlier one in this process (a notebook's, a test's) trained, not this one
    if not run_dir.exists():
        run_dir.mkdir(parents=True)
        _created.add(str(run_dir))
    if is_primary():
        lock(run_dir)


def trained() -> None:
    """Note that this run has trained: whatever ends it now, its directory (logs, train.log) is kept."""
    _trained[0] = True


def discard(run_dir: str | Path, log_dir: str | Path) -> str | None:
    """Remove a refused run's directory: only if this process created it, it lies inside `log_dir`, the run has not
    trained and the directory holds no checkpoint or metrics. Returns why it was kept, if it was (None: removed, or
    nothing to say)."""
    run_dir = Path(os.path.abspath(run_dir))
    log_dir = Path(os.path.abspath(log_dir))
    if not run_dir.is_dir():
        return None
    if str(run_dir) not in _created:
        return f"kept {run_dir}: it existed before this command"
    if not run_dir.is_relative_to(log_dir) or run_dir == log_dir or Path.cwd().is_relative_to(run_dir):
        return f"kept {run_dir}: it is not a run directory under paths.log_dir"
    if _trained[0] or any((run_dir / kept).exists() for kept in ("checkpoints", "metrics.json")):
        return None
    unlock(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # ranks of other nodes may race for it
    _created.discard(str(run_dir))
    return None


def refuse(exc: ConfigError):
    """Hydra turns an exception in a callback into a warning and goes on: a refused run exits here instead."""
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)


class RunDirectory(Callback):
    """Hydra callback: check the names and claim the run's directory before Hydra writes into it (a sweep's
    directory for a multirun: its trials' directories lie below it)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self.start(config, config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.start(config, config.hydra.sweep.dir)

    @staticmethod
    def start(config: DictConfig, run_dir: str) -> None:
        try:
            refuse_url_paths(config)
            check_names(config)
            claim(run_dir)
        except ConfigError as exc:
            refuse(exc)

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        unlock(Path(os.path.abspath(config.hydra.run.dir)))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        unlock(Path(os.path.abspath(config.hydra.sweep.dir)))
