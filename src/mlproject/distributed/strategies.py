"""Strategy factories named by configs/strategy/*.yaml. Timeouts are plain seconds in config."""

from __future__ import annotations

from datetime import timedelta


def single(timeout: float | None = None):
    """One process: Lightning's 'auto' resolves to SingleDeviceStrategy when devices=1 (preflight checks).
    `timeout` is accepted so that every strategy takes it (debug=distributed sets it); one process has no group."""
    return "auto"


def ddp(timeout: float = 1800, **kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(timeout=timedelta(seconds=timeout), **kwargs)


def model_parallel(timeout: float = 1800, tensor_parallel_size: int = 1, fsdp: dict | None = None, **kwargs):
    """FSDP2 and/or tensor parallelism, applied by the model's configure_model (distributed/parallel.py)."""
    from mlproject.distributed.parallel import ModelParallel

    return ModelParallel(tensor_parallel_size, fsdp, timeout=timedelta(seconds=timeout), **kwargs)


def ddp_spawn(timeout: float = 1800, start_method: str = "spawn", **kwargs):
    """DDP that starts its processes inside trainer.fit (multiprocessing): for notebooks and interactive use."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(start_method=start_method, timeout=timedelta(seconds=timeout), **kwargs)


def deepspeed(stage: int = 2, offload: bool = False, timeout: float = 1800, **kwargs):
    """DeepSpeed ZeRO: stage 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    from mlproject.distributed.deepspeed import ZeroStrategy, use_extensions_cache

    use_extensions_cache()
    return ZeroStrategy(
        stage=stage,
        offload_optimizer=offload,
        offload_parameters=offload and stage == 3,
        timeout=timedelta(seconds=timeout),
        **kwargs,
    )
