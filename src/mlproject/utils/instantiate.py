"""Build lists of callbacks and loggers from their config groups (one key per object)."""

from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig


def instantiate_all(group: DictConfig | None) -> list:
    """Instantiate every entry of a group like `callbacks` or `logger` that has a `_target_`."""
    return [instantiate(c) for c in (group or {}).values() if isinstance(c, DictConfig) and "_target_" in c]
