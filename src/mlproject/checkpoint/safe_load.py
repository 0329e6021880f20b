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


def allow_deepspeed_types() -> None:
    """DeepSpeed's optimizer-state files pickle four of its own types (ZeRO 1-3; DynamicLossScaler under fp16):
    plain records of numbers, allowed in weights-only loads (load_file)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    torch.serialization.add_safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address])
