# feature: slurm, kubernetes
"""What the schedulers' modules share: the job each writes for `mlproject.submit`, the check that the Trainer asks
for exactly what the job is given, and config values kept on one line of what a scheduler reads."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mlproject.core.errors import ConfigError


@dataclass(frozen=True)
class Job:
    """A job written for a scheduler, and how `mlproject.submit` hands it over."""

    text: str  # the sbatch script or the manifest: what --dry-run prints, and what `command` reads on stdin
    kind: str  # what `text` is, as messages name it: "sbatch script", "manifest"
    command: list[str]  # the scheduler's client, which submits `text`
    submitted: Callable[[str], str]  # the client's output -> what to print: the job and where to follow it
    log_dir: Path | None = None  # made before submitting: where the scheduler writes the job's log
    env: dict[str, str] | None = None  # the client's environment (None: this one)


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


def single_line(key: str, value: object, where: str) -> str:
    """`value` as text that stays on one line of `where`: line breaks (YAML's too) and other control characters
    are refused, naming `key`."""
    text = str(value)
    if any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") for ch in text):
        raise ConfigError(
            f"{key}={text!r} holds a line break or control character, which cannot be written into {where}; remove it"
        )
    return text


def given_run_id(cfg: DictConfig) -> str | None:
    """The run_id the config or an override sets, which every process of the job composes alike; None where it
    is the `${run_id:}` resolver's: the job's own id, which its scheduler gives it."""
    return None if OmegaConf.is_interpolation(cfg, "run_id") else str(cfg.run_id)


# /feature: slurm, kubernetes
