"""Checks of how a job's processes are started, made before anything heavy is imported."""

from __future__ import annotations

import importlib.util
import os

from omegaconf import DictConfig

from mlproject.config import ConfigError, generated_run_id, world_size

# Strategies that run in the processes they are started in: `single` has one, `ddp_spawn` forks its own.
NO_RELAUNCH = ("single", "ddp_spawn")


def strategy_name(cfg: DictConfig) -> str:
    return cfg.strategy.get("_target_", "").rsplit(".", 1)[-1] if cfg.get("strategy") else ""


def launched_externally() -> bool:
    """torchrun sets LOCAL_RANK for each process; SLURM starts one task per process."""
    return "LOCAL_RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def check_launch(cfg: DictConfig, multirun: bool) -> None:
    strategy, nodes = strategy_name(cfg), int(cfg.trainer.get("num_nodes", 1))
    per_node = world_size(cfg) // nodes
    if multirun and per_node > 1 and strategy not in NO_RELAUNCH and not launched_externally():
        raise ConfigError(
            f"hydra multirun (-m) cannot use strategy={strategy}: it re-runs this script once per process, "
            "which would start the whole sweep again in each; use the SLURM launcher "
            "(hydra/launcher=submitit_slurm) or strategy=ddp_spawn"
        )
    if nodes > 1 and cfg.get("run_id") == generated_run_id():
        raise ConfigError(
            f"trainer.num_nodes={nodes}: every node must write into one run directory, but this node made up "
            "its own run id; pass the same run_id=<name> on every node (SLURM and torchrun --rdzv-id do it for you)"
        )


def check_deepspeed(cfg: DictConfig) -> None:
    if strategy_name(cfg) != "deepspeed":
        return
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("strategy=deepspeed_* needs DeepSpeed; install it with pip install '.[deepspeed]'")
    import torch

    precision = str(cfg.trainer.precision)
    cpu = cfg.trainer.accelerator == "cpu" or not torch.cuda.is_available()
    if precision.endswith("-true") and precision != "32-true":
        raise ConfigError(
            f"trainer.precision={precision} with DeepSpeed: DeepSpeed keeps fp32 master weights itself, so "
            "pure half precision cannot be had; use trainer.precision=bf16-mixed"
        )
    if cpu and precision != "32-true":
        raise ConfigError("DeepSpeed on CPU runs in fp32 only (a debugging mode); use trainer.precision=32-true")
    if cpu and cfg.strategy.get("offload"):
        raise ConfigError("DeepSpeed offload moves state from GPU to CPU memory; on CPU use strategy=deepspeed_stage_3")
