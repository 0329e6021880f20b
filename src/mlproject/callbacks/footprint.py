"""Log what each rank holds of the model: parameter and optimizer-state bytes, after the first step.

Adam creates its state at the first optimizer step, so that is the earliest moment the number is real.
Under FSDP each rank holds about 1/N of what DDP's ranks hold; this line shows it for every run.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback

from mlproject.distributed.parallel import local_bytes
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


class ModelFootprint(Callback):
    def __init__(self):
        self.logged = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.logged or trainer.global_step < 1:
            return
        self.logged = True
        params = local_bytes(pl_module.parameters())
        state = local_bytes(
            v for opt in trainer.optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
        )
        log.info(
            f"model footprint on this rank: parameters {params / 2**20:.2f} MiB + optimizer state "
            f"{state / 2**20:.2f} MiB = {params + state} bytes",
            all_ranks=True,
        )
