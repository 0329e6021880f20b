"""EMA weights: `ema = decay * ema + (1 - decay) * weights` after every optimizer step (not per micro-batch),
and validation and test evaluate the EMA instead of the raw weights.

The averages are buffers of a submodule `ema` of the LightningModule, keyed like the parameters they follow
(`ema.net.head.weight` for `net.head.weight`). So every checkpoint path of the template carries them as it
carries the weights: single files, torch.distributed.checkpoint directories under model-parallel strategies
(where each is a clone of its DTensor parameter, sharded exactly like it), conversion across strategies and
world sizes (checkpoint/convert.py), and eval and export, which take the EMA in place of the raw weights.
Buffers are not averaged (BatchNorm keeps its running statistics), and an average has its parameter's dtype.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

from mlproject.core.errors import ConfigError
from mlproject.utils import compat


def has_child(module: nn.Module, name: str) -> bool:
    return name in dict(module.named_children())


def _local(t: torch.Tensor) -> torch.Tensor:
    # this rank's shard, a view: in-place updates of it update the DTensor (FSDP's sharded storage included)
    return t.to_local() if isinstance(t, DTensor) else t


class EMA(Callback):
    def __init__(self, decay: float = 0.999):
        self.decay = decay
        self._step: int | None = None  # the global step the averages have seen

    def setup(self, trainer, pl_module, stage: str) -> None:
        # The averages must exist before Lightning restores a checkpoint into the module, laid out like the
        # parameters. Single and ddp restore before the strategy's setup, with the parameters final already;
        # model-parallel strategies shard in configure_model and restore after setup: there on_fit_start makes them.
        # feature: deepspeed
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if isinstance(trainer.strategy, DeepSpeedStrategy):
            raise ConfigError("callbacks.ema: DeepSpeed keeps the weights in its own partitions; use strategy=fsdp")
        # /feature: deepspeed
        if not trainer.strategy.restore_checkpoint_after_setup:
            self._attach(pl_module)
        elif stage != "fit" and not has_child(pl_module, "ema"):
            raise ConfigError(
                "callbacks.ema: under a model-parallel strategy the EMA is made when fitting; evaluate a checkpoint "
                "with `python -m mlproject.eval`, which tests its EMA weights"
            )

    def on_fit_start(self, trainer, pl_module) -> None:
        self._attach(pl_module)

    def _attach(self, pl_module) -> None:
        if has_child(pl_module, "ema"):  # fit, then test (or fit again): keep the averages
            return
        ema = nn.Module()
        for name, p in pl_module.named_parameters():
            if not p.requires_grad:
                continue
            *path, leaf = name.split(".")
            parent = ema
            for part in path:  # one module per level: buffer names cannot hold dots
                if not has_child(parent, part):
                    parent.add_module(part, nn.Module())
                parent = parent.get_submodule(part)
            parent.register_buffer(leaf, p.detach().clone())  # a DTensor's clone keeps its sharding
        pl_module.ema = ema
        # DDP broadcasts every buffer from rank 0 before each forward: these are equal on every rank already
        compat.ddp_ignore(pl_module, [f"ema.{n}" for n, _ in ema.named_buffers()])

    def _pairs(self, pl_module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(averages, parameters), this rank's shards; the parameters are looked up by name every time, as
        FSDP registers its own parameter objects."""
        averages = dict(pl_module.ema.named_buffers())
        pairs = [(_local(averages[n]), _local(p)) for n, p in pl_module.named_parameters() if n in averages]
        return [a for a, _ in pairs], [p for _, p in pairs]

    def on_train_start(self, trainer, pl_module) -> None:
        self._step = trainer.global_step  # a resumed run's averages hold the checkpoint's steps

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        # Lightning orders ModelCheckpoint last, so a checkpoint of this step holds this update
        if trainer.global_step == self._step:  # a micro-batch of gradient accumulation: no optimizer step yet
            return
        self._step = trainer.global_step
        averages, params = self._pairs(pl_module)
        get_ema_multi_avg_fn(self.decay)(averages, params, None)  # torch's foreach lerp: one kernel per group

    @torch.no_grad()
    def _swap(self, pl_module) -> None:
        # in place, one tensor at a time: FSDP gathers from its sharded storage, and a copy of the whole model
        # would cost its memory again
        for a, p in zip(*self._pairs(pl_module), strict=True):
            raw = p.clone()
            p.copy_(a)
            a.copy_(raw)

    # Evaluate with the averages, then swap back before training resumes or a checkpoint is written
    # (ModelCheckpoint's on_validation_end runs after this one's).
    def on_validation_start(self, trainer, pl_module) -> None:
        self._swap(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._swap(pl_module)

    def on_test_start(self, trainer, pl_module) -> None:
        self._swap(pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._swap(pl_module)
