"""Test-only callbacks: count the collectives each training step issues; send a signal at a given step."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from lightning.pytorch import Callback

# The collectives of torch.distributed and of the functional ones DTensor uses. DDP's gradient buckets are
# all-reduced by its C++ reducer, which no Python wrapper sees: they are the strategy's minimum anyway.
DIST = ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "barrier"]
DIST += ["reduce_scatter_tensor", "reduce_scatter_single", "all_gather_object", "broadcast_object_list", "reduce"]
DIST += ["gather", "scatter", "all_to_all_single", "all_reduce_coalesced"]
FUNCOL = ["all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_reduce_coalesced", "broadcast"]


class CountCollectives(Callback):
    """Wraps the real functions (they still run) and writes, per rank, the calls between consecutive
    training batch ends: {"steps": [{name: calls}, ...], "fsdp_units": n} to <dir>/rank<r>.json."""

    def __init__(self, dir: str):
        self.dir, self.count, self.steps, self._depth = Path(dir), Counter(), [], 0

    def _wrap(self, module, name: str, label: str) -> None:
        real = getattr(module, name)

        @functools.wraps(real)
        def counted(*args, **kwargs):
            self._depth += 1  # count the outer call only: all_gather_object calls all_gather itself
            try:
                if self._depth == 1:
                    self.count[label] += 1
                return real(*args, **kwargs)
            finally:
                self._depth -= 1

        setattr(module, name, counted)

    def setup(self, trainer, pl_module, stage) -> None:
        for name in DIST:
            self._wrap(dist, name, name)
        for name in FUNCOL:
            self._wrap(funcol, name, f"funcol.{name}")

    def on_train_batch_end(self, *args) -> None:
        self.steps.append(dict(self.count))
        self.count.clear()

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FSDPModule

        units = sum(isinstance(m, FSDPModule) for m in pl_module.modules())
        path = self.dir / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"steps": self.steps, "fsdp_units": units}))


class SendSignal(Callback):
    """Rank `rank` sends itself `signum` at the end of optimizer step `step`; every rank writes the step at
    which training stopped (<dir>/stopped<r>.json)."""

    def __init__(self, dir: str, step: int, rank: int = 1, signum: int = signal.SIGTERM):
        self.dir, self.step, self.rank, self.signum = Path(dir), step, rank, signum

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)

    def on_exception(self, trainer, pl_module, exception) -> None:
        record = {"step": trainer.global_step, "exception": type(exception).__name__}
        (self.dir / f"stopped{trainer.global_rank}.json").write_text(json.dumps(record))


class Slow(Callback):
    """Every rank sleeps `seconds` before each batch, rank `rank` `factor` times as long: a straggler."""

    def __init__(self, seconds: float, rank: int = 1, factor: float = 3.0):
        self.seconds, self.rank, self.factor = seconds, rank, factor

    def on_train_batch_start(self, trainer, *args) -> None:
        time.sleep(self.seconds * (self.factor if trainer.global_rank == self.rank else 1))


class Stall(Callback):
    """Rank `rank` sleeps forever before the batch after optimizer step `step`: a rank that stops."""

    def __init__(self, step: int, rank: int = 1):
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, *args) -> None:
        while trainer.global_step == self.step and trainer.global_rank == self.rank:
            time.sleep(3600)
