"""The one way this template reads a torch.save file: `weights_only=True` unless the user trusts the file.

Unpickling anything but tensors and plain data can run code, and checkpoints are shared, downloaded and read from
buckets. `MLPROJECT_TRUST_CHECKPOINT=1` reads them in full, for a file one trusts (docs/safety.md).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from mlproject.core.errors import CheckpointError
from mlproject.utils import compat

TRUST = "MLPROJECT_TRUST_CHECKPOINT"


def trusted() -> bool:
    """Whether the user opted in to loading checkpoints in full (MLPROJECT_TRUST_CHECKPOINT=1)."""
    return os.environ.get(TRUST) == "1"


@contextlib.contextmanager
def refusing(name: str | Path):
    """A pickle that a weights-only load refuses ends in one line naming `name` and the type it holds."""
    try:
        yield
    except pickle.UnpicklingError as exc:
        reason = str(exc).rpartition("WeightsUnpickler error: ")[2].split(". ")[0]  # torch's own words, first
        found = re.search(r"GLOBAL ([\w.]+)", reason)
        what = found.group(1) if found else f"an object torch's weights-only unpickler refuses ({reason})"
        raise CheckpointError(
            f"{name} holds {what}: checkpoints load with weights_only=True, as unpickling anything else can run "
            f"code; if you trust this file, run again with {TRUST}=1"
        ) from None


def load_file(source, name: str | Path | None = None, **kwargs) -> Any:
    """`torch.load(source, **kwargs)` with weights_only=True unless trusted(): the one way this template reads a
    torch.save file. A refused pickle is one CheckpointError naming `name` (default: `source`)."""
    with refusing(name or source):
        return torch.load(source, weights_only=not trusted(), **kwargs)


def load_meta(file: str | Path) -> dict:
    """A torch.save file with its tensors on the meta device, each knowing its offset in the file."""
    return load_file(file, map_location="meta")


def read_into(out: torch.Tensor, file: str | Path, saved: torch.Tensor, start: int) -> None:
    """Elements [start, start + out.numel()) of the flattened meta tensor `saved` (load_meta) from `file`, read
    with preadv: a rank reads only its slice (not memory-mapped: the kernel maps whole page-cache folios around
    each read, up to 3 times the slice)."""
    buffer = out if saved.dtype == out.dtype else torch.empty(out.numel(), dtype=saved.dtype)
    offset = compat.file_offset(saved) + (saved.storage_offset() + start) * saved.element_size()
    view, done = buffer.numpy().view("uint8"), 0
    with open(file, "rb") as f:
        while done < view.size:  # one read returns at most ~2 GiB
            done += os.preadv(f.fileno(), [view[done:]], offset + done)
    if buffer is not out:
        out.copy_(buffer)
