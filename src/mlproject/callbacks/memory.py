"""debug=memory: torch's CUDA memory history, written as `memory_snapshot_rank<N>.pickle` in the run directory at
step `at_step` or at an out-of-memory error; drag it into https://pytorch.org/memory_viz to see every allocation
with its stack. Recording costs a stack trace per allocation: a debugging run, not a production one."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from mlproject.utils import compat
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


class MemoryHistory(Callback):
    def __init__(self, at_step: int = 5, max_entries: int = 100_000):
        self.at_step, self.max_entries = at_step, max_entries
        self._recording = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.strategy.root_device.type != "cuda":
            log.warning("debug=memory records CUDA allocations; this run has no GPU, so nothing is recorded")
            return
        compat.record_cuda_memory(self.max_entries)
        self._recording = True

    def dump(self, trainer) -> None:
        if not self._recording:
            return
        path = Path(trainer.default_root_dir) / f"memory_snapshot_rank{trainer.global_rank}.pickle"
        compat.dump_cuda_memory(str(path))
        self._recording = False
        log.info(f"memory snapshot written to {path} (open it at https://pytorch.org/memory_viz)")

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at_step:
            self.dump(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, torch.OutOfMemoryError):
            self.dump(trainer)
