"""Per-step costs that a run does not need, of Lightning 2.6 and of glibc's malloc, avoided by build_trainer and
our LightningModules. Each is host CPU time spent on every training step, which shows on small models (the
digits CNN's steps take ~10 ms on a CPU)."""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch
from lightning.pytorch import Callback
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric


class LeanModule:
    """A LightningModule mixin that removes two per-step costs of Lightning 2.6, neither of which changes what a
    run writes to its loggers:

    - Lightning sets the module's `_current_fx_name` before and after every hook call (~50 times a training
      step) through nn.Module.__setattr__, ~1.2 us of CPU each for a string no parameter, buffer or submodule
      can be; here it is a plain attribute.
    - Each `self.log` call costs ~0.12 ms of CPU (~200 Python calls), over a tenth of a small model's step. A
      per-step value logged in training_step (on_step, Lightning's default there) is recorded only where
      Lightning writes step values to the loggers (every `trainer.log_every_n_steps` optimizer steps, and when
      the run stops) and at an epoch's last batch (the progress line). In between, `trainer.callback_metrics`
      keeps the last value recorded; epoch values (`on_epoch=True`) are recorded at every call.
    """

    def __setattr__(self, name: str, value) -> None:
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def log(self, name: str, value, *args, **kwargs) -> None:
        step_only = kwargs.get("on_step") is not False and kwargs.get("on_epoch") is not True
        if args or not step_only or self._current_fx_name != "training_step" or self._writes_step_values():
            super().log(name, value, *args, **kwargs)

    def _writes_step_values(self) -> bool:
        trainer = self._trainer
        return trainer is None or trainer._logger_connector.should_update_logs or trainer.is_last_batch


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


@functools.cache
def overridden_hooks(cls: type) -> frozenset[str]:
    """The hooks that a Callback class defines anew: Callback's own do nothing."""
    hooks = (name for name in dir(Callback) if callable(getattr(Callback, name)))
    return frozenset(name for name in hooks if getattr(cls, name) is not getattr(Callback, name))


def call_only_overridden_callback_hooks() -> None:
    """Lightning calls each hook (6 a training step) on every callback, overridden or not, inside a profiler
    context named by the callback's `state_key` (ModelCheckpoint's formats a repr of its settings each time):
    ~9 us of CPU a hook with the default callbacks, against ~2.5 us here, where without a profiler
    (NoProfiler) only the callbacks that define a hook, on their class or their instance, are called, in the
    same order: the others would do nothing. With a profiler, or for the monitoring-callback subsets,
    Lightning's own dispatch runs."""
    original = call._call_callback_hooks
    if hasattr(original, "lightnings"):
        return

    def _call_callback_hooks(trainer, hook_name: str, *args, monitoring_callbacks=None, **kwargs) -> None:
        if monitoring_callbacks is not None or type(trainer.profiler) is not NoProfiler:
            return original(trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs)
        pl_module = trainer.lightning_module
        if pl_module:
            previous, pl_module._current_fx_name = pl_module._current_fx_name, hook_name
        for callback in trainer.callbacks:
            if hook_name in overridden_hooks(type(callback)) or hook_name in vars(callback):
                getattr(callback, hook_name)(trainer, pl_module, *args, **kwargs)
        if pl_module:
            pl_module._current_fx_name = previous

    _call_callback_hooks.lightnings = original
    call._call_callback_hooks = _call_callback_hooks


def keep_freed_host_memory() -> None:
    """glibc's malloc hands freed blocks of a few hundred kB back to the OS as soon as they are freed, until it
    has seen a large block freed, and then keeps up to twice that at the top of its heap: so a training step,
    which frees and allocates its activations again, page-faults them in anew every step (60 to 550 faults a
    digits step, 10 to 40% of its time, varying from run to run with what the process happened to free first).
    Set from the start here, the thresholds glibc itself moves up to: blocks under 32 MiB come from the heap,
    and up to 64 MiB freed at its top stay. Other C libraries (macOS, musl) are left as they are."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 64 << 20)
