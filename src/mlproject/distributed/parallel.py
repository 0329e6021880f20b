"""Model parallelism on Lightning's ModelParallelStrategy: FSDP2 (`fully_shard`) and tensor parallelism.

Lightning builds the device mesh (data_parallel x tensor_parallel) and leaves sharding to the model's
`configure_model`; every model calls `parallelize` there with its own plan from config: which module
classes are blocks (FSDP's unit, activation checkpointing's unit) and which layers inside a block are
split by columns or rows (Megatron-style: column-parallel layers feed row-parallel ones, so each
attention and MLP needs one all-reduce forward and one backward).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from hydra.utils import get_class
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn


class ModelParallel(ModelParallelStrategy):
    """Lightning's strategy plus our FSDP settings, which `parallelize` applies in configure_model.

    `fsdp=None` means no sharding (pure tensor parallelism: every process is in the one TP group).
    """

    def __init__(self, tensor_parallel_size: int = 1, fsdp: dict | None = None, **kwargs):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.fsdp = fsdp

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        # A full checkpoint (single, ddp, or a DeepSpeed directory converted) keys optimizer state by position,
        # which Lightning maps to parameters in module order; re-key it by name in the optimizers' own order
        # first (checkpoint/convert.py).
        from mlproject.checkpoint.convert import checkpoint_format, load_full, name_optimizer_states

        path = Path(self.broadcast(checkpoint_path))
        sharded = path.is_dir() and checkpoint_format(path) == "sharded"  # a file's format check reads it all (CRC)
        if sharded or (path.is_file() and not self.optimizers):
            return super().load_checkpoint(path, weights_only)
        checkpoint = load_full(path)
        if self.optimizers:
            name_optimizer_states(checkpoint, self.model, self.optimizers)
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(checkpoint, Path(tmp) / path.name)
            return super().load_checkpoint(Path(tmp) / path.name, weights_only)

    def setup_environment(self) -> None:
        # Lightning's "auto" data-parallel size is the node count; ours is every process a TP group leaves.
        self._data_parallel_size = self.num_nodes * self.num_processes // self._tensor_parallel_size
        super().setup_environment()


def blocks_of(model: nn.Module, blocks: list[str]) -> list[nn.Module]:
    classes = tuple(get_class(name) for name in blocks)
    return [m for m in model.modules() if isinstance(m, classes)]


def apply_tp(model: nn.Module, mesh, blocks: list[str], colwise: list[str], rowwise: list[str]) -> None:
    """Split the named layers of every block over the tensor-parallel mesh; other layers stay whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() for name in colwise} | {name: RowwiseParallel() for name in rowwise}
    for block in blocks_of(model, blocks):
        parallelize_module(block, mesh, plan)


def apply_ac(model: nn.Module, blocks: list[str]) -> None:
    """Recompute each block's activations in backward instead of keeping them (less memory, ~1/3 more compute)."""
    from torch.distributed._composable import checkpoint  # composable: module names and state_dict keys stay

    for block in blocks_of(model, blocks):
        checkpoint(block)


def apply_compile(model: nn.Module, blocks: list[str] = ()) -> None:
    """torch.compile each block (with `blocks`: FSDP's gathers and reduce-scatters then run between the
    compiled blocks, torchtitan's way), else the whole network. Module.compile compiles in place: parameter
    names and checkpoint keys stay as they are (no `_orig_mod.` prefix), so checkpoints load either way."""
    for module in blocks_of(model, blocks) if blocks else [model]:
        module.compile()


def apply_fsdp(
    model: nn.Module,
    mesh,
    blocks: list[str],
    reshard_after_forward: bool = True,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    cpu_offload: bool = False,
) -> None:
    """Shard every block on its own (its parameters are gathered only while it runs), then the rest."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    param_dtype, reduce_dtype = (getattr(torch, name) if name else None for name in (param_dtype, reduce_dtype))
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for block in blocks_of(model, blocks):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def shard(
    net: nn.Module, mesh, fsdp: dict | None, blocks: list[str], colwise=(), rowwise=(), compile: bool = False
) -> None:
    """TP, then activation checkpointing, then compile (per block), then FSDP (`fsdp=None`: none) over a
    (data_parallel, tensor_parallel) mesh: what parallelize applies in training, and what plan.py applies on
    the meta device to a fake world."""
    settings = dict(fsdp or {})
    if mesh["tensor_parallel"].size() > 1:
        apply_tp(net, mesh["tensor_parallel"], blocks, list(colwise), list(rowwise))
    if settings.pop("activation_checkpointing", False):
        apply_ac(net, blocks)
    if compile:
        apply_compile(net, blocks)
    if fsdp is not None:
        apply_fsdp(net, mesh["data_parallel"], blocks, **settings)


def parallelize(pl_module, net: nn.Module, blocks: list[str], colwise=(), rowwise=(), compile: bool = False) -> None:
    """The one call a LightningModule's configure_model makes: `shard` with the strategy's mesh and settings.
    Under other strategies only the compile (of the whole network).

    Lightning calls configure_model per fit/test: the second call does nothing.
    """
    from torchmetrics import Metric

    strategy = pl_module.trainer.strategy
    if getattr(net, "_parallelized", False):
        return
    net._parallelized = True  # a plain attribute: not in the state dict
    if not isinstance(strategy, ModelParallel):
        if compile:
            apply_compile(net)
        return
    mesh = pl_module.device_mesh
    shard(net, mesh, strategy.fsdp, blocks, colwise, rowwise, compile)
    # A TP group evaluates the same samples: metrics sum over data-parallel ranks only, or they count them twice.
    for metric in pl_module.modules():
        if isinstance(metric, Metric):
            metric.process_group = mesh["data_parallel"].get_group()


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm when gradients mix plain tensors and DTensors on different meshes,
    with one all-reduce for the whole model.

    torch's clip_grad_norm_ stacks per-tensor norms, which fails for such a mix (tensor parallelism leaves
    embeddings and norms whole), and reducing each DTensor's norm on its own costs one collective per
    parameter. Instead every rank sums the squares of the gradient elements it holds; an element held by
    k ranks (replicated over k of the world's ranks) counts 1/k on each, so one sum over all ranks is the
    global sum of squares. Gradients here are sharded or replicated, never partial (FSDP, TP).
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
        copies.setdefault(dist.get_world_size() // distinct, []).append(g)
    squares = [torch.nn.utils.get_total_norm(grads).square() / k for k, grads in copies.items()]
    total = torch.stack(squares).sum()
    dist.all_reduce(total)
    total = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)  # foreach needs one tensor type
    return total


def local_bytes(tensors) -> int:
    """Bytes these tensors occupy on this rank: a DTensor counts its local shard only."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)
