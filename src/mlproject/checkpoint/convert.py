"""Read any checkpoint this template writes into one in-memory Lightning checkpoint with full tensors.

Formats (checkpoint_format): a single file (single, ddp; `torch.save` zip), a sharded directory (fsdp, hsdp, ...:
torch.distributed.checkpoint shards + Lightning's meta.pt), and any other folder of FOLDERS.

Every pickle of a checkpoint is read with `weights_only=True` (tensors, plain containers and a few allowlisted
types): unpickling anything else can run code, and checkpoints are shared, downloaded and read from buckets.
`MLPROJECT_TRUST_CHECKPOINT=1` reads them in full, for a file one trusts (docs/checkpoints.md, "What a
checkpoint may hold").
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from mlproject.checkpoint.safe_load import load_file, load_meta, read_into, refusing, trusted
from mlproject.core.errors import CheckpointError

# The checkpoint folders checkpoint_format tells apart, as its errors name them
FOLDERS = " or ".join(
    [
        "sharded",
        # feature: deepspeed
        "DeepSpeed",  # `latest` + ZeRO shards (zero_shards.py)
        # /feature: deepspeed
    ]
)

# What DCP's .metadata pickles (torch 2.13): its dataclasses, sizes, layouts, the path it was saved to; dtypes too
DCP_METADATA = {
    *(
        f"torch.distributed.checkpoint.metadata.{name}"
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",
    "pathlib.PosixPath",
    "pathlib._local.PosixPath",  # Python 3.13's name for it
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP unpickles its .metadata with plain pickle: this one finds DCP's own types and dtypes only (the
    restriction Python's pickle documentation gives), and refuses any other global before importing it."""

    def find_class(self, module: str, name: str):
        if f"{module}.{name}" in DCP_METADATA or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def read_metadata(path: str | Path):
    """The DCP Metadata of the sharded checkpoint at `path` (a folder or an fsspec URL)."""
    from fsspec.core import url_to_fs

    name = f"{str(path).rstrip('/')}/.metadata"
    fs, url = url_to_fs(name)
    with fs.open(url, "rb") as f, refusing(name):
        return (pickle.Unpickler if trusted() else _MetadataUnpickler)(f).load()


def check_unpickles(path: str | Path) -> None:
    """Refuse the checkpoint at `path` (a file, or a folder at a path or URL) if a pickle that a library reads in
    full holds more than a weights-only load allows: DCP's .metadata and non-tensor items (torch.load with
    weights_only=False inside DCP), Lightning's meta.pt, the files a strategy's own loader reads. Tensor data
    is not read. Nothing to check when trusted(), or for a file (this template and Lightning load it safely)."""
    if trusted() or Path(path).is_file():
        return
    # feature: deepspeed
    if checkpoint_format(path) == "deepspeed":  # the files DeepSpeed's engine loads itself
        from mlproject.checkpoint import zero_shards

        return zero_shards.check_unpickles(path)
    # /feature: deepspeed
    from fsspec.core import url_to_fs

    metadata = read_metadata(path)
    root = str(path).rstrip("/")
    fs, _ = url_to_fs(root)
    load_file(io.BytesIO(fs.cat_file(f"{root}/meta.pt")), f"{root}/meta.pt", map_location="meta")
    items = {fqn for fqn, entry in metadata.state_dict_metadata.items() if not hasattr(entry, "size")}
    for index, stored in metadata.storage_data.items():
        if index.fqn in items:
            name = f"{root}/{stored.relative_path}"
            if stored.transform_descriptors:  # DCP would decode (e.g. decompress) it first; this template never does
                raise CheckpointError(f"{name}: {index.fqn} is stored with transforms this template does not read")
            data = fs.cat_file(name, start=stored.offset, end=stored.offset + stored.length)
            load_file(io.BytesIO(data), f"{name} ({index.fqn})")


def checkpoint_format(path: str | Path) -> str:
    """'file' or a folder's format ('sharded', or another of FOLDERS in lower case); a clear error for anything
    else or a damaged checkpoint."""
    # feature: object_storage
    from mlproject.checkpoint import object_storage

    if object_storage.is_remote(path):
        return object_storage.checkpoint_format(str(path), _check_zip, FOLDERS)
    # /feature: object_storage
    path = Path(path)
    if path.is_file():
        return _check_zip(path, path)
    if (path / "meta.pt").is_file() and (path / ".metadata").is_file():
        return "sharded"
    # feature: deepspeed
    if (path / "latest").is_file():  # written last (distributed/zero.py)
        return "deepspeed"
    # /feature: deepspeed
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory but not a complete {FOLDERS} checkpoint")
    raise CheckpointError(f"{path} does not exist")


def _check_zip(path, source) -> str:
    """'file' if `source` (a path or an open file) is a complete torch.save zip, else a clear error."""
    try:  # torch.save writes a zip: a truncated file has no central directory, a damaged one a bad CRC
        with zipfile.ZipFile(source) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable checkpoint ({exc}); it is truncated or damaged") from None
    if bad is not None:
        raise CheckpointError(f"{path} is damaged (bad CRC in {bad})")
    return "file"


