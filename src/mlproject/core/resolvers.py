"""The `${name:}` resolvers the configs use. Entry points register them (`register_resolvers`) before composing."""

from __future__ import annotations

import os
import secrets
from datetime import datetime

from omegaconf import OmegaConf

from mlproject.core.constants import PROJECT_ROOT

_GENERATED_RUN_ID = [""]  # the id run_id() made up in this process, if it did (one node cannot share it)


def run_id() -> str:
    """One id per job, the same on every rank and every requeue.

    SLURM_JOB_ID survives requeues; TORCHELASTIC_RUN_ID is shared by torchrun's workers. Otherwise the
    first process creates an id and exports it, so that the processes Lightning launches for the other
    ranks (which inherit the environment) write into the same directory.
    """
    for var in ("MLPROJECT_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(var):
            return os.environ[var]
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return os.environ["TORCHELASTIC_RUN_ID"]
    rid = f"{datetime.now():%Y-%m-%d_%H-%M-%S}_{secrets.token_hex(2)}"
    os.environ["MLPROJECT_RUN_ID"] = _GENERATED_RUN_ID[0] = rid
    return rid


def generated_run_id() -> str:
    return _GENERATED_RUN_ID[0]


def on_gpu(accelerator: str) -> bool:
    """Whether the trainer will run on a CUDA GPU: asked of the accelerator the config names, not the host."""
    if accelerator in ("gpu", "cuda"):
        return True
    import torch

    return accelerator == "auto" and torch.cuda.is_available()


def default_precision(accelerator: str = "auto") -> str:
    """bf16-mixed on a CUDA GPU that supports it, else full fp32 (CPU autocast is slow and lossy)."""
    if not on_gpu(accelerator):
        return "32-true"
    import torch

    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def distributed_debug_level(accelerator: str = "auto") -> str:
    """TORCH_DISTRIBUTED_DEBUG for debug=distributed: DETAIL (collective checks) on GPU; INFO on CPU, where
    DETAIL makes torch 2.13's DistributedDataParallel segfault over gloo."""
    return "DETAIL" if on_gpu(accelerator) else "INFO"


def register_resolvers() -> None:
    # Cached: run_id must be one value per job. Not cached: precision and the debug level, whose cache key
    # would be the argument's text (`${trainer.accelerator}`), not its value, so a config that changed
    # its accelerator (or a copy of one) would keep the first answer.
    for name, fn, cache in (
        ("run_id", run_id, True),
        ("precision", default_precision, False),
        ("distributed_debug_level", distributed_debug_level, False),
        ("project_root", lambda: os.environ.get("PROJECT_ROOT", str(PROJECT_ROOT)), True),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=cache)
