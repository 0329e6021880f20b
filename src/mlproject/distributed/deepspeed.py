"""DeepSpeed ZeRO (stages 1-3, optional CPU offload) through Lightning, on GPU and, for debugging, on CPU."""

from __future__ import annotations

import os

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn

from mlproject.config import PROJECT_ROOT


def use_extensions_cache() -> None:
    """DeepSpeed JIT-compiles C++ ops on first use (about 20 s on CPU): keep them in one cache, not per run."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".torch_extensions"))


class ZeroStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, plus a CPU mode and a working `sync_batchnorm`."""

    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            return super().setup_environment()
        # Lightning refuses DeepSpeed without CUDA, but DeepSpeed runs on CPU over gloo: slow, yet exact,
        # which lets the tests (and a laptop) check a ZeRO run against a single process.
        os.environ["DS_ACCELERATOR"] = "cpu"
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            return super().setup_distributed()
        reset_seed()  # as DeepSpeedStrategy does, minus its check of CUDA device indices
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        device = super().root_device
        # deepspeed.initialize compares Lightning's device index with 0; "cpu" has none, "cpu:0" is the same CPU.
        return torch.device("cpu", 0) if device.type == "cpu" else device

    def setup(self, trainer) -> None:
        # DeepSpeedStrategy.setup skips Lightning's layer sync, so sync_batchnorm would be silently ignored.
        if self._layer_sync and trainer.state.fn == TrainerFn.FITTING:
            self.model = self._layer_sync.apply(self.model)
        super().setup(trainer)
