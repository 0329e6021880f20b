"""Test-only callback: when each rank's process started and took its first step, and which processes
rank 0 had already started when its callbacks were built (before the Trainer exists)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lightning.pytorch import Callback


def started_at(pid: int | str = "self") -> float:
    """Wall-clock start time of a process, to the kernel's clock tick (from /proc, Linux)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since_boot


def children() -> list[int]:
    """Pids of the running processes whose parent is this one."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                pids.append(int(stat.parent.name))
        except (OSError, ValueError):
            pass  # gone meanwhile
    return pids


class StartupTimes(Callback):
    def __init__(self, path: str):
        self.path, self.built, self.children = Path(path), time.time(), children()
        self.first_step: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first_step is not None:
            return
        self.first_step = time.time()
        record = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "started": started_at(),
            "built": self.built,
            "first_step": self.first_step,
            "children_when_built": self.children,
        }
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
