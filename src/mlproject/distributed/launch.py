"""Checks of how a job's processes are started, made before anything heavy is imported."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from omegaconf import DictConfig

from mlproject.core.constants import AGREED_EXITS
from mlproject.core.errors import ConfigError
from mlproject.core.resolvers import generated_run_id
from mlproject.core.topology import Topology

# Strategies that run in the processes they are started in: `single` has one, `ddp_spawn` forks its own.
NO_RELAUNCH = ("single", "ddp_spawn")

# Set in every process by a launcher that starts all ranks itself: torchrun (RANK), Open MPI,
# MPICH / Intel MPI, LSF's jsrun (as Lightning's cluster environments read them).
EXTERNAL_RANK_VARS = ("LOCAL_RANK", "RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "JSM_NAMESPACE_SIZE")
# set for the local ranks launch_local_ranks starts: local rank 0 passed preflight with the same config
CHECKED_BY_RANK_0 = "_MLPROJECT_CHECKED_BY_RANK_0"


def launched_externally() -> bool:
    """Another launcher started this process as one of the job's ranks."""
    external = any(v in os.environ for v in EXTERNAL_RANK_VARS)
    # feature: slurm
    external = external or int(os.environ.get("SLURM_NTASKS", "1")) > 1  # srun: one task per process
    # /feature: slurm
    return external


def check_launch(cfg: DictConfig, topology: Topology) -> None:
    nodes = topology.nodes
    # feature: deepspeed
    if topology.strategy == "deepspeed" and topology.devices_per_node > 1 and _trials_share_this_process():
        raise ConfigError(  # deepspeed.utils.groups caches the first trial's process groups for the process's life
            "strategy=deepspeed_* in a multirun whose trials run in this one process: DeepSpeed keeps the first "
            "trial's process groups, so the next trial cannot make its own; add hydra/launcher=local "
            "(each trial a process of its own)"
            # feature: slurm
            " or run the sweep on SLURM"
            # /feature: slurm
        )
    # /feature: deepspeed
    if nodes > 1 and cfg.get("run_id") == generated_run_id():
        raise ConfigError(
            f"trainer.num_nodes={nodes}: every node must write into one run directory, but this node made up "
            "its own run id; pass the same run_id=<name> on every node (torchrun --rdzv-id does it for you"
            # feature: slurm
            ", and SLURM's job id"
            # /feature: slurm
            ")"
        )
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) and os.environ.get("TORCHELASTIC_RUN_ID") == "none":
        raise ConfigError(  # the restarted group would dial the dead round's addresses, even for a plain script
            "torchrun --max-restarts with its static rendezvous (--master-port alone) cannot restart the "
            "process group; use torchrun --standalone (one machine) or --rdzv-backend c10d "
            "--rdzv-endpoint <host:port> (several)"
        )
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(  # pytorch#135712: measured here, 1 restart in 3 failed or hung without the variable
            "torchrun --max-restarts shares its rendezvous store with the workers, so a restarted process group "
            "can read the dead round's addresses and fail or hang; start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per restart)"
        )
    missing = [v for v in ("MASTER_ADDR", "NODE_RANK") if v not in os.environ]
    if nodes > 1 and missing and not launched_externally():  # else every collective waits for its timeout
        raise ConfigError(
            f"trainer.num_nodes={nodes} but {' and '.join(missing)} not set: nodes find each other through "
            "MASTER_ADDR/MASTER_PORT and know their place by NODE_RANK; set them on every node, or start "
            "with torchrun"
            # feature: slurm
            " or SLURM"
            # /feature: slurm
            " (docs/strategies.md)"
        )
    check_master_port(cfg, topology)


