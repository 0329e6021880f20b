"""The job's shape, built once from the composed config and validated once (torchtitan's ParallelDims idea).

Every question of the kind "how many processes, which of them read different batches, which strategy" is
answered here: preflight, the launch checks, the data's batch split and a cluster's job writer all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlproject.core.errors import ConfigError

# configs/strategy/*.yaml name a factory in distributed/strategies.py; model_parallel covers these options, and
# those of them that shard over data-parallel ranks (FSDP) can add experts or stages
SHARDED = ("fsdp", "hsdp")
# feature: tensor
SHARDED += ("fsdp_tp",)
# /feature: tensor
MODEL_PARALLEL = SHARDED
# feature: tensor
MODEL_PARALLEL += ("tp",)
# /feature: tensor


def per_device_batch_size(batch_size: int, replicas: int, accumulate: int = 1, exact: bool = True) -> int:
    """The global batch size split over data-parallel ranks (the world, without tensor-parallel groups) and
    accumulation steps. Training needs an exact split (else the recipe changes with the world size);
    evaluation rounds up, since padded slots are masked and every sample still counts once."""
    if not exact:
        return -(-batch_size // (replicas * accumulate))
    if batch_size % (replicas * accumulate):
        raise ConfigError(
            f"data.batch_size={batch_size} is the global batch size and must divide by world size {replicas} "
            f"x trainer.accumulate_grad_batches {accumulate}; use a multiple of {replicas * accumulate}"
        )
    return batch_size // (replicas * accumulate)


def global_batch(data) -> bool:
    """Whether `data.batch_size` is global: a subclass of the template's DataModule says so; a plain
    LightningDataModule's batch_size is its own (per device, as in Lightning). A `_target_` that does not
    import counts as the template's: the build names the bad name later."""
    from hydra.utils import get_class

    try:
        cls = get_class(data["_target_"]) if "_target_" in data else None
    except Exception:  # any import error; instantiate_at reports it with the config key
        return True
    base = ("mlproject.training.datamodule", "DataModule")
    return cls is None or any((c.__module__, c.__name__) == base for c in cls.__mro__)


def auto_strategy(devices, num_nodes: int, accelerator: str) -> str:
    """What strategy=auto runs: single on one device, ddp on more devices or nodes."""
    return "single" if _devices(devices, accelerator) * int(num_nodes) == 1 else "ddp"


def _devices(devices, accelerator: str) -> int:
    """trainer.devices as Lightning counts it: an int, "auto"/-1 (all visible GPUs, else 1), "0,1" or a list."""
    if isinstance(devices, str) and devices != "auto":
        devices = int(devices) if devices.strip().lstrip("-").isdigit() else len(devices.split(","))
    if devices in ("auto", -1):
        import torch

        gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        return torch.cuda.device_count() if gpu else 1
    return devices if isinstance(devices, int) else len(devices)


