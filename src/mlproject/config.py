"""Config plumbing shared by the entry points: Hydra entry with one-line errors, resolvers, preflight."""

from __future__ import annotations

import functools
import os
import secrets
import sys
from datetime import datetime
from pathlib import Path

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = PROJECT_ROOT / "configs"
IGNORE_INDEX = -100  # target value of padded evaluation samples; losses and metrics skip it


class ConfigError(ValueError):
    """A setting that cannot work; the message says how to fix it."""


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


_GENERATED_RUN_ID = [""]  # the id run_id() made up in this process, if it did (one node cannot share it)


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


register_resolvers()


def one_line(exc: BaseException) -> str:
    """Hydra and OmegaConf errors span many lines (search paths, full keys); keep what a user needs."""
    text = str(exc).split("Config search path")[0]
    cause = str(exc.__cause__ or "")
    if cause and cause not in text and not isinstance(exc, ConfigError):
        text += "\n" + cause
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("full_key:", "object_type=", "reference_type="))]
    return " ".join(ln if ln.endswith((".", ":")) else ln + "." for ln in lines).replace(": .", ":")


def hydra_entry(config_name: str):
    """`hydra.main` on configs/<config_name>.yaml; a config mistake ends with one line and exit code 2.

    Hydra prints multi-line reports for bad overrides; we ask it to raise instead (HYDRA_FULL_ERROR)
    and print one line, unless the user set HYDRA_FULL_ERROR=1 to see the traceback.
    """

    def decorator(task):
        errors = (HydraException, OmegaConfBaseException, ConfigError)

        def report(exc: BaseException, full: bool):
            if full:
                raise exc
            print(f"error: {one_line(exc)}", file=sys.stderr)
            sys.exit(2)

        @functools.wraps(task)
        def job(cfg):
            from mlproject.distributed.launch import local_ranks_end

            # Errors inside the job are caught here: Hydra would first print its own multi-line header.
            try:
                with local_ranks_end():  # the local ranks a task started (launch_local_ranks) end with it
                    return task(cfg)
            except errors as exc:
                report(exc, os.environ.get("_MLPROJECT_FULL_ERROR") == "user")

        wrapped = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=config_name)(job)

        @functools.wraps(task)
        def main():
            if config_name == "train":  # resuming another run's checkpoint continues in that run's directory
                from mlproject.checkpoint.resume import continue_run_of_checkpoint

                continue_run_of_checkpoint(sys.argv[1:])
            if "_MLPROJECT_FULL_ERROR" not in os.environ:  # child processes inherit the user's choice
                os.environ["_MLPROJECT_FULL_ERROR"] = "user" if os.environ.get("HYDRA_FULL_ERROR") == "1" else "1"
            os.environ["HYDRA_FULL_ERROR"] = "1"
            try:
                return wrapped()
            except errors as exc:
                report(exc, os.environ["_MLPROJECT_FULL_ERROR"] == "user")
            except ValueError as exc:  # Hydra reports `group=null` with a plain ValueError
                if "Config group override must be" not in str(exc):
                    raise
                hint = ConfigError(f"{exc}; to drop a config group use ~<group>, e.g. ~logger")
                report(hint, os.environ["_MLPROJECT_FULL_ERROR"] == "user")

        return main

    return decorator


def world_size(cfg: DictConfig) -> int:
    """Processes in the job, from trainer.devices and trainer.num_nodes, as Lightning will count them."""
    devices, accelerator = cfg.trainer.devices, cfg.trainer.accelerator
    if isinstance(devices, str) and devices != "auto":
        devices = int(devices) if devices.strip().lstrip("-").isdigit() else len(devices.split(","))
    if devices in ("auto", -1):
        import torch

        gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        devices = torch.cuda.device_count() if gpu else 1
    elif not isinstance(devices, int):
        devices = len(devices)
    return devices * int(cfg.trainer.get("num_nodes", 1))


def data_parallel_size(cfg: DictConfig) -> int:
    """Processes that read different batches: a tensor-parallel group reads one batch together."""
    return world_size(cfg) // int((cfg.get("strategy") or {}).get("tensor_parallel_size", 1))


