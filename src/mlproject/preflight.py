"""Every impossible setting, caught before anything is built, with the fix in one line."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mlproject.core.errors import ConfigError
from mlproject.core.paths import refuse_url_paths
from mlproject.core.ranges import check_ranges
from mlproject.core.topology import Topology


def check_override_types(cfg: DictConfig) -> None:
    """Refuse `key=value` overrides whose type differs from the default's (e.g. trainer.max_epochs=ten).

    Hydra accepts any value for a key in a plain YAML config; the mistake would otherwise surface deep
    inside Lightning. Compare against the same config composed with the group choices only.
    """
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():  # train(cfg) called from Python: no command-line overrides to check
        return
    hc = HydraConfig.get()
    overrides = OverridesParser.create().parse_overrides(list(hc.overrides.task))
    groups = set(hc.runtime.choices)
    values = [o for o in overrides if o.key_or_group not in groups and not o.is_delete() and not o.is_add()]
    if not values or hc.mode.name == "MULTIRUN":  # sweep values are lists and ranges: checked per trial
        return
    # Hydra's own overrides (hydra.searchpath) keep the options the run chose findable
    kept = [o.input_line for o in overrides if o not in values] + [
        h for h in hc.overrides.hydra if h.startswith("hydra.searchpath")
    ]
    base = compose(hc.job.config_name, kept)
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


def check_accelerator(cfg: DictConfig) -> None:
    import torch

    accelerator = cfg.trainer.accelerator
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("trainer.accelerator=gpu but no CUDA GPU is visible; use trainer=cpu")
        if isinstance(cfg.trainer.devices, int) and cfg.trainer.devices > torch.cuda.device_count():
            raise ConfigError(
                f"trainer.devices={cfg.trainer.devices} but this machine has {torch.cuda.device_count()} "
                f"GPU(s); use trainer.devices={torch.cuda.device_count()} or fewer"
            )
    precision = str(cfg.trainer.precision)
    if precision.startswith("16") and (accelerator == "cpu" or not torch.cuda.is_available()):
        raise ConfigError(
            f"trainer.precision={precision} needs a CUDA GPU (on CPU Lightning would silently use bf16); "
            "use trainer.precision=32-true or bf16-mixed"
        )


def check_lr_scaling(cfg: DictConfig) -> None:
    """An LR rule without the batch size it scales from stops here, not in every rank's configure_optimizers."""
    from mlproject.training.optim import scaled_lr

    opt = (cfg.get("model") or {}).get("optimizer") or {}
    if "lr_scaling" in opt:
        scaled_lr(opt.lr, 1, opt.lr_scaling, opt.get("base_batch_size"))


def check_vocabulary(cfg: DictConfig, network) -> None:
    """A token embedding with fewer ids than the data has fails at the first out-of-range id, deep in the model.
    Read from the network as built: its first Embedding (token embeddings come first in GPT-2, Llama, nanoGPT and
    the template's GPT), wherever the config sets its size."""
    from torch import nn

    from mlproject.distributed.strategies import net_setting

    vocab = (cfg.get("data") or {}).get("vocab_size")
    modules = network.named_modules() if network is not None else ()
    name, embedding = next(((n, m) for n, m in modules if isinstance(m, nn.Embedding)), (None, None))
    if vocab is None or embedding is None or embedding.num_embeddings >= vocab:
        return
    at, value = net_setting(cfg, "vocab_size")
    if value == embedding.num_embeddings:  # the config's setting built it: name that
        raise ConfigError(
            f"{at}={value} is smaller than data.vocab_size={vocab}; drop the override (it follows the data) or raise it"
        )
    raise ConfigError(
        f"{type(network).__name__}'s token embedding {name} has {embedding.num_embeddings} ids, fewer than "
        f"data.vocab_size={vocab}; build it with at least {vocab}"
    )


