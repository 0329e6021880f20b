"""SLURM's side of the signals (cluster=slurm): `Requeue` is `Signals` (cluster/requeue.py) that also requeues.

- SLURM's `--signal` (SIGUSR1 `cluster.signal_seconds` before the time limit): save last.ckpt, `scontrol requeue`
  the job, exit 0.
- SIGTERM: save last.ckpt; if SLURM is preempting the job, `scontrol requeue` it and exit 0, else exit 143.

Requeue is the only component that requeues:
- Lightning's SLURMEnvironment(auto_requeue=True) is turned off (configs/cluster/slurm.yaml): it saves
  from inside the signal handler, wherever each rank happens to be, so its collective save can meet
  another rank's gradient all-reduce and hang; and its hpc_ckpt_N.ckpt is resumed behind ckpt_path's back.
- submitit's handler listens on SIGUSR2; the sweep launcher (configs/hydra/launcher/slurm.yaml) asks
  SLURM for SIGUSR1 instead, so only this callback hears it.
- A SIGTERM from `scancel` or the time limit means the job should end; one from a preemption (the job's
  PreemptTime is set) requeues here: SLURM (22.05) requeues a preempted job only if it is still running when
  the grace time ends, and one that saved and exited earlier would end FAILED instead.
The requeued job keeps its SLURM_JOB_ID, so it writes into the same run directory, and `ckpt_path=auto`
resumes from the checkpoint saved here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import lightning as L

from mlproject.cluster.requeue import Signals
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


class Requeue(Signals):
    """Also on `signum` (SLURM's warning before a time limit), and on SIGTERM when SLURM preempts the job:
    checkpoint, requeue, exit 0."""

    def __init__(self, signum: int = signal.SIGUSR1, **kwargs):
        super().__init__(**kwargs)
        self.signum = signum
        self.received[signum] = False
        self._previous = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._previous = signal.signal(self.signum, self._on_signal)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        signal.signal(self.signum, self._previous or signal.SIG_DFL)

    def leave(self, trainer: L.Trainer, agreed: dict, saved: str) -> None:
        # SIGTERM ends the job (scancel, the time limit) unless SLURM is preempting it (module docstring).
        job = os.environ.get("SLURM_JOB_ID")  # the same on every rank: all or none join the broadcast
        preempting = job is not None and trainer.strategy.broadcast(trainer.is_global_zero and preempted(job))
        if not (agreed[self.signum] or preempting):
            return super().leave(trainer, agreed, saved)
        name = signal.Signals(self.signum if agreed[self.signum] else signal.SIGTERM).name
        if trainer.is_global_zero:
            log.info(f"signal {name}: saved {saved} at step {trainer.global_step}")
            subprocess.run(["scontrol", "requeue", job], check=True)
            log.info(f"requeued SLURM job {job}; it resumes from {saved}")
        trainer.strategy.barrier("requeue")  # no rank exits (and makes srun end the job) before the requeue
        sys.exit(0)


def preempted(job: str) -> bool:
    """Whether SLURM is preempting the job: its PreemptTime is set (SIGTERM came from the preemption)."""
    fields = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout.split()
    return any(f.startswith("PreemptTime=") and f != "PreemptTime=None" for f in fields)
