"""DeepSpeed ZeRO (stages 1-3, optional CPU offload) through Lightning, on GPU and, for debugging, on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn

from mlproject.core.constants import PROJECT_ROOT
from mlproject.utils import compat


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


# feature: object_storage
def staging(url: str) -> Path:
    """This node's folder for a copy of the checkpoint at `url`: the same on every rank of the node."""
    import hashlib
    import tempfile

    key = hashlib.sha1(url.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "mlproject-deepspeed" / key


def upload(local: Path, url: str, skip: str | None = None, only: str | None = None) -> None:
    """Put the files of folder `local` under `url` (relative paths kept): all but `skip`, or only `only`."""
    from fsspec.core import url_to_fs

    fs, _ = url_to_fs(url)
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        name = file.relative_to(local).as_posix()
        if name != skip and (only is None or name == only):
            fs.put_file(str(file), f"{url.rstrip('/')}/{name}")


# /feature: object_storage
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
        with compat.no_shm_allreduce():
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

    # feature: object_storage
    # DeepSpeed reads and writes its checkpoint folders with local file I/O: a checkpoint in object storage
    # (paths.ckpt_dir=s3://...) goes through a copy on each node's disk (staging), uploaded or downloaded by the
    # node's local rank 0.
    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        import shutil

        from mlproject.checkpoint.object_storage import is_remote

        filepath = self.broadcast(str(filepath))
        if not is_remote(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        local = staging(filepath)
        if self.local_rank == 0:
            shutil.rmtree(local, ignore_errors=True)
        self.barrier("deepspeed_staging_cleared")
        super().save_checkpoint(checkpoint, str(local), storage_options)
        self.barrier("deepspeed_staged")
        if self.local_rank == 0:  # each node its ranks' shards; `latest`, which marks the folder complete, last
            upload(local, filepath, skip="latest")
        self.barrier("deepspeed_uploaded")
        if self.global_rank == 0:
            upload(local, filepath, only="latest")
        self.barrier("deepspeed_complete")
        if self.local_rank == 0:
            shutil.rmtree(local)

    def remove_checkpoint(self, filepath) -> None:
        from mlproject.checkpoint.object_storage import is_remote, remove_remote

        if is_remote(filepath):
            if self.is_global_zero:
                remove_remote(str(filepath))  # `latest` first: no partly removed folder reads as complete
            return
        super().remove_checkpoint(filepath)

    # /feature: object_storage
    def load_checkpoint(self, checkpoint_path, weights_only=None):
        path = self.broadcast(str(checkpoint_path))
        # feature: object_storage
        from mlproject.checkpoint.object_storage import is_remote

        if is_remote(path):
            return self._load_url(path, weights_only)
        # /feature: object_storage
        return self._load_local(Path(path), weights_only)

    # feature: object_storage
    def _load_url(self, path: str, weights_only=None):
        import shutil

        from mlproject.checkpoint.object_storage import download

        local = staging(path)
        if self.local_rank == 0:
            shutil.rmtree(local, ignore_errors=True)
            download(path, local)
        self.barrier("deepspeed_downloaded")
        try:
            return self._load_local(local, weights_only)
        finally:
            self.barrier("deepspeed_loaded")
            if self.local_rank == 0 and local.is_dir():
                shutil.rmtree(local)
            elif self.local_rank == 0:
                local.unlink()

    # /feature: object_storage
    def _load_local(self, path: Path, weights_only=None):
        # DeepSpeed's engine loads only its own checkpoints of the same world size and ZeRO layout. Any other is
        # scattered into this rank's partitions, reading only the slices it will hold: from another DeepSpeed
        # layout, from fsdp/hsdp/tp shards (the stored chunks that overlap them) or from a file (convert.sliced_file).
        # Every pickle is read weights-only (DeepSpeed's engine unpickles in full: checked first), and a checkpoint
        # of another model or size is refused in one line, as in ModelParallel.load_checkpoint.
        from mlproject.checkpoint.convert import (
            check_fits,
            check_unpickles,
            checkpoint_format,
            saved_shapes,
            sliced_file,
        )
        from mlproject.checkpoint.dcp_shards import DcpShards
        from mlproject.checkpoint.zero_shards import ZeroShards

        check_unpickles(path)
        check_fits(saved_shapes(path), self.lightning_module, path)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # else the engine has no optimizer
        if not fitting or loads_natively(path, self.world_size, self.zero_stage_3):
            return super().load_checkpoint(path, weights_only)
        if path.is_dir():
            if checkpoint_format(path) == "deepspeed":
                shards = ZeroShards(path)
                rest = {k: v for k, v in shards.client.items() if k not in ("module", "optimizer", "lr_scheduler")}
            else:
                shards = DcpShards(path)
                rest = shards.client
            self._scatter(shards.read, shards.buffers, shards.optimizer)
            return rest  # Lightning restores the rest (loops, callbacks, lr_schedulers) from it
        checkpoint, read = sliced_file(path, [[self._names()]])  # one group: ZeRO's order is the positions'
        state_dict, optimizer = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states")[0]
        self._scatter(read, state_dict, optimizer)
        return checkpoint

    def _names(self) -> list[str]:
        """The parameters' names in ZeRO's order, the torch optimizer's positions over its param groups."""
        zero = self.deepspeed_engine.optimizer
        names = {p: name for name, p in self.lightning_module.named_parameters()}
        return [names[p] for group in (zero.fp16_groups if self.zero_stage_3 else zero.bit16_groups) for p in group]

    @torch.no_grad()
    def _scatter(self, read, buffers: dict, optimizer: dict) -> None:
        """Weights, buffers and AdamW state into this rank's ZeRO partitions: `read(name, key, start, numel)`
        gives elements of a flattened parameter (`key` None) or of its optimizer state `key`; `optimizer` has
        the saved param groups' hyperparameters and a state entry to take the step count from."""
        zero, module = self.deepspeed_engine.optimizer, self.lightning_module
        for name, buffer in module.named_buffers():
            if name in buffers:  # non-persistent buffers are the model's to rebuild
                buffer.copy_(buffers[name])
        # The base optimizer keeps its state per flat fp32 partition and creates it at the first step; create it
        # (stage 1/2 then link each parameter's fragment of it, as its first step would).
        flats = zero.fp32_partitioned_groups_flat if self.zero_stage_3 else zero.single_partition_of_fp32_groups
        first = next(iter(optimizer["state"].values()), None)
        if first:
            for flat in flats:
                zero.optimizer.state[flat] = {
                    k: v.clone() if k == "step" else torch.zeros_like(flat) for k, v in first.items()
                }
            if not self.zero_stage_3:
                compat.zero_init_optimizer_state(zero)
        for group, saved in zip(zero.optimizer.param_groups, optimizer["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})  # lr, initial_lr, betas...
        keys = [None, *(k for k in first or {} if k != "step")]
        params = dict(module.named_parameters())
        for name in self._names():
            p = params[name]
            for key in keys:
                # DeepSpeed's safe_set_full_* take the full tensor and keep a slice: read only the slice
                if self.zero_stage_3:
                    partition, start = compat.zero3_slice(zero, p, key)
                    numel = max(0, min(partition.numel(), p.ds_numel - start))
                    partition[:numel].copy_(read(name, key, start, numel))
                elif fragment := compat.zero12_fragment(p, key):  # stage 1/2: None where this rank holds none
                    out, start, numel = fragment
                    out.copy_(read(name, key, start, numel))
        # the module's parameters from the fp32 master, as after an optimizer step
        if self.zero_stage_3:
            for i in range(len(flats)):
                compat.zero3_publish(zero, i)
        else:
            zero.update_lp_params()
