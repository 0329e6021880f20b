"""Strategy factories named by configs/strategy/*.yaml. Timeouts are plain seconds in config."""

from __future__ import annotations

from datetime import timedelta

from omegaconf import DictConfig

from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology, auto_strategy


def single(timeout: float | None = None):
    """One process: Lightning's 'auto' resolves to SingleDeviceStrategy when devices=1 (preflight checks).
    `timeout` is accepted so that every strategy takes it (debug=distributed sets it); one process has no group."""
    return "auto"


def auto(devices, num_nodes: int = 1, accelerator: str = "auto", timeout: float = 1800, **ddp_kwargs):
    """single on one device, else ddp with `ddp_kwargs` (Lightning's own choice for "auto")."""
    if auto_strategy(devices, num_nodes, accelerator) == "single":
        return single(timeout)
    return ddp(timeout, **ddp_kwargs)


def ddp(timeout: float = 1800, **kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(timeout=timedelta(seconds=timeout), **kwargs)


def ddp_spawn(timeout: float = 1800, start_method: str = "spawn", **kwargs):
    """DDP that starts its processes inside trainer.fit (multiprocessing): for notebooks and interactive use."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(start_method=start_method, timeout=timedelta(seconds=timeout), **kwargs)


def deepspeed(stage: int = 2, offload: bool = False, timeout: float = 1800, **kwargs):
    """DeepSpeed ZeRO: stage 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    from mlproject.distributed.zero import ZeroStrategy, use_extensions_cache

    use_extensions_cache()
    strategy = ZeroStrategy(
        stage=stage,
        offload_optimizer=offload,
        offload_parameters=offload and stage == 3,
        timeout=timedelta(seconds=timeout),
        **kwargs,
    )
    if offload:
        # With offload DeepSpeed refuses a torch optimizer unless told so. Its own CPU Adam would step faster,
        # but it is a C++ op compiled at first use, and the model's AdamW keeps the optimizer state the same
        # as under every other strategy (checkpoints resume anywhere).
        strategy.config["zero_force_ds_cpu_optimizer"] = False
    return strategy


def model_parallel(timeout: float = 1800, **degrees):
    """FSDP2 (HSDP with replicate_size > 1), tensor, expert and pipeline parallelism, applied by the model's
    configure_model (distributed/parallel.py, distributed/pipeline.py). `degrees`: ModelParallel's arguments."""
    from mlproject.distributed.parallel import ModelParallel

    return ModelParallel(timeout=timedelta(seconds=timeout), **degrees)


def check_model_parallel(cfg: DictConfig, topology: Topology) -> None:
    """Preflight for strategy=fsdp|hsdp|tp|fsdp_tp: what the model and the machine must allow (the topology's
    own shape was validated already)."""
    if not topology.model_parallel:
        return
    strategy, name = cfg.strategy, topology.strategy
    tp, ep = topology.tensor_parallel_size, topology.expert_parallel_size
    net, plan = cfg.model.get("net") or {}, cfg.model.get("parallel") or {}
    heads, experts = net.get("n_head"), net.get("n_expert")
    if heads is not None and heads % tp:
        raise ConfigError(f"model.net.n_head={heads} must divide by strategy.tensor_parallel_size={tp}")
    if ep > 1 and not plan.get("experts"):
        raise ConfigError(f"strategy.expert_parallel_size={ep} needs a mixture-of-experts model (e.g. model=gpt_moe)")
    if ep > 1 and (experts or 0) % ep:
        raise ConfigError(f"model.net.n_expert={experts} must divide by strategy.expert_parallel_size={ep}")
    if tp > 1 and not plan.get("colwise"):
        model = str(cfg.model.get("_target_", "the model")).rsplit(".", 1)[-1]
        raise ConfigError(
            f"strategy={name} splits layers named by a `parallel` plan in the model config (e.g. model=gpt); "
            f"{model} has none; use strategy=fsdp"
        )
    if topology.pipeline_parallel_size > 1:
        check_pipeline(cfg, topology)
    import torch

    if (strategy.get("fsdp") or {}).get("cpu_offload") and (
        cfg.trainer.accelerator == "cpu" or not torch.cuda.is_available()
    ):
        raise ConfigError("strategy.fsdp.cpu_offload=true moves GPU memory to the CPU; without a GPU set it to false")


def check_pipeline(cfg: DictConfig, topology: Topology) -> None:
    """Preflight for strategy.pipeline_parallel_size > 1: stages, micro-batches and batch must divide."""
    from mlproject.distributed.pipeline import SCHEDULES, min_microbatches, stages_per_rank

    pp, settings = topology.pipeline_parallel_size, cfg.strategy.get("pipeline") or {}
    schedule, m = settings.get("schedule"), int(settings.get("microbatches") or 0)
    plan, layers = cfg.model.get("parallel") or {}, (cfg.model.get("net") or {}).get("n_layer")
    model = str(cfg.model.get("_target_", "the model")).rsplit(".", 1)[-1]
    if not plan.get("pipeline"):
        raise ConfigError(f"pipeline parallelism splits the blocks named by model.parallel.pipeline; {model} has none")
    if plan.get("experts"):
        raise ConfigError("pipeline parallelism of a mixture-of-experts model is not supported yet; use fsdp with EP")
    if schedule not in SCHEDULES:
        raise ConfigError(f"strategy.pipeline.schedule={schedule} must be one of {', '.join(SCHEDULES)}")
    stages = pp * stages_per_rank(schedule)
    if layers is not None and (layers < stages or layers % stages):
        raise ConfigError(
            f"model.net.n_layer={layers} does not divide into {stages} pipeline stages ({schedule} on "
            f"pipeline_parallel_size={pp}); use a multiple of {stages} blocks"
        )
    if m < min_microbatches(schedule, pp):
        raise ConfigError(
            f"strategy.pipeline.microbatches={m}: {schedule} needs at least {min_microbatches(schedule, pp)} "
            f"(one per stage; more make the bubble smaller)"
        )
    if schedule == "interleaved_1f1b" and m % max(1, m // pp):
        raise ConfigError(f"strategy.pipeline.microbatches={m} must be a multiple of {m // pp} for interleaved_1f1b")
    if topology.accumulate > 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches must be 1 under pipeline parallelism: its micro-batches accumulate "
            "already; raise strategy.pipeline.microbatches instead"
        )
    if not cfg.strategy.get("save_distributed_checkpoint", True):
        raise ConfigError("strategy.save_distributed_checkpoint=false: a pipeline's stages save their own shards")
    if topology.training and topology.global_batch_size is not None and topology.per_device_batch_size % m:
        raise ConfigError(
            f"data.batch_size={topology.global_batch_size} gives {topology.per_device_batch_size} samples per "
            f"data-parallel rank, which do not divide into strategy.pipeline.microbatches={m}"
        )
