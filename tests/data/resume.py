"""Resume on another world size: which samples each training step used, recorded by every rank, and the check
that a straight run and a killed run resumed on another number of processes read the same global batches."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from tests.checkpoint.helpers import max_diff

# Runs on different world sizes differ by the order of their fp32 reductions only (no dropout, BatchNorm
# synced, no augmentation: its streams are drawn per batch of a rank): ~1e-7 relative per value. Measured
# after 10 steps: 4.8e-7 on the images (a BatchNorm running_var of 2.3: 2 ulps) and 1.9e-6 on the tokens, all
# of it in attention's key bias, whose true gradient is 0 (softmax ignores what is added to every key), so
# that AdamW's update m / (sqrt(v) + eps) follows rounding alone; every other parameter within 1e-7. A wrong
# data position (one batch skipped at the resume) moves them by 8.5e-4 (tokens) and 0.27 (images). CLOSE is
# 10x the one, 1/40 the other.
CLOSE = 2e-5


class RecordSamples(Callback):
    """Appends `<epoch> <step> <sample indices>` to `<dir>/<pid>.txt` after each optimizer step of this rank:
    a run killed later keeps what it trained. Batches are plain `(x, y)`: the indices are the sampler's for the
    batch's position in the epoch (training/loaders.TrainSampler), which Lightning restores on a resume."""

    def __init__(self, dir: str):
        self.dir = Path(dir)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.dir.mkdir(exist_ok=True)
        with open(self.dir / f"{os.getpid()}.txt", "a") as f:
            loader = trainer.train_dataloader
            ids = loader.sampler.indices()[batch_idx * loader.batch_size : (batch_idx + 1) * loader.batch_size]
            print(trainer.current_epoch, trainer.global_step - 1, *ids.tolist(), file=f)


def record(dir: Path) -> list[str]:
    return [f"+callbacks.seen._target_={RecordSamples.__module__}.RecordSamples", f"+callbacks.seen.dir={dir}"]


def seen(dir: Path) -> dict[tuple[int, int], list[int]]:
    """(epoch, step) -> the sample indices of that global batch, over all ranks, sorted."""
    out: dict[tuple[int, int], list[int]] = {}
    for path in dir.glob("*.txt"):
        for line in path.read_text().splitlines():
            epoch, step, *ids = map(int, line.split())
            out.setdefault((epoch, step), []).extend(ids)
    return {key: sorted(ids) for key, ids in sorted(out.items())}


def assert_resumed_in_place(straight: Path, killed: Path, resumed: Path, at: tuple[int, int], batch: int) -> None:
    """The resumed run (from the checkpoint of (epoch, step) `at`) and the killed run's steps before it read
    the straight run's global batches; so each epoch's samples are read once, over the two halves."""
    want, before, after = seen(straight), seen(killed), seen(resumed)
    assert min(after) == at and max(before) > at  # the killed run trained past its last checkpoint
    assert {k: v for k, v in before.items() if k < at} | after == want
    assert all(len(ids) == batch for ids in want.values())
    for epoch in {e for e, _ in want}:
        ids = [i for (e, _), batch_ids in want.items() if e == epoch for i in batch_ids]
        assert len(set(ids)) == len(ids), f"epoch {epoch} reads a sample twice"


def assert_close_to(straight: dict, resumed: dict) -> float:
    """The largest parameter difference, under CLOSE; returned for the test to print."""
    assert straight.keys() == resumed.keys()
    diff = max_diff(straight, resumed)
    assert diff < CLOSE, diff
    return diff