@dataclass(frozen=True)
class Topology:
    strategy: str  # single | ddp | ddp_spawn | one of MODEL_PARALLEL | another factory's name, or a custom class
    nodes: int = 1
    devices_per_node: int = 1
    replicate_size: int = 1  # data-parallel groups that each hold a full FSDP copy (HSDP); 1: plain FSDP
    # feature: tensor
    tensor_parallel_size: int = 1  # processes that split each block's layers and read one batch together
    # /feature: tensor
    # feature: expert
    expert_parallel_size: int = 1  # ranks of a shard group that split the experts of an MoE layer
    # /feature: expert
    # feature: pipeline
    pipeline_parallel_size: int = 1  # pipeline stages (groups of ranks) the network's blocks are split over
    # /feature: pipeline
    accumulate: int = 1  # micro-batches per optimizer step
    global_batch_size: int | None = None  # data.batch_size, if the data is the template's DataModule (global)
    training: bool = True  # False for evaluation only (eval, or train=false): the batch may split unevenly

    @classmethod
    def of(cls, cfg) -> Topology:
        strategy = cfg.get("strategy") or {}
        name = str(strategy.get("_target_", "")).rsplit(".", 1)[-1]
        if name == "auto":
            name = auto_strategy(cfg.trainer.devices, cfg.trainer.get("num_nodes", 1), cfg.trainer.accelerator)
        degrees = {"replicate_size": int(strategy.get("replicate_size", 1))}
        # feature: tensor
        degrees["tensor_parallel_size"] = int(strategy.get("tensor_parallel_size", 1))
        # /feature: tensor
        # feature: expert
        degrees["expert_parallel_size"] = int(strategy.get("expert_parallel_size", 1))
        # /feature: expert
        # feature: pipeline
        degrees["pipeline_parallel_size"] = int(strategy.get("pipeline_parallel_size", 1))
        # /feature: pipeline
        if name == "model_parallel":
            name = "hsdp" if degrees["replicate_size"] > 1 else "fsdp"
            # feature: tensor
            if strategy.get("fsdp") is None:
                name = "tp"
            elif degrees["tensor_parallel_size"] > 1:
                name = "fsdp_tp"
            # /feature: tensor
        data = cfg.get("data") or {}
        return cls(
            strategy=name,
            nodes=int(cfg.trainer.get("num_nodes", 1)),
            devices_per_node=_devices(cfg.trainer.devices, cfg.trainer.accelerator),
            **degrees,
            accumulate=int(cfg.trainer.get("accumulate_grad_batches", 1)),
            global_batch_size=data.get("batch_size") if global_batch(data) else None,
            training=bool(cfg.get("train", False)),
        )

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def data_parallel_size(self) -> int:
        """Processes that read different batches."""
        size = self.world_size
        # feature: tensor
        size //= self.tensor_parallel_size  # a tensor-parallel group reads one batch together
        # /feature: tensor
        # feature: pipeline
        size //= self.pipeline_parallel_size  # and so do a pipeline's stages: the first feeds inputs, the last targets
        # /feature: pipeline
        return size

    @property
    def shard_size(self) -> int:
        """Ranks over which FSDP splits each (dense) parameter: a replica group."""
        return self.data_parallel_size // self.replicate_size

    @property
    def mesh_dims(self) -> dict[str, int]:
        """The named device mesh, outermost first: data parallelism (dense parameters replicated over `replicate`,
        sharded over `shard`), innermost the dimensions with the most traffic, on the fastest links."""
        dims = {}
        # feature: pipeline
        # pipeline stages outermost: point-to-point sends of activations, the least traffic, so the slowest links
        dims["pipeline"] = self.pipeline_parallel_size
        # /feature: pipeline
        dims |= {"replicate": self.replicate_size, "shard": self.shard_size}
        # feature: tensor
        dims["tensor_parallel"] = self.tensor_parallel_size
        # /feature: tensor
        return dims

    @property
    def model_parallel(self) -> bool:
        return self.strategy in MODEL_PARALLEL

    @property
    def per_device_batch_size(self) -> int | None:
        """None where the data is not the template's DataModule: its own loaders set the batch, unknown here."""
        if self.global_batch_size is None:
            return None
        return per_device_batch_size(self.global_batch_size, self.data_parallel_size, self.accumulate, self.training)

    def validate(self) -> Topology:
        """Refuse a shape that cannot run, in one line naming the fix; returns itself."""
        world = self.world_size
        if self.strategy == "single" and world > 1:
            raise ConfigError(
                f"strategy=single runs one process but trainer.devices x trainer.num_nodes = {world}; "
                "use strategy=ddp (or trainer.devices=1)"
            )
        left = world  # processes per model-parallel group
        # feature: tensor
        tp = self.tensor_parallel_size
        if tp < 1 or world % tp:
            raise ConfigError(
                f"strategy.tensor_parallel_size={tp} must divide the {world} process(es) "
                "(trainer.devices x trainer.num_nodes); change one of them"
            )
        left //= tp
        # /feature: tensor
        # feature: pipeline
        pp = self.pipeline_parallel_size
        if pp < 1 or left % pp:
            raise ConfigError(
                f"strategy.pipeline_parallel_size={pp} must divide the {left} process(es) of trainer.devices x "
                "trainer.num_nodes that tensor-parallel groups leave; change one of them"
            )
        if pp > 1 and self.strategy not in SHARDED:
            raise ConfigError(
                f"strategy.pipeline_parallel_size={pp} runs on FSDP (strategy=pp, which FSDP-shards each stage over "
                f"the data-parallel ranks), not on strategy={self.strategy}"
            )
        # /feature: pipeline
        replicate, dp = self.replicate_size, self.data_parallel_size
        if replicate < 1 or dp % replicate:
            raise ConfigError(
                f"strategy.replicate_size={replicate} must divide the data-parallel size {dp} (the processes that "
                "read different batches); the shard size is what is left (e.g. replicate_size=nodes)"
            )
        # feature: expert
        ep = self.expert_parallel_size
        if ep < 1 or (dp // replicate) % ep:
            raise ConfigError(
                f"strategy.expert_parallel_size={ep} must divide the shard size {dp // replicate} (data-parallel "
                "size / replicate_size); expert groups live inside a shard group"
            )
        if ep > 1 and self.strategy not in SHARDED:
            raise ConfigError(
                f"strategy.expert_parallel_size={ep} needs strategy={' or '.join(SHARDED)} (FSDP reduces the "
                f"experts' gradients), not {self.strategy}"
            )
        # /feature: expert
        # feature: tensor
        if self.strategy == "tp" and self.tensor_parallel_size != world:
            raise ConfigError(
                f"strategy=tp puts all {world} process(es) in one tensor-parallel group but "
                f"strategy.tensor_parallel_size={self.tensor_parallel_size}; set it to {world}, "
                "or use strategy=fsdp_tp to add data parallelism"
            )
        # /feature: tensor
        if self.global_batch_size is not None:
            self.per_device_batch_size  # noqa: B018 (raises if the global batch does not divide)
        return self
