"""Strategy factories named by configs/strategy/*.yaml. Timeouts are plain seconds in config."""

from __future__ import annotations

from datetime import timedelta


def single():
    """One process: Lightning's 'auto' resolves to SingleDeviceStrategy when devices=1 (preflight checks)."""
    return "auto"


def ddp(timeout: float = 1800, **kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(timeout=timedelta(seconds=timeout), **kwargs)
