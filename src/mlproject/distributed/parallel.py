"""Model parallelism on Lightning's ModelParallelStrategy: FSDP2 (`fully_shard`, HSDP) on one named N-D
device mesh.

Lightning's strategy builds a fixed 2-D mesh (data x tensor parallel); ours builds the mesh the job's
Topology names (Topology.mesh_dims), torchtitan's way, and shards each submodule the module leaves unsharded
after its `configure_model` by the model's plan from config (model.parallel): which module classes are blocks
(FSDP's unit, activation checkpointing's unit). A model without a plan is sharded as one FSDP unit.
"""

# feature: tensor
# Tensor parallelism: the plan's `colwise` and `rowwise` layers inside a block are split by columns or rows
# (Megatron-style: column-parallel layers feed row-parallel ones, so each attention and MLP needs one all-reduce
# forward and one backward).
# /feature: tensor
# feature: expert
# Expert parallelism: the plan's `experts` modules are split over the inner part of each shard group
# (distributed/experts.py).
# /feature: expert

from __future__ import annotations

import functools
import math
import weakref
from pathlib import Path

import torch
from hydra.utils import get_class
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from mlproject.utils import compat


def named_meshes(topology, device_type: str) -> dict:
    """The job's device meshes by name (Topology.mesh_dims), kept apart as torch asks (a flattened dimension is
    not sliced from the root): each of the root's dimensions, `data_parallel` (replicate and shard: the batch
    split), `metrics` (what evaluation metrics sum over) and `fsdp` (what dense parameters are sharded and
    replicated over: 2-D for HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = topology.mesh_dims
    names = tuple(dims)
    root = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=names)
    hsdp = dims["replicate"] > 1  # a 1-D mesh otherwise: plain FSDP's placements, bytes and collectives
    data_parallel = compat.mesh_flatten(root["replicate", "shard"], "data_parallel")
    metrics = data_parallel  # every rank once, but one per TP group: what evaluation metrics sum over
    # feature: pipeline
    # and every stage: only the last has outputs, the others add zeros, and every rank reports the same numbers
    metrics = compat.mesh_flatten(root["pipeline", "replicate", "shard"], "metrics")
    # /feature: pipeline
    meshes = {name: root[name] for name in names} | {
        "data_parallel": data_parallel,
        "metrics": metrics,
        "fsdp": root["replicate", "shard"] if hsdp else root["shard"],
    }
    # feature: expert
    # Experts are split over `expert_parallel`, the inner part of the shard group, and FSDP-sharded over
    # `expert_shard`, the rest (`expert_fsdp`: with `replicate` under HSDP).
    ep = topology.expert_parallel_size
    split = ("expert_shard", "expert_parallel")
    # by index: torch 2.11's _unflatten refuses a dimension given by a name it has (pytorch#176443)
    experts = compat.mesh_unflatten(root, names.index("shard"), (dims["shard"] // ep, ep), split)
    meshes |= {
        "expert_parallel": experts["expert_parallel"],
        "expert_shard": experts["expert_shard"],
        "expert_fsdp": experts["replicate", "expert_shard"] if hsdp else experts["expert_shard"],
    }
    # /feature: expert
    return {"root": root, **meshes}


class ModelParallel(ModelParallelStrategy):
    """Lightning's strategy on our named mesh, plus our FSDP settings and the model's plan (model.parallel), which
    `parallelize` applies after the module's configure_model, and clipping of DTensor gradients (clip_gradients).
    Degrees (Topology's `*_size` fields) are plain integers; the shard size is what the others leave of the world."""

    def __init__(self, fsdp: dict | None = None, plan: dict | None = None, **kwargs):
        degrees = {key: kwargs.pop(key) for key in list(kwargs) if key.endswith("_size")}  # ours; the rest Lightning's
        # feature: pipeline
        pipeline = dict(kwargs.pop("pipeline", None) or {})
        # /feature: pipeline
        groups = 1  # Lightning's inner (tensor-parallel) mesh size; its data-parallel size, the rest: setup_environment
        # feature: tensor
        groups = degrees.get("tensor_parallel_size", 1)
        # `fsdp=None` means no sharding: pure tensor parallelism, every process in the one TP group
        # /feature: tensor
        super().__init__("auto", groups, **kwargs)
        self.fsdp, self.degrees, self.groups = fsdp, degrees, groups
        # feature: pipeline
        self.pipeline = pipeline
        # /feature: pipeline
        self.plan = dict(plan or {})  # the model's (model.parallel): which layers each dimension splits
        self.meshes: dict = {}

    @property
    def topology(self):
        from mlproject.core.topology import Topology

        kind = "fsdp"
        # feature: tensor
        kind = kind if self.fsdp is not None else "tp"
        # /feature: tensor
        return Topology(kind, self.num_nodes, self.num_processes, **self.degrees)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """Lightning's, except that with an AsyncCheckpointIO (callbacks.model_checkpoint.async_save) the
        shards go to torch.distributed.checkpoint.async_save: the loop waits for their copy, not their write."""
        import torch.distributed.checkpoint as dcp
        from fsspec.core import url_to_fs

        from mlproject.checkpoint.storage import AsyncCheckpointIO

        writer = self.checkpoint_io if isinstance(self.checkpoint_io, AsyncCheckpointIO) else None
        remote = False
        # feature: object_storage
        from mlproject.checkpoint.object_storage import is_remote

        # an fsspec URL (paths.ckpt_dir=s3://...), which DCP writes through its fsspec writer, chosen by a URL
        # checkpoint_id (Lightning's save makes it a Path: a local folder `s3:`)
        remote = is_remote(filepath)
        # /feature: object_storage
        if not (self._save_distributed_checkpoint and (writer or remote)):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        url = str(self.broadcast(str(filepath))).rstrip("/")
        path = url if remote else Path(url)
        fs, _ = url_to_fs(url)
        fs.makedirs(url, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self.global_rank == 0:  # what Lightning writes beside the shards (loops, callbacks, schedulers)
            with fs.open(f"{url}/meta.pt", "wb") as f:  # before DCP's .metadata, which marks the folder complete
                torch.save(checkpoint, f)
        if writer:
            writer.save_sharded(state, path, self._timeout)
        else:
            dcp.save(state, checkpoint_id=path)

    # feature: object_storage
    def remove_checkpoint(self, filepath) -> None:
        # In object storage a sharded folder loses its DCP .metadata first (object_storage.remove_remote), after
        # any save queued ahead of the removal (AsyncCheckpointIO.then).
        from mlproject.checkpoint.object_storage import is_remote, remove_remote
        from mlproject.checkpoint.storage import AsyncCheckpointIO

        if not is_remote(filepath):
            return super().remove_checkpoint(filepath)
        if self.is_global_zero:
            io = self.checkpoint_io
            if isinstance(io, AsyncCheckpointIO):
                io.then(remove_remote, str(filepath))
            else:
                remove_remote(str(filepath))

    # /feature: object_storage
    @property
    def distributed_sampler_kwargs(self) -> dict:
        dp = self.meshes["data_parallel"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        """Each rank reads only what it will hold. A sharded directory: DCP reshards it (Lightning's load). A
        full file (single, ddp), or another strategy's folder: each rank reads the blocks of every parameter and
        AdamW moment that its shards hold, by element range (`_load_shards`; not memory-mapped, whose pages
        would count as the rank's memory, nor gathered on rank 0 as torch's full-state-dict loader does). Their
        optimizer state is keyed by position, which Lightning maps to parameters in module order: it is
        re-keyed by name in the single process's order of the optimizers' groups first (param_names,
        checkpoint/convert.py).

        Every pickle is read with weights_only=True (unless MLPROJECT_TRUST_CHECKPOINT=1; Lightning passes no
        `weights_only` to a strategy that restores after setup), and a checkpoint of another model or size is refused
        in one line first."""
        from mlproject.checkpoint.convert import (
            check_fits,
            check_unpickles,
            checkpoint_format,
            refusing,
            saved_shapes,
            sliced_file,
            trusted,
        )

        path = self.broadcast(str(checkpoint_path))
        # feature: object_storage
        from mlproject.checkpoint import object_storage

        remote = object_storage.is_remote(path)
        if remote:
            object_storage.check_sharded(path, checkpoint_format(path))
        # /feature: object_storage
        check_unpickles(path)
        partial = False
        # feature: pipeline
        partial = getattr(self.lightning_module, "pipeline", None) is not None  # a stage holds its own modules only
        # /feature: pipeline
        check_fits(saved_shapes(path), self.lightning_module, path, partial)
        # feature: object_storage
        if remote:
            return self._load_sharded_url(path)
        # /feature: object_storage
        path = Path(path)
        sharded = path.is_dir() and checkpoint_format(path) == "sharded"  # a file's format check reads it all (CRC)
        if sharded or (path.is_file() and not self.optimizers):
            with refusing(path):  # a file: Lightning's torch.load, weights-only unless trusted
                return super().load_checkpoint(path, weights_only=not trusted())
        # feature: pipeline
        # Positions count every parameter of the writer, so under a pipeline every stage's names are needed
        # (param_names); set_optimizer_state_dict then takes only this stage's from the name-keyed state.
        # /feature: pipeline
        orders = [self.param_names(optimizer) for optimizer in self.optimizers]
        # feature: deepspeed
        if path.is_dir():  # a DeepSpeed directory: its ZeRO partitions, read by element range as a file is
            from mlproject.checkpoint.convert import name_optimizer_states
            from mlproject.checkpoint.zero_shards import ZeroShards, deepspeed_checkpoint

            shards = ZeroShards(path)
            checkpoint = name_optimizer_states(deepspeed_checkpoint(shards, full=False), orders)
            self._load_shards(shards.read, checkpoint)
            return checkpoint
        # /feature: deepspeed
        checkpoint, read = sliced_file(path, orders)
        self._load_shards(read, checkpoint)
        return checkpoint  # the rest (loops, callbacks, schedulers), which Lightning restores next

    # feature: object_storage
    def _load_sharded_url(self, url: str) -> dict:
        """Lightning's load of a sharded folder (its _load_checkpoint) from an fsspec URL: DCP reads through its
        fsspec reader, chosen by a URL checkpoint_id, and reshards as it does from a local folder."""
        import fsspec
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        from mlproject.checkpoint.convert import load_file

        state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(state, checkpoint_id=url)
        self.model.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            state = {f"optimizer_{i}": get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(state, checkpoint_id=url)
            options = StateDictOptions(cpu_offload=True)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[f"optimizer_{i}"], options=options)
        with fsspec.open(f"{url}/meta.pt", "rb") as f:
            return load_file(f, f"{url}/meta.pt")  # the rest (loops, callbacks, schedulers)

    # /feature: object_storage
    @torch.no_grad()
    def _load_shards(self, read, checkpoint: dict) -> None:
        """Weights and optimizer state into this rank's shards, as sharded state dicts: `read(name, key, start,
        numel)` gives elements of a flattened parameter (`key` None) or of its optimizer state `key`; the
        checkpoint's name-keyed optimizer states give the param groups' hyperparameters and the step counts,
        its state dict the buffers and which parameters it has (strict loading reports the others)."""
        from functools import partial

        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(strict=self.lightning_module.strict_loading)
        saved = checkpoint.pop("state_dict")
        params = dict(self.model.named_parameters(remove_duplicate=False))
        state_dict = dict(saved)
        # feature: pipeline
        if getattr(self.lightning_module, "pipeline", None) is not None:
            state_dict = {}  # a stage holds its own modules only: the file's other keys are the other stages'
        # /feature: pipeline
        for name in get_model_state_dict(self.model, options=options):
            if name in saved:  # else strict loading reports it; buffers are whole on every rank
                state_dict[name] = read_like(params[name], partial(read, name, None)) if name in params else saved[name]
        set_model_state_dict(self.model, state_dict, options=options)
        del state_dict  # in the parameters now: free it before the moments are read
        names = {p: name for name, p in self.model.named_parameters()}  # a tied weight's first name, as param_names
        for optimizer, optim in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            # The blocks become the optimizer's state before torch's loader sees it: finding the state made, it
            # skips the zero-gradient step that makes it (gradients and moments of its own besides these).
            for p in (p for group in optimizer.param_groups for p in group["params"]):
                if (entry := optim["state"].get(names[p])) is not None:  # else strict loading reports it
                    optimizer.state[p] = {
                        key: value.clone() if key == "step" else read_like(p, partial(read, names[p], key))
                        for key, value in entry.items()
                    }
            state = {names[p]: entry for p, entry in optimizer.state.items()}
            # How the step runs is this layout's choice (training/optim.py: tensor parallelism's mix of tensors and
            # DTensors needs no foreach).
            groups = [
                {**written, **{k: group[k] for k in ("foreach", "fused") if k in group}}
                for written, group in zip(optim["param_groups"], optimizer.param_groups, strict=True)
            ]
            set_optimizer_state_dict(self.model, optimizer, {"state": state, "param_groups": groups}, options=options)

    def param_names(self, optimizer) -> list[list[str]]:
        """The names of each param group's parameters in the single process's order (each group lists its
        parameters in module order, training/optim.py)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        # feature: pipeline
        # A pipeline stage's optimizer holds only its own: every stage's are gathered and sorted by their position
        # in the whole module; each group then names every stage's parameters (a stage's load takes its own).
        if (pipeline := getattr(self.lightning_module, "pipeline", None)) is not None:
            import torch.distributed as dist

            stages = [None] * pipeline.mesh.size()
            dist.all_gather_object(stages, groups, group=pipeline.mesh.get_group())
            merged = [{name for stage in stages for name in stage[i]} for i in range(len(groups))]
            return [sorted(group, key=pipeline.order.__getitem__) for group in merged]
        # /feature: pipeline
        return groups

    # feature: pipeline
    def optimizer_state(self, optimizer) -> dict:
        # A pipeline stage's param_groups name only its own parameters, and DCP saves such a non-tensor value from
        # one rank only: list every stage's, so that the checkpoint's groups name every parameter (a resume on any
        # layout, load_full's positions for a single process).
        state = super().optimizer_state(optimizer)
        if getattr(self.lightning_module, "pipeline", None) is not None:
            for group, names in zip(state["param_groups"], self.param_names(optimizer), strict=True):
                group["params"] = names
        return state

    # /feature: pipeline
    @property
    def fsdp_settings(self) -> dict | None:
        """The FSDP settings `parallelize` applies. Under bf16-mixed, unset dtypes become torchtitan's: parameters
        gathered and computed in bf16 (half fp32's all-gather traffic), gradients reduced in fp32 (a sum over many
        ranks keeps its low bits); an explicit `param_dtype: float32` keeps fp32 gathers."""
        if self.fsdp is None:
            return None
        settings = dict(self.fsdp)
        if str(self.precision_plugin.precision) == "bf16-mixed":
            settings["param_dtype"] = settings.get("param_dtype") or "bfloat16"
            settings["reduce_dtype"] = settings.get("reduce_dtype") or "float32"
        return settings

    def setup_environment(self) -> None:
        # Lightning's "auto" data-parallel size is the node count; ours is every process its inner groups leave.
        self._data_parallel_size = self.num_nodes * self.num_processes // self.groups
        super().setup_environment()  # processes, and Lightning's 2-D mesh, which ours replaces
        self.meshes = named_meshes(self.topology, self.root_device.type)
        self._device_mesh = self.meshes["root"]
        compat.set_device_mesh(self.lightning_module, self.meshes["root"])
        module = self.lightning_module
        if "configure_model" not in vars(module):  # once per module (each fit and test sets the strategy up)
            # The template shards after the module's own configure_model, if any (on the instance, where Lightning
            # looks for the hook): a network built there (Lightning's lazy-build hook), or in __init__ under an
            # empty hook, is sharded like any plain module's; what the module parallelized itself is left as it is.
            own = module.configure_model if is_overridden("configure_model", module) else None
            module.configure_model = functools.partial(configure_then_shard, module, own)
            if not is_overridden("configure_gradient_clipping", module):
                module.configure_gradient_clipping = functools.partial(clip_gradients, module)
        # SyncBatchNorm before configure_model shards the model: the conversion builds new modules (torch's on GPU,
        # ours on CPU alike), and after fully_shard they would hold the sharded weights while FSDP gathers into the
        # old ones. Lightning's ModelParallelStrategy skips its layer sync, so sync_batchnorm would be ignored.
        from lightning.pytorch.trainer.states import TrainerFn

        if self._layer_sync and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self.model = self._layer_sync.apply(self.model)

    def setup(self, trainer) -> None:
        super().setup(trainer)  # configure_model has run: the layout is final
        check_sharded(self.lightning_module, self.topology.strategy, tp_only=self.fsdp is None)

    def model_to_device(self) -> None:
        """Lightning moves the whole module to the device after configure_model; with FSDP's CPU offload that would
        move the host-held shards back to the GPU (FSDP2 then fails at the first forward): only buffers go."""
        if not (self.fsdp or {}).get("cpu_offload"):
            return super().model_to_device()
        for module in self.model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(self.root_device))  # a buffer's name keeps it a buffer


# what the named meshes (named_meshes) call the dimensions parameters are laid out on
MESH_DIMS = {"replicate", "shard", "data_parallel"}
# feature: tensor
MESH_DIMS |= {"tensor_parallel"}  # FSDP over TP: 2-D DTensors
# /feature: tensor
# feature: expert
MESH_DIMS |= {"expert_shard", "expert_parallel"}
# /feature: expert


def check_sharded(pl_module, strategy: str, tp_only: bool = False) -> None:
    """Once after setup: every trainable parameter is a DTensor on our meshes, or one line names the first one.
    A parameter left whole (one held by the LightningModule itself, outside its submodules, or a submodule the
    module parallelized only in part) would otherwise train as one unsynced copy per rank and fail, if at all,
    only when a checkpoint is loaded."""
    from torch.distributed.tensor import DTensor

    from mlproject.core.errors import ConfigError

    params = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
    if not params:
        return
    outside = [
        n for n, p in params if not (isinstance(p, DTensor) and set(p.device_mesh.mesh_dim_names or ()) <= MESH_DIMS)
    ]
    if not outside:
        return
    what = "sharded"
    # feature: tensor
    # under pure TP (`tp_only`) the plan leaves embeddings and norms whole, replicated: at least one layer is split
    if tp_only and len(outside) < len(params):
        return
    what = "split by the tensor-parallel plan" if tp_only else what
    # /feature: tensor
    raise ConfigError(
        f"strategy={strategy}: parameter {outside[0]} of {type(pl_module).__name__} is not {what}, so each rank "
        "would train its own copy without gradient sync; keep it in a submodule (the strategy shards each one "
        "after configure_model), or shard it in configure_model with "
        "mlproject.distributed.parallel.parallelize(self, <its module>)"
    )


def check_same_weights(net: nn.Module, strategy) -> None:
    """Ranks start from identical weights (FSDP keeps each rank's own slice of what it built; TP each rank's
    copy of what the plan leaves whole): per parameter its sum and norm, compared by one MAX all-reduce of them
    and their negatives, before anything is sharded. Parameters sharded already (DTensors) or
    not yet materialised (meta: a dry run's model, whose strategy has no devices) are left out."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from mlproject.core.errors import ConfigError

    named = [(n, p.detach()) for n, p in net.named_parameters() if not isinstance(p, DTensor) and not p.is_meta]
    if not named:
        return
    # Reductions, no copies: a float64 copy of each parameter raised every rank's peak host memory by up to
    # 280 MB for a 19M-parameter GPT (tests/checkpoint/test_reshard_memory.py).
    sums = torch.stack([torch.stack([p.sum(dtype=torch.float32), p.norm(dtype=torch.float32)]) for _, p in named])
    both = torch.cat([sums, -sums]).to(strategy.root_device)  # NCCL reduces device tensors only
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    differs = (both[: len(named)] != -both[len(named) :]).any(dim=1)
    if differs.any():
        raise ConfigError(
            f"parameter {named[int(differs.nonzero()[0])][0]} differs across ranks before sharding (each built its "
            "own initial weights): seed every rank alike (seed=<int>, with no rank in it) or load the same weights "
            "on every rank"
        )


def blocks_of(model: nn.Module, blocks: list[str]) -> list[nn.Module]:
    classes = tuple(get_class(name) for name in blocks)
    return [m for m in model.modules() if isinstance(m, classes)]


def apply_ac(model: nn.Module, blocks: list[str]) -> None:
    """Recompute each block's activations in backward instead of keeping them (less memory, ~1/3 more compute)."""
    for block in blocks_of(model, blocks):
        compat.activation_checkpoint(block)


def apply_compile(model: nn.Module, blocks: list[str] = ()) -> None:
    """torch.compile each block (with `blocks`: FSDP's gathers and reduce-scatters then run between the
    compiled blocks, torchtitan's way), else the whole network. Module.compile compiles in place: parameter
    names and checkpoint keys stay as they are (no `_orig_mod.` prefix), so checkpoints load either way."""
    for module in blocks_of(model, blocks) if blocks else [model]:
        module.compile()


# feature: tensor
def apply_tp(model: nn.Module, mesh, blocks: list[str], colwise: list[str], rowwise: list[str]) -> None:
    """Split the named layers of every block over the tensor-parallel mesh; other layers stay whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() for name in colwise} | {name: RowwiseParallel() for name in rowwise}
    for block in blocks_of(model, blocks):
        parallelize_module(block, mesh, plan)


# /feature: tensor
def apply_fsdp(
    model: nn.Module,
    mesh,
    blocks: list[str],
    reshard_after_forward: bool = True,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    cpu_offload: bool = False,
    # feature: expert
    experts: list[str] = (),
    expert_mesh=None,
    # /feature: expert
) -> None:
    """Shard every block on its own (its parameters are gathered only while it runs), then the rest (without
    blocks: the whole network is one unit). A 2-D mesh (replicate, shard) is HSDP: reduce-scatter within a
    shard group, then all-reduce across replicas."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    param_dtype, reduce_dtype = (getattr(torch, name) if name else None for name in (param_dtype, reduce_dtype))
    kwargs = {
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    if param_dtype is not None:  # BatchNorm's fp32 running statistics refuse bf16 weights: its own unit, kept fp32
        fp32 = {**kwargs, "mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)}
        for module in (m for m in model.modules() if isinstance(m, compat.BatchNormBase)):
            fully_shard(module, mesh=mesh, **fp32)
    # feature: expert
    # experts first, each on its own, over their smaller mesh: the expert-parallel ranks split them already
    if expert_mesh is not None:
        for module in blocks_of(model, experts):
            fully_shard(module, mesh=expert_mesh, **kwargs)
    # /feature: expert
    for block in blocks_of(model, blocks):
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def shard(net: nn.Module, meshes: dict, fsdp: dict | None, plan: dict, compile: bool = False) -> None:
    """The plan's parallelisms, then activation checkpointing, then compile (per block), then FSDP (`fsdp=None`:
    none) over the named meshes: what parallelize applies in training, and what a dry run applies on the meta
    device to a fake world."""
    settings, blocks = dict(fsdp or {}), list(plan.get("blocks") or ())
    # feature: tensor
    if meshes["tensor_parallel"].size() > 1:
        colwise, rowwise = (list(plan.get(key) or ()) for key in ("colwise", "rowwise"))
        apply_tp(net, meshes["tensor_parallel"], blocks, colwise, rowwise)
    # /feature: tensor
    experts = {}  # apply_fsdp's arguments for expert modules
    # feature: expert
    if meshes["expert_parallel"].size() > 1:
        from mlproject.distributed.experts import apply_ep

        experts = {"experts": list(plan.get("experts") or ()), "expert_mesh": meshes["expert_fsdp"]}
        apply_ep(blocks_of(net, experts["experts"]), meshes["expert_parallel"])
    # /feature: expert
    if settings.pop("activation_checkpointing", False):
        apply_ac(net, blocks)
    if compile:
        apply_compile(net, blocks)
    if fsdp is not None:
        apply_fsdp(net, meshes["fsdp"], blocks, **settings, **experts)


# networks parallelize has run on: Lightning calls configure_model per fit/test (a set, not an attribute on the
# user's module)
PARALLELIZED: weakref.WeakSet = weakref.WeakSet()


def parallelize(pl_module, net: nn.Module, compile: bool = False, loss_fn=None, **plan) -> None:
    """What the strategy applies to each submodule a LightningModule leaves unsharded after its configure_model
    (configure_then_shard), and what a configure_model may call itself: `shard` with the strategy's meshes,
    settings and plan (model.parallel; `plan` here replaces it; a model without a plan gives no blocks: FSDP
    shards it whole). Under other strategies only the compile (of the whole network). Modules with a
    `batch_group` attribute (statistics over the global batch, e.g. an MoE router's load) get the data-parallel
    process group.

    Lightning calls configure_model per fit/test: the second call does nothing.
    """
    import torch.distributed as dist
    from torchmetrics import Metric

    try:
        strategy = pl_module.trainer.strategy
    except RuntimeError:  # not attached: load_from_checkpoint calls configure_model outside a Trainer; keep it whole
        return
    if net in PARALLELIZED:
        return
    PARALLELIZED.add(net)
    if not isinstance(strategy, ModelParallel):
        if compile:
            apply_compile(net)
        if dist.is_available() and dist.is_initialized():  # ddp and the like: every rank reads its own batch
            set_batch_group(net, dist.group.WORLD)
        return
    check_same_weights(net, strategy)
    plan = plan or strategy.plan
    meshes, views = strategy.meshes, {"": net}
    # feature: pipeline
    # With a pipeline dimension the network is first split into this rank's stages by the plan's `pipeline` entry
    # (layers, first, last; distributed/pipeline.py), each stage is sharded as a network of its own, and
    # `pl_module.pipeline` runs them with `loss_fn`.
    pp = meshes["pipeline"]
    if pp.size() > 1:
        from mlproject.distributed.pipeline import Pipeline, split

        schedule, microbatches = strategy.pipeline["schedule"], strategy.pipeline["microbatches"]
        order = {name: i for i, (name, _) in enumerate(pl_module.named_parameters())}  # before the split
        views = split(net, pp.get_local_rank(), pp.size(), schedule, **plan["pipeline"])
    # /feature: pipeline
    for view in views.values():
        shard(view, meshes, strategy.fsdp_settings, plan, compile)
    # feature: pipeline
    if pp.size() > 1:
        pl_module.pipeline = Pipeline(views, pp, schedule, microbatches, loss_fn, order)
    # /feature: pipeline
    set_batch_group(net, meshes["data_parallel"].get_group())
    # A TP group evaluates the same samples: metrics sum over the other ranks only, or they count them twice.
    for metric in pl_module.modules():
        if isinstance(metric, Metric):
            metric.process_group = meshes["metrics"].get_group()


def configure_then_shard(pl_module, own) -> None:
    """The module's configure_model (`own`, or None), then each child it left unsharded as one FSDP unit (a step
    calls the children, never the module itself, whose forward would gather a whole-module unit). A child already
    holding DTensors was parallelized by the module itself."""
    from torch.distributed.tensor import DTensor

    if own is not None:
        own()
    for child in pl_module.children():
        params = list(child.parameters())
        if params and not any(isinstance(p, DTensor) for p in params):
            parallelize(pl_module, child)


def clip_gradients(pl_module, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
    """Lightning's configure_gradient_clipping, but by norm with clip_grad_norm_ below: torch's clip fails on
    gradients that mix plain tensors and DTensors (tensor parallelism leaves embeddings and norms whole) or
    DTensors on several meshes (experts)."""
    if gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
        holders = pl_module.trainer.world_size
        # feature: pipeline
        holders //= pl_module.trainer.strategy.topology.pipeline_parallel_size  # each stage holds its own parameters
        # /feature: pipeline
        clip_grad_norm_(pl_module.parameters(), gradient_clip_val, holders)
    else:
        pl_module.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def set_batch_group(net: nn.Module, group) -> None:
    for module in net.modules():
        if hasattr(module, "batch_group"):
            module.batch_group = group


def clip_grad_norm_(parameters, max_norm: float, holders: int | None = None) -> torch.Tensor:
    """Clip by the global gradient norm when gradients mix plain tensors and DTensors on different meshes,
    with one all-reduce for the whole model.

    torch's clip_grad_norm_ stacks per-tensor norms, which fails for such a mix (tensor parallelism leaves
    embeddings and norms whole), and reducing each DTensor's norm on its own costs one collective per
    parameter. Instead every rank sums the squares of the gradient elements it holds; an element held by
    k ranks (replicated over k of the `holders` ranks that hold the whole model between them: the world, unless
    parts of the model live on other ranks) counts 1/k on each, so one sum over all ranks is the global sum of
    squares. Gradients here are sharded or replicated, never partial (FSDP, TP).
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    copies: dict[int, list[torch.Tensor]] = {}  # ranks holding each element -> local gradients
    for p in params:
        g, distinct = p.grad, 1
        if isinstance(g, DTensor):
            # not pl.is_shard(): FSDP over TP shards by _StridedShard, which is no Shard in torch 2.13
            distinct = math.prod(g.device_mesh.size(d) for d, pl in enumerate(g.placements) if not pl.is_replicate())
            g = g.to_local()
        copies.setdefault((holders or dist.get_world_size()) // distinct, []).append(g)
    squares = [torch.nn.utils.get_total_norm(grads).square() / k for k, grads in copies.items()]
    total = torch.stack(squares).sum()
    # CPU-offloaded gradients sum on the host, where NCCL has no backend: the one all-reduce runs on the GPU
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else total.device
    reduced = total.to(on)
    dist.all_reduce(reduced)
    total = reduced.to(total.device).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)  # foreach needs one tensor type
    return total


def read_like(tensor: torch.Tensor, read) -> torch.Tensor:
    """A tensor laid out as `tensor` (a DTensor: this rank's shard, with its placements) from `read(start,
    numel)` over the full tensor's flattened elements."""
    from torch.distributed.tensor import DTensor

    local = local_block(tensor, read)
    if not isinstance(tensor, DTensor):
        return local
    return DTensor.from_local(local, tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride())


def local_block(tensor: torch.Tensor, read) -> torch.Tensor:
    """What this rank holds of `tensor` (a DTensor's local shard, all of a plain tensor) as a new tensor, from
    `read(start, numel)` over the full tensor's flattened elements: one read for a block of whole rows (a dim-0
    shard), else one per row of the block."""
    import itertools

    from torch.distributed.tensor import DTensor

    shape = tuple(tensor.shape)
    local, offset = shape, (0,) * len(shape)
    if isinstance(tensor, DTensor):
        local, offset = compat.local_shape_and_offset(shape, tensor.device_mesh, tensor.placements)
    split = max((d for d in range(len(shape)) if local[d] != shape[d]), default=0)  # whole beyond this dim
    stride = torch.empty(shape, device="meta").stride()
    indices = itertools.product(*(range(o, o + n) for o, n in zip(offset[:split], local[:split], strict=True)))
    starts = [
        sum(i * s for i, s in zip((*index, *offset[split : split + 1]), stride, strict=False)) for index in indices
    ]
    run = math.prod(local[split:])
    if len(starts) == 1:  # one range: the read is the block (no copy of it held besides)
        return read(starts[0], run).to(tensor.dtype).view(local)
    out = torch.empty(math.prod(local), dtype=tensor.dtype)
    for i, start in enumerate(starts):
        out[i * run : (i + 1) * run] = read(start, run)
    return out.view(local)


def local_bytes(tensors) -> int:
    """Bytes these tensors occupy on this rank: a DTensor counts its local shard only."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)
