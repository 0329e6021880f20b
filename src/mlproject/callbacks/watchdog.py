"""Stall watchdog: when no batch finishes for `timeout` seconds, every rank writes all its threads' stacks; when
none progresses for `end_after` seconds more, the job ends (exit 1) with one line naming the rank that stopped
first.

A hung collective shows as silence: each rank waits in a different place and nothing is printed. The
dumps say where each rank is. faulthandler does the waiting in a C thread, so re-arming it every batch
costs microseconds and it still fires when Python itself is blocked inside a collective.

Which rank stopped first: every rank counts the points of the loop it passed (batch start, backward, batch end;
the same sequence on every rank) in a plain attribute. At the end each rank writes its count to the run directory
(shared by all nodes) without any collective, as the process group is the thing that hangs; rank 0 waits for the
others' records, names the rank with the lowest count (the earliest, on a tie), and every rank exits.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)

EXIT_STALLED = 1


class StallWatchdog(Callback):
    def __init__(self, timeout: float = 300, end_after: float | None = 60):
        self.timeout, self.end_after = timeout, end_after
        self._file = None
        self._dir: Path | None = None
        self._rank, self._world, self._step = 0, 1, 0
        self._progress, self._last = 0, time.monotonic()  # points passed; when the last was (monotonic)
        self._done = threading.Event()

    def _mark(self, trainer, *_) -> None:
        self._progress, self._last, self._step = self._progress + 1, time.monotonic(), trainer.global_step

    def _arm(self, trainer, *args) -> None:
        self._mark(trainer)
        if self._file is not None:
            faulthandler.dump_traceback_later(self.timeout, repeat=True, file=self._file)

    def _disarm(self, *_) -> None:
        self._done.set()
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self._file = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._dir = Path(trainer.default_root_dir) / "stalls"
        self._rank, self._world = trainer.global_rank, trainer.world_size
        path = self._dir / f"rank{self._rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")
        ends = f"; {self.end_after:g}s more end the job" if self.end_after is not None else ""
        log.info(f"stall watchdog: no batch for {self.timeout:g}s writes every rank's stacks to {path.parent}/{ends}")
        self._done.clear()
        self._arm(trainer)
        if self.end_after is not None:
            threading.Thread(target=self._watch, name="stall-watchdog", daemon=True).start()

    on_train_batch_end = on_validation_batch_end = on_train_epoch_start = on_validation_start = _arm
    on_train_batch_start = on_before_backward = _mark
    on_fit_end = on_exception = _disarm

    def _watch(self) -> None:
        """A Python thread: it runs while the main thread waits in a collective or sleeps (both release the GIL)."""
        while not self._done.wait(min(1.0, self.timeout)):
            if time.monotonic() - self._last > self.timeout + self.end_after:
                self._end()

    def _end(self) -> None:
        record = {
            "rank": self._rank,
            "progress": self._progress,
            "step": self._step,
            "idle": time.monotonic() - self._last,
        }
        (self._dir / f"rank{self._rank}.json").write_text(json.dumps(record))
        verdict = self._dir / "verdict.txt"
        # rank 0 waits for the others' records; they wait longer for its verdict, as its own watch may fire a
        # little later (its last batch point came later, or a loaded machine ran its thread late)
        wait = min(30.0, self.timeout + self.end_after) if self._rank == 0 else max(30.0, self.timeout + self.end_after)
        deadline = time.monotonic() + wait
        if self._rank == 0:
            paths = [self._dir / f"rank{r}.json" for r in range(self._world)]
            while not all(p.exists() for p in paths) and time.monotonic() < deadline:
                time.sleep(0.2)
            records = [json.loads(p.read_text()) for p in paths if p.exists()]
            silent = [r for r in range(self._world) if not paths[r].exists()]  # its Python never ran again
            first = silent[0] if silent else min(records, key=lambda r: (r["progress"], -r["idle"]))["rank"]
            step = next((r["step"] for r in records if r["rank"] == first), "?")
            line = (
                f"error: training stalled: rank {first} stopped first (at step {step}); no rank progressed for "
                f"{self.timeout + self.end_after:g}s; every rank's stacks are in {self._dir}/"
            )
            verdict.write_text(line + "\n")
            print(line, file=sys.stderr, flush=True)
        else:
            while not verdict.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        os._exit(EXIT_STALLED)  # from this thread: the main one is stuck; a rank that ends ends the job
