"""The `${name:}` resolvers the configs use. Entry points register them (`register_resolvers`) before composing."""

from __future__ import annotations

import os
import secrets
from datetime import datetime

from omegaconf import OmegaConf

from mlproject.core.constants import PROJECT_ROOT

_GENERATED_RUN_ID = [""]  # the id run_id() made up in this process, if it did (one node cannot share it)


def run_id() -> str:
    """One id per job, the same on every rank and every restart.

    A scheduler's job id survives its requeues; TORCHELASTIC_RUN_ID is shared by torchrun's workers. Otherwise
    the first process creates an id and exports it, so that the processes Lightning launches for the other
    ranks (which inherit the environment) write into the same directory.
    """
    if os.environ.get("MLPROJECT_RUN_ID"):
        return os.environ["MLPROJECT_RUN_ID"]
    # feature: slurm
    if os.environ.get("SLURM_JOB_ID"):
        return os.environ["SLURM_JOB_ID"]
    # /feature: slurm
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


def nvml_gpus() -> list[tuple[tuple[int, int], int]] | None:
    """(CUDA compute capability, total memory in bytes) of each GPU NVML (the driver's management library) lists.
    torch.cuda's answers (get_device_capability, get_device_properties) initialise CUDA in a process that has no
    device yet, before Lightning gives each rank its own: ranks forked from it then fail, and each process holds a
    context on the first GPU. None where NVML is not there or does not answer. A MIG slice reads as its whole GPU."""
    import ctypes

    class Memory(ctypes.Structure):  # nvmlMemory_t
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count, gpus = ctypes.c_uint(), []
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        for index in range(count.value):
            handle, major, minor, memory = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int(), Memory()
            if (
                nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0
                or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0
                or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0
            ):
                return None
            gpus.append(((major.value, minor.value), memory.total))
        return gpus
    finally:
        nvml.nvmlShutdown()


def gpu_capability() -> tuple[int, int] | None:
    """The lowest compute capability among this machine's GPUs, read without initialising CUDA (nvml_gpus)."""
    return min((capability for capability, _ in nvml_gpus() or ()), default=None)


# feature: planner
def gpu_memory() -> int | None:
    """Bytes of the smallest GPU on this machine, read without initialising CUDA (nvml_gpus); None if unknown.
    NVML's total counts the few hundred MiB the driver reserves, which CUDA cannot allocate (plan's headroom)."""
    return min((memory for _, memory in nvml_gpus() or ()), default=None)


# /feature: planner
def precision_for(capability: tuple[int, int]) -> str:
    """bf16-mixed where the GPU computes bf16 natively (Ampere, compute capability 8.0, and later); before that
    (V100, T4) bf16 is emulated and slow: fp16-mixed, whose loss scaling Lightning adds (a GradScaler)."""
    return "bf16-mixed" if capability >= (8, 0) else "16-mixed"


def default_precision(accelerator: str = "auto") -> str:
    """bf16-mixed on a GPU with native bf16, 16-mixed on an older one, full fp32 on CPU (CPU autocast is slow and
    lossy). Decided without initialising CUDA (gpu_capability)."""
    if not on_gpu(accelerator):
        return "32-true"
    import torch

    if not torch.cuda.is_available():
        return "32-true"  # accelerator=gpu without a GPU: preflight says so in one line
    if torch.version.hip:
        return "bf16-mixed"  # every ROCm GPU torch supports computes bf16
    capability = gpu_capability()
    if capability is None:  # no NVML (a container without the driver's library): CUDA's own answer
        capability = torch.cuda.get_device_capability(0)
    return precision_for(capability)


def distributed_debug_level(trainer: str = "auto") -> str:
    """TORCH_DISTRIBUTED_DEBUG for debug=distributed: DETAIL (collective checks) on GPU; INFO on CPU, where
    DETAIL makes torch 2.13's DistributedDataParallel segfault over gloo. `trainer`: the trainer group's choice
    (cpu | gpu | default, whose accelerator is auto) or an accelerator; Hydra resolves env_set without the job's
    config, so `${trainer.accelerator}` is out of reach there."""
    return "DETAIL" if on_gpu("auto" if trainer == "default" else trainer) else "INFO"


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