def _rekey_optimizer(state: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed's optimizer state is keyed by parameter name; a plain optimizer wants the
    parameter's position over all param groups, which is the order the names are listed in."""
    ids: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        params = [ids.setdefault(name, len(ids)) for name in group["params"]]
        groups.append({**group, "params": params})
    return {"state": {ids[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def _from_sharded(path: Path) -> dict[str, Any]:
    # ModelParallelStrategy saves "state_dict" and "optimizer_<i>" shards plus the rest in meta.pt. DCP reads the
    # shards in full into an empty state dict (as Lightning's _load_distributed_checkpoint, which would read meta.pt
    # with torch's default weights_only, blind to MLPROJECT_TRUST_CHECKPOINT).
    from torch.distributed.checkpoint import FileSystemReader

    from mlproject.utils import compat

    check_unpickles(path)
    checkpoint: dict[str, Any] = {}
    compat.load_whole_dcp(checkpoint, FileSystemReader(path))
    checkpoint.update(load_file(path / "meta.pt", map_location="cpu"))
    optimizers = sorted(k for k in checkpoint if k.startswith("optimizer_") and k[len("optimizer_") :].isdigit())
    checkpoint["optimizer_states"] = [_rekey_optimizer(checkpoint.pop(k)) for k in optimizers]
    return checkpoint


def load_full(path: str | Path) -> dict[str, Any]:
    """The checkpoint at `path` as a Lightning checkpoint dict on the CPU, with full (unsharded) tensors."""
    # feature: object_storage
    from mlproject.checkpoint import object_storage

    if object_storage.is_remote(path):
        return object_storage.load_full(str(path), checkpoint_format(path), load_full)
    # /feature: object_storage
    path = Path(path)
    fmt = checkpoint_format(path)
    if fmt == "file":
        return load_file(path, map_location="cpu")
    # feature: deepspeed
    if fmt == "deepspeed":
        from mlproject.checkpoint.zero_shards import ZeroShards, deepspeed_checkpoint

        return deepspeed_checkpoint(ZeroShards(path))
    # /feature: deepspeed
    return _from_sharded(path)


def averaged(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's state dict with its EMA weights (callbacks=ema keeps them as `ema.<parameter>`) in place of
    the raw parameters, and without the `ema.` keys: the weights the run validated and tested. Without an
    EMA, the state dict as it is."""
    ema = {k.removeprefix("ema."): v for k, v in state_dict.items() if k.startswith("ema.")}
    return {k: ema.get(k, v) for k, v in state_dict.items() if not k.startswith("ema.")}


def load_module(cls, path: str | Path):
    """The LightningModule `cls` rebuilt from the checkpoint's hyperparameters, with its weights (the EMA
    weights where the run kept them)."""
    checkpoint = load_full(path)
    module = cls(**checkpoint["hyper_parameters"])
    module.load_state_dict(averaged(checkpoint["state_dict"]))
    return module


def saved_shapes(path: str | Path) -> dict[str, Any]:
    """The model state's tensor names and shapes (torch.Size) in the checkpoint at `path`, any format (a sharded
    one at a path or URL), read without the tensor data."""
    if Path(path).is_file():
        return {k: v.shape for k, v in load_file(path, map_location="meta")["state_dict"].items()}
    # feature: deepspeed
    if checkpoint_format(path) == "deepspeed":
        from mlproject.checkpoint.zero_shards import ZeroShards, deepspeed_checkpoint

        return {k: v.shape for k, v in deepspeed_checkpoint(ZeroShards(path), full=False)["state_dict"].items()}
    # /feature: deepspeed
    entries = read_metadata(path).state_dict_metadata.items()  # a sharded folder
    return {
        k.removeprefix("state_dict."): e.size for k, e in entries if k.startswith("state_dict.") and hasattr(e, "size")
    }


def check_fits(saved: dict[str, Any], module: torch.nn.Module, name: str | Path, partial: bool = False) -> None:
    """Refuse in one line a checkpoint whose model state (`saved`: name -> tensor or shape) does not fit the
    LightningModule `module`, as one of another model or size does: the first tensor whose shape differs, else the
    first missing and unexpected names (unless the module loads non-strictly; a `partial` module holds only some of
    the checkpoint's tensors: no name is unexpected). Shapes are full ones: a DTensor's global shape, a ZeRO-3
    parameter's ds_shape."""

    def shape(value) -> str:
        if isinstance(value, torch.Tensor):
            value = getattr(value, "ds_shape", None) or value.shape
        return "x".join(map(str, value)) or "scalar"

    have = {k: shape(v) for k, v in saved.items()}
    want = {k: shape(v) for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    why = "a checkpoint of another model or size: use the model config it was trained with"
    for key, size in want.items():
        if key in have and have[key] != size:
            raise CheckpointError(
                f"{name} does not fit the model: {key} is {have[key]} in the checkpoint, {size} in the model ({why})"
            )
    if not getattr(module, "strict_loading", True):
        return
    missing = [k for k in want if k not in have]
    unexpected = [] if partial else [k for k in have if k not in want]
    found = [
        f"{whose} {keys[0]}{f' (and {len(keys) - 1} more)' if len(keys) > 1 else ''} is {where}"
        for whose, keys, where in (
            ("the model's", missing, "missing from the checkpoint"),
            ("the checkpoint's", unexpected, "not in the model"),
        )
        if keys
    ]
    if found:
        raise CheckpointError(f"{name} does not fit the model: {', and '.join(found)} ({why})")


def run_config(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The resolved config of the run that wrote `checkpoint` (saved by RunState), or None."""
    return (checkpoint.get("callbacks", {}).get("RunState") or {}).get("config")


def export(ckpt_path: str | Path, out: str | Path, module: str = "net", ema: bool = True) -> None:
    """Write the weights of the LightningModule's attribute `module` (the bare nn.Module) and the run's
    resolved config. `out` ending in .safetensors: a safetensors file, the config as JSON under the metadata
    key "config"; else `{"state_dict", "config"}` as plain tensors and containers (torch.load
    weights_only=True). With `ema` the EMA weights where the checkpoint has them (callbacks=ema), else the
    raw weights. The file appears under its name only once complete."""

    from omegaconf import OmegaConf

    checkpoint = load_full(ckpt_path)
    prefix = f"{module}."
    weights = averaged(checkpoint["state_dict"]) if ema else checkpoint["state_dict"]
    state_dict = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
    if not state_dict:
        raise CheckpointError(f"{ckpt_path} has no weights under '{module}'; set module= to the network's attribute")
    config = run_config(checkpoint)
    if config is None:  # a checkpoint written without RunState still has the model's hyperparameters
        config = {"model": OmegaConf.to_container(OmegaConf.create(dict(checkpoint["hyper_parameters"])))}
    tmp = f"{out}.tmp"
    if str(out).endswith(".safetensors"):
        _save_safetensors(state_dict, config, tmp)
    else:
        torch.save({"state_dict": shared_once(state_dict), "config": config}, tmp)
    os.replace(tmp, out)


def shared_once(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys whose tensors are equal (shape, dtype, every value) share one tensor, which torch.save writes once: a
    sharded checkpoint holds a tied weight (nanoGPT's wte and lm_head) as two copies. Loading is unchanged:
    load_state_dict copies a tensor into each parameter named by its keys."""
    kept: dict[tuple, list[torch.Tensor]] = {}
    out = {}
    for key, value in state_dict.items():
        like = kept.setdefault((value.shape, value.dtype, value.sum().item()), [])
        out[key] = next((t for t in like if torch.equal(t, value)), value)
        if out[key] is value:
            like.append(value)
    return out


def _save_safetensors(state_dict: dict[str, torch.Tensor], config: dict[str, Any], path: str) -> None:
    """safetensors refuses tensors that share memory (tied weights, views): each key gets its own copy, so
    the file has the plain export's keys and loads with `load_state_dict` as it does."""
    import json

    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for key, value in state_dict.items():
        storage = value.untyped_storage().data_ptr()
        tensors[key] = value.contiguous() if storage not in seen else value.clone()
        seen.add(storage)
    save_file(tensors, path, metadata={"config": json.dumps(config)})


def name_optimizer_states(checkpoint: dict[str, Any], orders: list[list[list[str]]]) -> dict[str, Any]:
    """Key a full checkpoint's optimizer states by parameter name: `orders` gives, per optimizer, the names in
    each of its param groups in the order of the process that wrote the checkpoint (ModelParallel.param_names).
    Lightning's ModelParallelStrategy maps positions to parameters in module order instead, which is wrong as
    soon as the groups reorder them (ours: weights with decay, then the rest)."""
    for state, groups in zip(checkpoint["optimizer_states"], orders, strict=True):
        order = [name for group in groups for name in group]
        if state["state"] and not isinstance(next(iter(state["state"])), int):
            continue  # already keyed by name
        state["state"] = {order[i]: value for i, value in state["state"].items()}
        state["param_groups"] = [
            {**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]
        ]
    return checkpoint


def sliced_file(path: str | Path, orders: list[list[list[str]]]) -> tuple[dict[str, Any], Any]:
    """A full file (single, ddp) for a rank that reads only slices of it: the checkpoint memory-mapped, its
    optimizer states keyed by name (name_optimizer_states with `orders`), and `read(name, key, start, numel)`:
    elements of a flattened weight (`key` None) or of its optimizer state `key`, read with preadv at the
    offsets torch records when loading onto the meta device (the mmap's pages would count as the rank's
    memory once touched)."""
    checkpoint = name_optimizer_states(load_file(path, mmap=True, map_location="cpu"), orders)
    meta = name_optimizer_states(load_meta(path), orders)  # where each tensor lies in the file
    states = {name: entry for saved in meta["optimizer_states"] for name, entry in saved["state"].items()}

    def read(name: str, key: str | None, start: int, numel: int) -> torch.Tensor:
        saved = meta["state_dict"][name] if key is None else states[name][key]
        out = torch.empty(numel, dtype=saved.dtype)
        read_into(out, path, saved, start)
        return out

    return checkpoint, read
