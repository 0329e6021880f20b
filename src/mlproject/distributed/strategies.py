"""Strategy factories named by configs/strategy/*.yaml. Timeouts are plain seconds in config."""

from __future__ import annotations

from datetime import timedelta


def single():
    """One process: Lightning's 'auto' resolves to SingleDeviceStrategy when devices=1 (preflight checks)."""
    return "auto"


def ddp(timeout: float = 1800, **kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(timeout=timedelta(seconds=timeout), **kwargs)


def model_parallel(timeout: float = 1800, tensor_parallel_size: int = 1, fsdp: dict | None = None, **kwargs):
    """FSDP2 and/or tensor parallelism, applied by the model's configure_model (distributed/parallel.py)."""
    from mlproject.distributed.parallel import ModelParallel

    return ModelParallel(tensor_parallel_size, fsdp, timeout=timedelta(seconds=timeout), **kwargs)
