"""Atomic checkpoint writes, and reading any checkpoint this template writes under any strategy."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from weakref import proxy

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint


def replace_checkpoint(src: str | Path, dst: str | Path) -> None:
    """Move a checkpoint file or directory `src` to `dst`, replacing what is there.

    A file replaces a file in one atomic rename. rename(2) cannot replace a non-empty directory, so an
    existing `dst` is moved aside to `<dst>.old` first and deleted after; a crash between the two renames
    leaves `<dst>.old`, which `resolve_ckpt_path` resumes from.
    """
    src, dst = str(src), str(dst)
    old = dst + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(dst) or (os.path.isdir(src) and os.path.exists(dst)):
        os.rename(dst, old)
    os.replace(src, dst)
    if os.path.isdir(old):
        shutil.rmtree(old)
    elif os.path.exists(old):
        os.remove(old)


def save_atomically(trainer, path: str | Path, weights_only: bool = False) -> None:
    """`trainer.save_checkpoint` under `<path>.tmp`, renamed into place by rank 0 once every rank has written
    (its shard); the previous checkpoint at `path` stays loadable until then. Called on every rank."""
    tmp = f"{path}.tmp"
    trainer.strategy.remove_checkpoint(tmp)  # the leftover of a save that was killed
    trainer.strategy.barrier("checkpoint_tmp_removed")
    trainer.save_checkpoint(tmp, weights_only)  # every rank; ends with a barrier
    if trainer.is_global_zero:
        replace_checkpoint(tmp, path)
    trainer.strategy.barrier("checkpoint_renamed")


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint, but each checkpoint is written under `<name>.tmp` and renamed into place.

    Lightning writes straight to the final path, so a kill during a save leaves a truncated last.ckpt and
    no way back. Here the previous checkpoint stays until the new one is complete, for single files and
    for sharded directories alike. Every rank writes (its shard); rank 0 renames after all have finished.
    Retention (last + top-k) is Lightning's, which removes files and directories through the strategy.
    """

    def _monitor_candidates(self, trainer) -> dict[str, torch.Tensor]:
        # Until the first validation of a run (fresh or resumed) the monitored metric is unknown and Lightning
        # skips every step checkpoint, so a preemption loses the whole epoch. NaN ranks as the worst score:
        # last.ckpt is written, and a top-k slot only while fewer than k exist. After a validation a missing
        # metric is a typo, which Lightning reports.
        candidates = super()._monitor_candidates(trainer)
        if self.monitor and self.monitor not in candidates and not trainer.fit_loop.epoch_loop.val_loop._has_run:
            candidates[self.monitor] = torch.tensor(float("nan"))
        return candidates

    def on_train_end(self, trainer, pl_module) -> None:
        # With every_n_train_steps the last save can predate the final steps; a finished run's last.ckpt
        # must hold its final state, or `ckpt_path=auto` would train the tail again.
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        save_atomically(trainer, filepath, self.save_weights_only)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))


class PortableCheckpointIO(TorchCheckpointIO):
    """Loads sharded (fsdp, tp) and DeepSpeed checkpoint directories as well as single files, so a
    single-process or ddp run resumes from a checkpoint of any strategy and world size. It reads the
    checkpoint in full (convert.load_full): a rank of single or ddp holds the whole state anyway."""

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        from mlproject.checkpoint.convert import load_full

        return load_full(path)