def check_master_port(cfg: DictConfig, topology: Topology) -> None:
    """A MASTER_PORT from the user's environment that this process will listen on (the first node's rank 0 hosts
    the rendezvous store): taken, it would end in c10d's traceback after the other ranks have started. Schedulers
    and external launchers choose their own port; a sweep's trials each take a free one (launch_local_ranks)."""
    port = os.environ.get("MASTER_PORT")
    if (
        port is None
        or topology.world_size < 2
        or launched_externally()
        or (cfg.get("cluster") or {}).get("scheduler")
        or os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) != "0"
        or _in_sweep()
    ):
        return
    fix = "set MASTER_PORT to a free port, or unset it to have one picked"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"MASTER_PORT={port!r} is not a port number; {fix}")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: a past run's TIME_WAIT is free
        try:
            s.bind(("", int(port)))  # all addresses, as the store listens
        except OSError as exc:
            reason = exc.strerror.lower()
            raise ConfigError(f"MASTER_PORT={port} cannot be listened on here ({reason}); {fix}") from None


# feature: deepspeed
def check_deepspeed(cfg: DictConfig, topology: Topology) -> None:
    import importlib.util

    if topology.strategy != "deepspeed":
        return
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("strategy=deepspeed_* needs DeepSpeed; install it with pip install '.[deepspeed]'")
    import torch

    precision = str(cfg.trainer.precision)
    cpu = cfg.trainer.accelerator == "cpu" or not torch.cuda.is_available()
    if precision.endswith("-true") and precision != "32-true":
        raise ConfigError(
            f"trainer.precision={precision} with DeepSpeed: DeepSpeed keeps fp32 master weights itself, so "
            "pure half precision cannot be had; use trainer.precision=bf16-mixed"
        )
    if cpu and precision != "32-true":
        raise ConfigError(
            f"trainer.precision={precision} with DeepSpeed on CPU: its bf16 mode casts the model and its inputs to "
            "bf16 without autocast, which CPU kernels that mix dtypes (BatchNorm) refuse; use trainer.precision=32-true"
        )
    if cpu and cfg.strategy.get("offload"):
        raise ConfigError(
            "DeepSpeed offload moves optimizer state and parameters from GPU to CPU memory, which on CPU is where they "
            "already are; use strategy=deepspeed_stage_3"
        )


# /feature: deepspeed
_children: list[subprocess.Popen] = []  # local ranks 1..N-1 that this process (local rank 0) started
_polling = threading.Lock()  # Popen.poll() returns None in one thread while another thread polls
_reported: set[int] = set()


def launch_local_ranks(cfg: DictConfig, topology: Topology) -> None:
    """Start this node's local ranks 1..N-1 now, with this command line, and make this process local rank 0.

    Lightning's launcher would start them only inside trainer.fit, after this process imported and built
    everything; started here, their imports overlap with ours. Lightning reads the same environment it
    would have set (LOCAL_RANK present: it launches nothing). The job ends with them (`local_ranks_end`).
    """
    from hydra.core.hydra_config import HydraConfig

    nodes, per_node = topology.nodes, topology.devices_per_node
    if (
        per_node < 2
        or topology.strategy in ("", *NO_RELAUNCH)
        or not HydraConfig.initialized()  # train(cfg) called from Python: Lightning launches as usual
        or launched_externally()
        # feature: slurm
        or "SLURM_NTASKS" in os.environ  # Lightning's SLURMEnvironment: srun starts the ranks
        # /feature: slurm
        or (cfg.get("cluster") or {}).get("scheduler")
    ):
        return
    hc = HydraConfig.get()
    trial = hc.mode.name == "MULTIRUN"  # one trial of a sweep: its ranks run this trial alone, then end
    os.environ.update(  # what Lightning's _SubprocessScriptLauncher sets; the user's MASTER_*/NODE_RANK stay
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=str(_free_port()) if trial else os.environ.get("MASTER_PORT") or str(_free_port()),
        NODE_RANK=os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")),
        WORLD_SIZE=str(per_node * nodes),
        LOCAL_RANK="0",
        MLPROJECT_RUN_ID=str(cfg.run_id),
    )
    entry = os.environ["_MLPROJECT_ENTRY"]  # the entry point's module (or script), as cli.py recorded it
    cmd = [sys.executable, *([entry] if entry.endswith(".py") else ["-m", entry])]
    # like Lightning under Hydra: this run's directory, a log file per rank, no second .hydra/ folder. In a
    # sweep, the command line would start the whole sweep again: the ranks get this trial's overrides, as a run
    args = [*hc.overrides.task, "hydra.mode=RUN"] if trial else sys.argv[1:]
    cmd += [*args, f'hydra.run.dir="{hc.runtime.output_dir}"', "hydra.output_subdir=null"]
    for rank in range(1, per_node):
        _children.append(
            subprocess.Popen(
                [*cmd, f"hydra.job.name={hc.job.name}_ddp_process_{rank}"],
                env={**os.environ, "LOCAL_RANK": str(rank), CHECKED_BY_RANK_0: "1"},
                cwd=hc.runtime.cwd,
                preexec_fn=_die_with_parent(),
            )
        )
    threading.Thread(target=_watch_children, args=(list(_children), trial), daemon=True).start()


