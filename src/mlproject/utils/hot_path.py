"""Per-step costs of Lightning 2.6 that a run does not need, avoided by build_trainer and our LightningModules.
Each is host CPU time spent on every training step, which shows on small models (the digits CNN's steps take
~10 ms on a CPU)."""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric


class PlainHookName:
    """A LightningModule mixin: Lightning sets the module's `_current_fx_name` before and after every hook call
    (~50 times a training step) through nn.Module.__setattr__, ~1.2 us of CPU each for a string no parameter,
    buffer or submodule can be; here it is a plain attribute."""

    def __setattr__(self, name: str, value) -> None:
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


class NoProfiler(PassThroughProfiler):
    """Lightning's default profiler (none), without its generator-based `profile` context (~1 us of CPU): Lightning
    enters one around every hook it calls on the module, the strategy and each callback, ~50 times a step."""

    def profile(self, action_name: str):
        return contextlib.nullcontext(action_name)


def skip_redundant_log_moves() -> None:
    """Every `self.log` call moves the value's accumulator to the value's device by walking (and deep-copying)
    all its attributes, even when it is there already (Lightning 2.6, `_ResultCollection.log`): ~0.15 ms of
    CPU a call, over a tenth of a small model's step. The walk is skipped for a tensor's accumulator already on
    that device, where it would move nothing."""
    move = _ResultMetric.to
    if getattr(move, "skips_redundant_moves", False):
        return

    def to(self, *args, **kwargs):
        device = args[0] if len(args) == 1 and not kwargs else None
        if self.is_tensor and isinstance(device, torch.device) and self.value.device == device:
            return self
        return move(self, *args, **kwargs)

    to.skips_redundant_moves = True
    _ResultMetric.to = to
