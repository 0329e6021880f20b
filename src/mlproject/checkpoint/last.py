"""The checkpoint to resume from, kept apart from the best-by-metric ones (configs/callbacks/last_checkpoint.yaml)."""

from __future__ import annotations

from mlproject.checkpoint.storage import ModelCheckpoint


class LastCheckpoint(ModelCheckpoint):
    """Only `last.ckpt`: at every epoch end (every_n_epochs), every N optimizer steps (every_n_train_steps) and at
    the end of training. It ranks nothing (save_top_k=0), so saving between validations is safe."""

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        enable_version_counter: bool = False,
        async_save: bool | None = None,
    ):
        super().__init__(
            dirpath=dirpath,
            monitor=None,
            save_top_k=0,
            save_last=True,
            save_on_train_epoch_end=True,
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=every_n_epochs,
            enable_version_counter=enable_version_counter,
            async_save=async_save,
        )

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # Lightning 2.6 writes last.ckpt at an epoch end only when a top-k checkpoint was written at that step,
        # and with save_top_k=0 none is.
        super().on_train_epoch_end(trainer, pl_module)
        due = self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0
        if due and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