def per_device_batch_size(batch_size: int, world: int, accumulate: int = 1) -> int:
    """The global batch size split over processes and accumulation steps; it must divide exactly."""
    if batch_size % (world * accumulate):
        raise ConfigError(
            f"data.batch_size={batch_size} is the global batch size and must divide by world size {world} "
            f"x trainer.accumulate_grad_batches {accumulate}; use a multiple of {world * accumulate}"
        )
    return batch_size // (world * accumulate)


def check_override_types(cfg: DictConfig) -> None:
    """Refuse `key=value` overrides whose type differs from the default's (e.g. trainer.max_epochs=ten).

    Hydra accepts any value for a key in a plain YAML config; the mistake would otherwise surface deep
    inside Lightning. Compare against the same config composed with the group choices only.
    """
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hc = HydraConfig.get()
    overrides = OverridesParser.create().parse_overrides(list(hc.overrides.task))
    groups = set(hc.runtime.choices)
    values = [o for o in overrides if o.key_or_group not in groups and not o.is_delete() and not o.is_add()]
    if not values or hc.mode.name == "MULTIRUN":  # sweep values are lists and ranges: checked per trial
        return
    base = compose(hc.job.config_name, [o.input_line for o in overrides if o not in values])
    for o in values:
        if o.key_or_group.startswith("hydra."):
            continue
        default, given = OmegaConf.select(base, o.key_or_group), OmegaConf.select(cfg, o.key_or_group)
        if default is None or given is None or isinstance(default, str):
            continue
        expected = (int, float) if isinstance(default, float) else type(default)
        if isinstance(given, bool) != isinstance(default, bool) or not isinstance(given, expected):
            raise ConfigError(
                f"{o.key_or_group}={given!r} must be of type {type(default).__name__}, like the default {default!r}"
            )


def preflight(cfg: DictConfig) -> None:
    """Every impossible setting, caught before anything is built, with the fix in one line."""
    import torch

    from mlproject.cluster.slurm import check_in_job

    check_override_types(cfg)
    check_in_job(cfg)
    accelerator, world = cfg.trainer.accelerator, world_size(cfg)
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("trainer.accelerator=gpu but no CUDA GPU is visible; use trainer=cpu")
        if isinstance(cfg.trainer.devices, int) and cfg.trainer.devices > torch.cuda.device_count():
            raise ConfigError(
                f"trainer.devices={cfg.trainer.devices} but this machine has {torch.cuda.device_count()} "
                f"GPU(s); use trainer.devices={torch.cuda.device_count()} or fewer"
            )
    strategy = cfg.strategy.get("_target_", "").rsplit(".", 1)[-1] if cfg.get("strategy") else ""
    if strategy == "single" and world > 1:
        raise ConfigError(
            f"strategy=single runs one process but trainer.devices x trainer.num_nodes = {world}; "
            "use strategy=ddp (or trainer.devices=1)"
        )
    precision = str(cfg.trainer.precision)
    if precision.startswith("16") and (accelerator == "cpu" or not torch.cuda.is_available()):
        raise ConfigError(
            f"trainer.precision={precision} needs a CUDA GPU (on CPU Lightning would silently use bf16); "
            "use trainer.precision=32-true or bf16-mixed"
        )
    from mlproject.distributed.strategies import check_model_parallel

    check_model_parallel(cfg)
    if "data" in cfg and "batch_size" in cfg.data:
        accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
        per_device_batch_size(cfg.data.batch_size, data_parallel_size(cfg), accumulate)
    ckpt = cfg.get("ckpt_path")
    if ckpt and ckpt != "auto" and not Path(ckpt).exists():
        raise ConfigError(f"ckpt_path={ckpt} does not exist; give the path of a .ckpt file")
    from hydra.core.hydra_config import HydraConfig

    from mlproject.distributed.launch import check_deepspeed, check_launch

    check_launch(cfg, multirun=HydraConfig.initialized() and HydraConfig.get().mode.name == "MULTIRUN")
    check_deepspeed(cfg)


def check_monitors(callbacks: list, model) -> None:
    """A checkpoint or early-stopping monitor must be equal on every rank, or ranks decide differently
    (one saves, one does not) and the job hangs in the next collective."""
    synced = getattr(model, "synced_metrics", None)
    for callback in callbacks:
        monitor = getattr(callback, "monitor", None)
        if monitor and synced is not None and monitor not in synced:
            raise ConfigError(
                f"{type(callback).__name__} monitors '{monitor}', which is not synced across ranks; "
                f"use one of: {', '.join(sorted(synced))}"
            )