# feature: planner
def available_ram() -> int | None:
    """Bytes the kernel says new allocations can take without swapping (MemAvailable); None off Linux."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    kib = next((line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    return int(kib) * 1024 if kib else None


def check_memory(cfg: DictConfig, topology: Topology) -> None:
    """Refuse a training run whose planned per-rank memory (plan.py's estimate of this layout, on the meta device)
    exceeds the device's: the GPU's (cluster.gpu_memory_gb, else the smallest one's here, with plan's headroom), or on
    CPU the host's available RAM shared by the node's ranks. The kernel's OOM killer would end it with no word."""
    from mlproject.core.resolvers import on_gpu
    from mlproject.plan import HEADROOM, device_memory, largest, size

    if not topology.training or not (cfg.get("cluster") or {}).get("check_memory", True):
        return
    gpu = on_gpu(cfg.trainer.accelerator)
    if gpu:
        memory, limit, where = device_memory(cfg), HEADROOM, "GPU"
    else:
        ram = available_ram()
        memory, limit, where = ram and ram // topology.devices_per_node, 1.0, "share of the host's available RAM"
    if memory is None:
        return
    layout = f"strategy={topology.strategy}"
    try:
        if topology.model_parallel:
            # The estimate shards the meta model on a fake process group, whose meshes torch caches for the
            # process: a forked child estimates, and this process's real group starts clean.
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
                row = pool.submit(largest, cfg, layout).result()
        else:
            row = largest(cfg, layout)
    except Exception as exc:  # noqa: BLE001
        # No estimate, nothing to refuse, but said: data made by the run itself (prepare_data), a plain datamodule
        # (the planner reads the template's splits()), or data and model that disagree (the first batch says so)
        from mlproject.utils.rank_logging import get_logger

        get_logger(__name__).warning(
            f"memory not checked, no estimate: {type(exc).__name__}: {exc} (`make plan` shows the traceback)"
        )
        return
    if row.total <= limit * memory:
        return
    from hydra.core.hydra_config import HydraConfig

    args = " ".join(HydraConfig.get().overrides.task) if HydraConfig.initialized() else ""
    gathered = f", {size(row.gathered)} FSDP's largest unit gathered" if row.gathered else ""
    raise ConfigError(
        f"{row.layout} needs {size(row.total)} per rank ({size(row.states)} model states{gathered}, "
        f"{size(row.activations)} activations), more than this {where}: {size(memory)}; "
        f'`make plan ARGS="{args}"` shows the layouts that fit (cluster.check_memory=false skips this check)'
    )


# /feature: planner
def checked_by_rank_0() -> bool:
    """Whether global rank 0 makes, for this process, the checks that cost a compose or a model build: where its
    refusal ends this process too. The local ranks launch_local_ranks starts after rank 0's checks; torchrun's workers
    on rank 0's node (their agent stops them when one exits; another node's agent would leave its workers waiting for
    the rendezvous); and, under a scheduler that ends a job whose rank 0 exits, that job's other ranks. Every other
    process checks for itself."""
    from mlproject.distributed.launch import CHECKED_BY_RANK_0

    env = os.environ
    if env.get(CHECKED_BY_RANK_0) == "1":
        return True
    if "TORCHELASTIC_RUN_ID" in env:
        return env.get("RANK", "0") != "0" and env.get("GROUP_RANK", "0") == "0"
    # feature: slurm
    if env.get("SLURM_KILL_BAD_EXIT") == "1":  # srun's tasks under its --kill-on-bad-exit, inherited by the tasks
        return env.get("SLURM_PROCID", "0") != "0"
    # /feature: slurm
    return False


def preflight(cfg: DictConfig) -> Topology:
    """Check the composed config as a whole; returns the job's validated topology."""
    from mlproject.build import meta_network
    from mlproject.distributed.launch import check_launch
    from mlproject.distributed.strategies import check_model_parallel, check_plan

    refuse_url_paths(cfg)  # also in Hydra's callback, before it makes the run directory; here for train(cfg) too

    checked = checked_by_rank_0()  # then this rank skips the checks that cost a compose or a model build
    if not checked:
        check_override_types(cfg)
    check_ranges(cfg)  # before the topology divides by any of them
    topology = Topology.of(cfg)
    # feature: slurm
    from mlproject.cluster import slurm

    slurm.check_in_job(cfg)
    # /feature: slurm
    # feature: kubernetes
    from mlproject.cluster import kubernetes

    kubernetes.check_in_job(cfg)
    # /feature: kubernetes
    check_accelerator(cfg)
    check_lr_scaling(cfg)
    topology.validate()
    check_model_parallel(cfg, topology)
    if not checked:
        # the model built on the meta device, once (later checks take copies), where a check reads it: a token
        # embedding against the data's vocabulary, a model-parallel plan against its layers
        reads = (cfg.get("data") or {}).get("vocab_size") is not None or topology.model_parallel
        network = meta_network(cfg) if reads else None
        check_vocabulary(cfg, network)
        check_plan(cfg, topology, network)
    ckpt = cfg.get("ckpt_path")
    # a URL is checked where it is read: checkpoint.resume.resolve_ckpt_path
    if ckpt and ckpt != "auto" and "://" not in str(ckpt) and not Path(ckpt).exists():
        raise ConfigError(f"ckpt_path={ckpt} does not exist; give the path of a .ckpt file")
    check_launch(cfg, topology)
    # feature: deepspeed
    from mlproject.distributed.launch import check_deepspeed

    check_deepspeed(cfg, topology)
    # /feature: deepspeed
    # feature: planner
    if not checked:
        check_memory(cfg, topology)
    # /feature: planner
    return topology