@contextlib.contextmanager
def local_ranks_end():
    """Around a job: if it fails, kill the local ranks it started (they may wait in a collective for it);
    if it succeeds, wait for them, and fail if one failed. Either way name the ranks that failed. A trial
    of a sweep then leaves this process as it found it, for the next trial to start its own ranks."""
    environ = dict(os.environ)
    try:
        try:
            yield
        except BaseException:
            # A killed peer closes its sockets before the kernel lets it be reaped: this rank's collective may
            # fail first. Give the children a moment to show as dead, so that the failure is reported as theirs.
            deadline = time.monotonic() + 2
            while _children and time.monotonic() < deadline and all(p.poll() is None for p in _children):
                time.sleep(0.05)
            _report_failed()
            _kill_children()
            raise
        for p in _children:
            p.wait()
        if _report_failed():
            if _in_sweep():  # an exception, not an exit: Hydra records the trial as failed and the sweep goes on
                raise RuntimeError("a local rank of this trial failed (its error is above)")
            sys.exit(1)
    finally:
        if _children and _in_sweep():
            import torch.distributed as dist

            if dist.is_initialized():  # else the next trial's Lightning would reuse this trial's group
                dist.destroy_process_group()
            os.environ.clear()  # LOCAL_RANK, WORLD_SIZE, MASTER_PORT of this trial
            os.environ.update(environ)
            _children.clear()
            _reported.clear()


# feature: deepspeed
def _trials_share_this_process() -> bool:
    """A sweep whose trials Hydra's basic launcher runs one after another in this process."""
    from hydra.core.hydra_config import HydraConfig

    return _in_sweep() and HydraConfig.get().launcher._target_.endswith(".BasicLauncher")


# /feature: deepspeed
def _in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized() and HydraConfig.get().mode.name == "MULTIRUN"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """preexec_fn: the kernel SIGKILLs the child when this process dies, even by SIGKILL (Linux only)."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def in_child():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # died before the line above
            os._exit(1)

    return in_child


def _kill_children() -> None:
    for p in _children:
        if p.poll() is None:
            p.kill()
    for p in _children:
        p.wait()


def _report_failed() -> bool:
    with _polling:
        # an agreed exit (SIGTERM, divergence) is this rank's too, at the same step: not a failure to report
        failed = [(rank, p) for rank, p in enumerate(_children, 1) if p.poll() not in (None, 0, *AGREED_EXITS)]
        for rank, p in failed:
            if rank not in _reported:
                _reported.add(rank)
                print(f"error: local rank {rank} (pid {p.pid}) exited with code {p.returncode}", file=sys.stderr)
    return bool(failed)


def _watch_children(children: list[subprocess.Popen], sweep: bool) -> None:
    """A local rank that fails ends the job within a second, exit code 1, even if this rank waits in a
    collective that would only time out (Lightning's _ChildProcessObserver does the same with SIGKILL).
    In a sweep it ends only the trial: the other ranks are killed, and this rank's next collective fails
    (gloo sees the closed peers) so that Hydra records the trial as failed and starts the next one."""
    while not _report_failed():
        if all(p.poll() == 0 for p in children):  # the trial's ranks are done: a sweep's next trial has its own
            return
        time.sleep(1)
    _kill_children()
    sys.stdout.flush()
    if not sweep:
        os._exit(1)
