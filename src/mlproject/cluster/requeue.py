"""Signals during training: SIGTERM stops the run, SIGUSR1 (SLURM) saves last.ckpt, requeues and exits.

A signal handler only notes the signal. Every `every_n_steps` optimizer steps all ranks agree on what any
of them received in one small all-reduce, and act together at that step: a rank that acted alone would
leave the others waiting in their next collective. So a signal is honoured within `every_n_steps` optimizer
steps of its arrival (plus the step under way), and steps in between carry no collective of ours.

Lightning 2.6 instead broadcasts a SIGTERM flag from rank 0 and reads it back (`.item()`) at every training
step when world size > 1 (loops/training_epoch_loop.py: _broadcast_sigterm_tensor; upstream issue
Lightning-AI/pytorch-lightning#21487): a collective and a host-device sync per step. `Signals` takes that
broadcast off the step, and the matching one out of Lightning's SIGTERM handler, and checks here instead.
build_trainer adds `Signals` to every run; cluster=slurm uses `Requeue`, which also handles SIGUSR1.

Requeue is the only component that requeues:
- Lightning's SLURMEnvironment(auto_requeue=True) is turned off (configs/cluster/slurm.yaml): it saves
  from inside the signal handler, wherever each rank happens to be, so its collective save can meet
  another rank's gradient all-reduce and hang; and its hpc_ckpt_N.ckpt is resumed behind ckpt_path's back.
- submitit's handler listens on SIGUSR2; the sweep launcher (configs/hydra/launcher/slurm.yaml) asks
  SLURM for SIGUSR1 instead, so only this callback hears it.
The requeued job keeps its SLURM_JOB_ID, so it writes into the same run directory, and `ckpt_path=auto`
resumes from the checkpoint saved here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


class Signals(L.Callback):
    """Stop on SIGTERM, checked every `every_n_steps` optimizer steps on all ranks at once."""

    def __init__(self, every_n_steps: int = 10):
        self.every_n_steps = every_n_steps
        self.received = {signal.SIGTERM: False}
        self._checked_step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before Lightning registers its handlers (Trainer._run): its SIGTERM handler broadcasts from rank 0,
        # a collective no other rank would meet once the per-step broadcast below is gone; ours only notes it.
        trainer._signal_connector._sigterm_notifier_fn = self._on_signal
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # see the module docstring

    def _on_signal(self, signum, frame) -> None:
        self.received[signum] = True

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        step = trainer.global_step  # the same on every rank; unchanged between accumulated micro-batches
        if step == self._checked_step or step % self.every_n_steps:
            return
        self._checked_step = step
        flags = torch.tensor(list(self.received.values()), dtype=torch.int32, device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # not strategy.reduce: it adds a barrier before
        agreed = dict(zip(self.received, flags.tolist(), strict=True))
        self.act(trainer, agreed)

    def act(self, trainer: L.Trainer, agreed: dict) -> None:
        if agreed[signal.SIGTERM]:
            log.info(f"SIGTERM: stopping at step {trainer.global_step}")
            raise SIGTERMException  # on every rank at this step; Lightning ends the run as after its own check


class Requeue(Signals):
    """Also on `signum` (SLURM's warning before a time limit or preemption): checkpoint, requeue, exit."""

    def __init__(self, signum: int = signal.SIGUSR1, every_n_steps: int = 10):
        super().__init__(every_n_steps)
        self.signum = signum
        self.received[signum] = False
        self._previous = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._previous = signal.signal(self.signum, self._on_signal)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        signal.signal(self.signum, self._previous or signal.SIG_DFL)

    def act(self, trainer: L.Trainer, agreed: dict) -> None:
        if not agreed[self.signum]:
            return super().act(trainer, agreed)
        path = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"  # where ckpt_path=auto looks
        trainer.save_checkpoint(path)
        job = os.environ["SLURM_JOB_ID"]
        if trainer.is_global_zero:
            log.info(f"signal {signal.Signals(self.signum).name}: saved {path} at step {trainer.global_step}")
            subprocess.run(["scontrol", "requeue", job], check=True)
            log.info(f"requeued SLURM job {job}; it resumes from {path}")
        trainer.strategy.barrier("requeue")  # no rank exits (and makes srun end the job) before the requeue
        sys.exit(0)
