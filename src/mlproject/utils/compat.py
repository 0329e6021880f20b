"""Every use of another library's private names, in one place.

Each entry is here because its library offers no public way to do it; it says what it waits for upstream.
tests/test_compat.py fails when a name an entry relies on changes, so an upgrade breaks there and not in
the middle of a run, and it fails when a private name is used anywhere else in the package.
docs/pitfalls.md lists what remains. Overrides of a documented class's protected hooks (`_monitor_candidates`
and the like, in subclasses) are not here: the test checks that each still overrides a hook of its base.
"""

from __future__ import annotations

import atexit
import os

import torch

# --- Python ---------------------------------------------------------------------------------------------


def exit_now(code: int = 0) -> None:
    """Run the exit hooks (loggers flush there), then leave without interpreter teardown (cli.run_as_process:
    torch 2.13 sometimes aborts in it after gloo work). atexit has no public "run the hooks now"."""
    import sys

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- torch ----------------------------------------------------------------------------------------------


# feature: planner
def fake_process_group(world_size: int, rank: int) -> None:
    """A process group of `world_size` ranks whose collectives move no data (a dry run of N ranks' sharding).
    The "fake" backend is registered by torch's testing module, its only home in torch 2.13."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor `t` is a view of (itself if none): the planner tells a saved weight from a saved activation
    on the meta device, where storages have no address to compare."""
    return t if t._base is None else t._base


# /feature: planner
def mesh_flatten(mesh, name: str):
    """One named dimension spanning all of `mesh`'s (the data-parallel group of an HSDP mesh). DeviceMesh has
    no public flatten or split yet (pytorch#169381 discusses their future)."""
    return mesh._flatten(name)


# feature: expert
def mesh_unflatten(mesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]):
    """Split dimension `dim` of a DeviceMesh into named ones (expert parallelism inside the FSDP dimension)."""
    return mesh._unflatten(dim, sizes, names)


# /feature: expert
def activation_checkpoint(block: torch.nn.Module) -> None:
    """Recompute `block`'s activations in backward. The composable form keeps module names and state-dict
    keys (a wrapper module would add `_checkpoint_wrapped_module.`); torch has it under _composable only."""
    from torch.distributed._composable import checkpoint

    checkpoint(block)


def local_shape_and_offset(shape: tuple[int, ...], mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a DTensor of global `shape` holds on this rank: its shape and its offset in the global tensor.
    DTensor exposes it only through torch.distributed.tensor._utils."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


# The base class of every BatchNorm (1d/2d/3d, lazy, sync): torch exports none publicly.
BatchNormBase = torch.nn.modules.batchnorm._BatchNorm


def load_whole_dcp(state: dict, reader, keys: set[str] | None = None) -> None:
    """Read a torch.distributed.checkpoint directory (its items `keys`, None: all) into the empty dict `state`
    in this process alone. DCP's public load fills a state dict that already holds every tensor's shape;
    format_utils.dcp_to_torch_save does this through the same private planner, but writes a file."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state, reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)


def file_offset(saved: torch.Tensor) -> int:
    """Byte offset in its file of a tensor loaded with map_location="meta" from a torch.save zip file, so a
    rank reads only its slice. torch records it on the storage for its own lazy loading only."""
    return saved.untyped_storage()._checkpoint_offset


def ddp_ignore(module: torch.nn.Module, names: list[str]) -> None:
    """DDP neither broadcasts nor all-reduces these parameters and buffers of `module`. DDP reads this
    attribute; its setter (`_set_params_and_buffers_to_ignore_for_model`) is private too."""
    ignored = getattr(module, "_ddp_params_and_buffers_to_ignore", [])
    module._ddp_params_and_buffers_to_ignore = [*ignored, *names]


def record_cuda_memory(max_entries: int) -> None:
    """Start torch's CUDA allocation recorder: documented (pytorch.org/docs/stable/torch_cuda_memory.html)
    under these underscore names, with no public alias."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_cuda_memory(path: str) -> None:
    """Write the recorded allocations to `path` (open it at pytorch.org/memory_viz) and stop recording."""
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


# --- torchmetrics ----------------------------------------------------------------------------------------


def set_update_count(metric, count: int) -> None:
    """Restore a metric's update count with its states (mid-epoch resume): torchmetrics reads it publicly
    (`update_count`) but sets it only in update/reset; the cached result of compute is dropped with it."""
    metric._update_count, metric._computed = count, None


# --- Lightning -------------------------------------------------------------------------------------------


def set_device_mesh(module, mesh) -> None:
    """The mesh `module.device_mesh` returns. Lightning's ModelParallelStrategy sets it the same way; ours
    replaces Lightning's 2-D mesh with the named N-D one (distributed/parallel.py)."""
    module._device_mesh = mesh


def validated_yet(trainer) -> bool:
    """Whether this fit (fresh or resumed) has run a validation: ModelCheckpoint keys off it privately."""
    return trainer.fit_loop.epoch_loop.val_loop._has_run


def reload_loader_position(trainer) -> bool:
    """Load the data position a mid-epoch checkpoint saved, which Lightning skips when configure_optimizers
    read trainer.estimated_stepping_batches (Lightning #20550); True if there was one."""
    loop = trainer.fit_loop
    if not loop._combined_loader_states_to_load or loop.epoch_loop.batch_progress.is_last_batch:
        return False
    loop._load_combined_loader_states()
    iter(loop._data_fetcher)
    return True


def quiet_sigterm(trainer, on_signal) -> None:
    """Lightning's SIGTERM handling without its collectives, on this trainer only (Lightning #21487): its
    handler broadcasts from rank 0 and its loop all-reduces a flag every step; `on_signal` notes the signal."""
    trainer._signal_connector._sigterm_notifier_fn = on_signal
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


# feature: deepspeed
# --- DeepSpeed -------------------------------------------------------------------------------------------


def no_shm_allreduce():
    """DeepSpeed's CPU backend without its shared-memory all-reduce, for the `with` block only: it probes
    compilers and JIT-compiles (~20 s) at start, though only inference uses it; training reduces over gloo.
    DeepSpeed has no switch for it."""
    import importlib
    from unittest import mock

    return mock.patch.object(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", return_value=None)


def zero_init_optimizer_state(zero) -> None:
    """Link each parameter's fragment of ZeRO 1/2's flat optimizer state, as its first step would."""
    zero._lazy_init_hp_params_optimizer_state()


def zero3_slice(zero, param, key: str | None) -> tuple[torch.Tensor, int]:
    """ZeRO-3's fp32 partition of `param` (its optimizer state `key`, or the weights for None) held by this
    rank, and its start in the flattened parameter. DeepSpeed's public safe_set_full_* take the whole tensor
    on every rank; this reads only the slice."""
    partition, _ = zero._get_fp32_opt_state_partition(param, False, optim_state_key=key)
    return partition, partition.numel() * zero._get_param_partition_rank(param)


def zero12_fragment(param, key: str | None) -> tuple[torch.Tensor, int, int] | None:
    """ZeRO 1/2's fp32 fragment of `param` on this rank with its start and size (None: this rank holds none)."""
    if param._hp_mapping is None:
        return None
    address = param._hp_mapping.lp_fragment_address
    return param._hp_mapping.get_hp_fragment(key), address.start, address.numel


def zero3_publish(zero, group: int) -> None:
    """ZeRO-3's module parameters of param group `group` from the fp32 master, as after an optimizer step."""
    zero._reassign_or_swap_out_partitioned_parameters(group)


# /feature: deepspeed
