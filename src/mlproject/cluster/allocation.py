"""The one check SLURM and Kubernetes jobs share: the Trainer asks for exactly what the job is given."""

from __future__ import annotations

from omegaconf import DictConfig

from mlproject.core.errors import ConfigError


def check_allocation(cfg: DictConfig, scheduler: str, per_node: str, whole: dict[str, int], starter: str) -> None:
    """With cluster.scheduler=`scheduler`: `whole` keys are whole numbers >= their least value, and the Trainer's
    num_nodes and devices are cluster.nodes and cluster.<per_node>, one process per GPU (`starter` starts them)."""
    c = cfg.get("cluster") or {}
    if c.get("scheduler") != scheduler:
        return
    for key, least in whole.items():
        if isinstance(c[key], bool) or not isinstance(c[key], int) or c[key] < least:
            raise ConfigError(f"cluster.{key}={c[key]!r} should be a whole number >= {least}")
    t = cfg.trainer
    if t.num_nodes != c.nodes:
        raise ConfigError(
            f"trainer.num_nodes={t.num_nodes} but cluster.nodes={c.nodes}; set cluster.nodes only "
            "(trainer.num_nodes follows it)"
        )
    if t.devices != c[per_node]:
        raise ConfigError(
            f"trainer.devices={t.devices} but cluster.{per_node}={c[per_node]}; set cluster.gpus_per_node "
            f"(or cluster.{per_node} on CPU nodes) only (trainer.devices follows it)"
        )
    if c.gpus_per_node and c[per_node] != c.gpus_per_node:
        raise ConfigError(
            f"cluster.{per_node}={c[per_node]} but cluster.gpus_per_node={c.gpus_per_node}; "
            f"{starter} one process per GPU: leave {per_node} at its default"
        )
    if c.gpus_per_node and t.accelerator == "cpu":
        raise ConfigError(f"cluster.gpus_per_node={c.gpus_per_node} with trainer=cpu; use trainer=gpu")
    if not c.gpus_per_node and t.accelerator in ("gpu", "cuda"):
        raise ConfigError("trainer.accelerator=gpu but cluster.gpus_per_node=0; set cluster.gpus_per_node")
