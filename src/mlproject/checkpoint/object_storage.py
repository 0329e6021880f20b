"""Checkpoints in object storage: `paths.ckpt_dir=s3://<bucket>/<prefix>` (the `s3` extra's s3fs; any other fsspec
URL needs its own package). The checkpoint code hands a path here where it is a URL (core.paths.is_url); logs,
metrics and data stay in local folders (core.paths.refuse_url_paths)."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlproject.core.errors import CheckpointError
from mlproject.core.paths import is_url

is_remote = is_url  # the checkpoint code's name for it
# written last, the file that makes a checkpoint folder complete
MARKERS = (
    "/.metadata",  # a sharded (DCP) folder's
    # feature: deepspeed
    "/latest",  # a DeepSpeed folder's
    # /feature: deepspeed
)


def check_strategy(dirpath: str, strategy) -> None:
    """Refuse a strategy whose checkpoints the template cannot write to object storage, before any step."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    # feature: deepspeed
    # DeepSpeed's is a DDPStrategy
    # /feature: deepspeed
    known = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
    if not isinstance(strategy, known):
        raise CheckpointError(
            f"paths.ckpt_dir={dirpath}: object storage takes the checkpoints of the template's strategies, "
            f"not {type(strategy).__name__}'s; set paths.ckpt_dir to a local or shared-filesystem directory"
        )


def check_sharded(path: str, fmt: str) -> None:
    """Refuse a checkpoint in object storage (of format `fmt`) that a sharded strategy cannot read: only a sharded
    folder, which DCP reads through its fsspec reader, chosen by a URL checkpoint_id."""
    if fmt != "sharded":
        raise CheckpointError(
            f"{path}: a single-file checkpoint in object storage resumes under strategy=single or ddp; "
            "copy it to a local path for a sharded strategy"
        )


def replace(src: str, dst: str) -> None:
    """storage.replace_checkpoint at a URL: the move is a copy then a delete. A file's object under `dst` changes
    only once the copy is complete, so readers see the old checkpoint or the new one, never a part. A sharded
    directory is complete while it holds DCP's `.metadata`, written last: the old `dst` loses it first and the
    copy writes it last, and a crash in between leaves the complete `<dst>.tmp`, which `last_checkpoint` resumes
    from. Every folder's marker in MARKERS moves that way."""
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(src)
    fs.invalidate_cache()  # other ranks wrote shards: listings this process cached are stale
    if not fs.isdir(src):
        fs.mv(src, dst)
        return
    remove_remote(dst)
    names = sorted((p[len(root) :] for p in fs.find(src)), key=lambda name: name in MARKERS)
    for name in names:  # the completeness marker last
        fs.copy(src + name, dst + name)
    remove_remote(src)


def remove_remote(url: str) -> None:
    """Remove a checkpoint in object storage; a checkpoint directory loses its completeness marker
    first, so that no partly deleted directory reads as complete (checkpoint_format)."""
    from fsspec.core import url_to_fs

    fs, _ = url_to_fs(url)
    fs.invalidate_cache()  # other ranks wrote shards: listings this process cached are stale
    if fs.isdir(url):
        for marker in MARKERS:
            if fs.exists(url + marker):
                fs.rm(url + marker)
        fs.rm(url, recursive=True)
    elif fs.exists(url):
        fs.rm(url)


def client_error(exc: BaseException) -> bool:
    """Whether `exc` is botocore's (an unreachable endpoint, no credentials); s3fs reports a bucket's refusals
    as an OSError."""
    botocore = sys.modules.get("botocore.exceptions")  # not imported: no botocore error can have been raised
    return botocore is not None and isinstance(exc, botocore.BotoCoreError)


def download(url: str, dest: Path) -> None:
    """Copy the checkpoint at fsspec `url`, a file or a folder, to the local path `dest`."""
    from fsspec.core import url_to_fs

    fs, _ = url_to_fs(url)
    fs.invalidate_cache()  # written by other processes since this one listed it
    if fs.isdir(url):
        fs.get(f"{url.rstrip('/')}/", f"{dest}/", recursive=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fs.get(url, str(dest))


def checkpoint_format(path: str, check_zip: Callable[[str, Any], str], folders: str) -> str:
    """convert.checkpoint_format at a URL, with its zip check and folder names (convert imports this module)."""
    from fsspec.core import url_to_fs

    url = str(path).rstrip("/")
    fs, _ = url_to_fs(url)
    fs.invalidate_cache()  # written by other processes since this one listed it
    if fs.isfile(url):
        with fs.open(url, "rb") as f:
            return check_zip(path, f)
    if fs.isfile(f"{url}/meta.pt") and fs.isfile(f"{url}/.metadata"):  # .metadata comes last (replace)
        return "sharded"
    # feature: deepspeed
    if fs.isfile(f"{url}/latest"):  # last too (distributed/zero.py)
        return "deepspeed"
    # /feature: deepspeed
    if fs.isdir(url):
        raise CheckpointError(f"{path} is a directory but not a complete {folders} checkpoint")
    raise CheckpointError(f"{path} does not exist")


def load_full(path: str, fmt: str, load_folder: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """convert.load_full at a URL (of format `fmt`): a file read as it streams in, a directory copied to a local
    one first and read there by `load_folder` (convert's: it imports this module)."""
    import fsspec

    from mlproject.checkpoint.safe_load import load_file

    if fmt == "file":
        with fsspec.open(str(path), "rb") as f:
            return load_file(f, path, map_location="cpu")
    with tempfile.TemporaryDirectory() as tmp:  # a directory: read in full here anyway
        download(str(path), Path(tmp))
        return load_folder(tmp)


def last_checkpoint(ckpt_dir: str, format_of: Callable[[str], str]) -> str | None:
    """The checkpoint `ckpt_path=auto` resumes from in object storage: `<ckpt_dir>/last.ckpt` if complete, else
    a complete `last.ckpt.tmp` (a crash while a sharded last.ckpt was replaced leaves it: replace), else an
    incomplete last.ckpt (for `format_of`, convert's checkpoint_format, to refuse), else None (start fresh)."""
    from fsspec.core import url_to_fs

    def complete(url: str) -> bool:
        try:
            return bool(format_of(url))
        except CheckpointError:
            return False

    last = f"{ckpt_dir.rstrip('/')}/last.ckpt"
    done = [url for url in (last, f"{last}.tmp") if complete(url)]
    return done[0] if done else last if url_to_fs(last)[0].exists(last) else None
