"""Train real runs, kill them for real, and read back what they left."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import torch

from mlproject.checkpoint.convert import load_full
from tests.conftest import run

# 3 epochs of 19 optimizer steps on the digits data, fp32 on the CPU, no test stage
BASE = ["extras.print_config=false", "trainer=cpu", "trainer.max_epochs=3", "test=false", "logger=csv"]
STEPS_PER_EPOCH = 19


def strategy(name: str, devices: int = 1) -> list[str]:
    return [f"strategy={name}", f"trainer.devices={devices}"]


def kill_at(step: int, rank: int | None = None) -> list[str]:
    """Overrides adding a callback that SIGKILLs the process(es) when optimizer step `step` starts."""
    return [
        "+callbacks.kill._target_=tests.checkpoint.killer.KillAt",
        f"+callbacks.kill.step={step}",
        f"+callbacks.kill.rank={'null' if rank is None else rank}",
    ]


def train(log_dir: Path, run_id: str, *overrides: str, check: bool = True, timeout: int = 240):
    return run("train", *BASE, f"run_id={run_id}", *overrides, log_dir=log_dir, check=check, timeout=timeout)


def run_dir(log_dir: Path, run_id: str) -> Path:
    return log_dir / "train" / "runs" / run_id


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_full(ckpt)["state_dict"]


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    diff = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not diff, f"tensors differ: {diff}"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def epoch_metrics(run: Path, prefix: tuple[str, ...] | str = ("val/", "train/acc")) -> dict[int, dict[str, float]]:
    """Per-epoch values from csv/metrics.csv; a row logged again after a resume replaces the earlier one."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    with open(run / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("epoch"):
                for key, value in row.items():
                    if value and key.startswith(prefix):
                        out[int(row["epoch"])][key] = float(value)
    return dict(out)
