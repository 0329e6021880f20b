"""Preemption and time limits on SLURM: SIGUSR1 -> save last.ckpt -> `scontrol requeue` -> exit.

The requeued job keeps its SLURM_JOB_ID, so it writes into the same run directory, and `ckpt_path=auto`
resumes from the checkpoint saved here. This callback is the only component that requeues:
- Lightning's SLURMEnvironment(auto_requeue=True) is turned off (configs/cluster/slurm.yaml): it saves
  from inside the signal handler, wherever each rank happens to be, so its collective save can meet
  another rank's gradient all-reduce and hang; and its hpc_ckpt_N.ckpt is resumed behind ckpt_path's back.
- submitit's handler listens on SIGUSR2; the sweep launcher (configs/hydra/launcher/slurm.yaml) asks
  SLURM for SIGUSR1 instead, so only this callback hears it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L

from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


class Requeue(L.Callback):
    """On `signum` (SLURM's warning before a time limit or preemption): checkpoint, requeue, exit."""

    def __init__(self, signum: int = signal.SIGUSR1):
        self.signum = signum
        self.requested = False
        self._previous = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._previous = signal.signal(self.signum, self._on_signal)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        signal.signal(self.signum, self._previous or signal.SIG_DFL)

    def _on_signal(self, signum, frame) -> None:
        # Only note it: the save is a collective, so it waits for the next batch end, where every rank is.
        self.requested = True

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        # Any rank's signal counts; a one-element all-reduce per step, small next to the gradients' own.
        if not trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            return
        path = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"  # where ckpt_path=auto looks
        trainer.save_checkpoint(path)
        job = os.environ["SLURM_JOB_ID"]
        if trainer.is_global_zero:
            log.info(f"signal {signal.Signals(self.signum).name}: saved {path} at step {trainer.global_step}")
            subprocess.run(["scontrol", "requeue", job], check=True)
            log.info(f"requeued SLURM job {job}; it resumes from {path}")
        trainer.strategy.barrier("requeue")  # no rank exits (and makes srun end the job) before the requeue
        sys.exit(0)
