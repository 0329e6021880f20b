"""DeepSpeed ZeRO (stages 1-3, optional CPU offload) through Lightning, on GPU and, for debugging, on CPU."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn

from mlproject.core.constants import PROJECT_ROOT


def use_extensions_cache() -> None:
    """DeepSpeed JIT-compiles C++ ops on first use (about 20 s on CPU): keep them in one cache, not per run."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(PROJECT_ROOT / ".torch_extensions"))


def loads_natively(path: Path, world: int, zero3: bool) -> bool:
    """Whether DeepSpeed's engine loads `path` itself: its own checkpoint, same world size and ZeRO layout."""
    from mlproject.checkpoint.convert import checkpoint_format

    if not path.is_dir() or checkpoint_format(path) != "deepspeed":
        return False
    shards = path / (path / "latest").read_text().strip()
    ranks, stage3 = len(list(shards.glob("*_optim_states.pt"))), any(shards.glob("zero_pp_rank_*_model_states.pt"))
    return (ranks, stage3) == (world, zero3)


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
        # DeepSpeed's CPU backend builds its shared-memory all-reduce at start (probing compilers, and a ~20 s
        # JIT compile on first use), though only its inference path uses it; training reduces through gloo.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # deepspeed.comm.torch is torch
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

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        # DeepSpeed's engine loads only its own checkpoints of the same world size and ZeRO layout; any other
        # (a file, fsdp shards, another DeepSpeed layout) is read in full and scattered into the partitions.
        from mlproject.checkpoint.convert import load_full

        path = Path(self.broadcast(checkpoint_path))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # else the engine has no optimizer
        if not fitting or loads_natively(path, self.world_size, self.zero_stage_3):
            return super().load_checkpoint(path, weights_only)
        checkpoint = load_full(path)
        self._scatter(checkpoint["state_dict"], checkpoint["optimizer_states"][0])
        return checkpoint  # Lightning restores the rest (loops, callbacks, lr_schedulers) from it

    def _scatter(self, state_dict: dict, optimizer: dict) -> None:
        """Full weights, buffers and AdamW state (keyed by position) into this rank's ZeRO partitions."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        zero, module = self.deepspeed_engine.optimizer, self.lightning_module
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                if name in state_dict:  # non-persistent buffers are the model's to rebuild
                    buffer.copy_(state_dict[name])
        # The base optimizer keeps its state per flat fp32 partition and creates it at the first step;
        # DeepSpeed's setters write into existing state only, so create it (stage 1/2 then link each
        # parameter's fragment of it, as its first step would).
        flats = zero.fp32_partitioned_groups_flat if self.zero_stage_3 else zero.single_partition_of_fp32_groups
        if first := next(iter(optimizer["state"].values()), None):
            for flat in flats:
                zero.optimizer.state[flat] = {
                    k: v.clone() if k == "step" else torch.zeros_like(flat) for k, v in first.items()
                }
            if not self.zero_stage_3:
                zero._lazy_init_hp_params_optimizer_state()
        for group, saved in zip(zero.optimizer.param_groups, optimizer["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})  # lr, initial_lr, betas...
        # positions run over the torch optimizer's param groups, which ZeRO keeps in order
        names = {p: name for name, p in module.named_parameters()}
        groups = zero.fp16_groups if self.zero_stage_3 else zero.bit16_groups
        for i, p in enumerate(p for group in groups for p in group):
            safe_set_full_fp32_param(p, state_dict[names[p]])
            for key, value in optimizer["state"].get(i, {}).items():
                if key != "step":
                    safe_set_full_optimizer_state(p, value, key)
        # the module's parameters from the fp32 master, as after an optimizer step
        if self.zero_stage_3:
            for i in range(len(flats)):
                zero._reassign_or_swap_out_partitioned_parameters(i)
        else:
            zero.update_lp_params()
