"""Train real runs, kill them for real, and read back what they left."""

from __future__ import annotations

import contextlib
import csv
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from mlproject.checkpoint.convert import load_full
from tests.helpers.processes import run

# 3 epochs of 19 optimizer steps on the digits data, fp32 on the CPU. MLPROJECT_TEST_ASYNC_SAVE=1 runs every
# proof that trains through `train` with asynchronous saves (callbacks.model_checkpoint.async_save=true).
BASE = ["extras.print_config=false", "trainer=cpu", "trainer.max_epochs=3", "logger=csv"]
ASYNC = ["callbacks.model_checkpoint.async_save=true"] if os.environ.get("MLPROJECT_TEST_ASYNC_SAVE") == "1" else []
STEPS_PER_EPOCH = 19


def strategy(name: str, devices: int = 1) -> list[str]:
    return [f"strategy={name}", f"trainer.devices={devices}"]


def kill_at(step: int, rank: int | None = None, stamp: Path | None = None) -> list[str]:
    """Overrides adding a callback that SIGKILLs the process(es) when optimizer step `step` starts."""
    return [
        "+callbacks.kill._target_=tests.helpers.callbacks.KillAt",
        f"+callbacks.kill.step={step}",
        f"+callbacks.kill.rank={'null' if rank is None else rank}",
        f"+callbacks.kill.stamp={'null' if stamp is None else stamp}",
    ]


def train(log_dir: Path, run_id: str, *overrides: str, test: bool = False, check: bool = True, timeout: int = 600):
    """A real `python -m mlproject.train` run (its test stage only if `test`)."""
    overrides = (*BASE, f"run_id={run_id}", f"test={str(test).lower()}", *overrides)
    if ASYNC and "callbacks=none" not in overrides:
        overrides = (*overrides, *ASYNC)
    return run("train", *overrides, log_dir=log_dir, check=check, timeout=timeout)


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


def assert_export_matches(ckpt: Path, out: Path, x: torch.Tensor) -> None:
    """The exported file loads with weights_only=True into the bare network, which predicts exactly what
    the LightningModule rebuilt from the checkpoint predicts; the safetensors export holds the same tensors."""
    from hydra.utils import get_class, instantiate
    from safetensors.torch import load_file

    from mlproject.checkpoint.convert import export, load_module

    export(ckpt, out)
    exported = torch.load(out, weights_only=True)
    net = instantiate(exported["config"]["model"]["net"])
    net.load_state_dict(exported["state_dict"])
    module = load_module(get_class(exported["config"]["model"]["_target_"]), ckpt)
    with torch.no_grad():
        assert torch.equal(net.eval()(x), module.eval()(x))
    export(ckpt, out.with_suffix(".safetensors"))
    assert_bitwise(load_file(out.with_suffix(".safetensors")), exported["state_dict"])


def wait_until_gone(marker: str, timeout: float) -> float:
    """Seconds until no process whose command line contains `marker` is left (fails after `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        alive = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):  # exited while we looked
                alive += [cmdline] if marker in cmdline.read_text() else []
        if not alive:
            return time.monotonic() - start
        time.sleep(1)
    raise AssertionError(f"processes of {marker} still alive after {timeout} s")


def assert_same_optimizer(got: dict, want: dict, tol: float = 1e-4) -> None:
    """Two AdamW state dicts keyed by position: equal param groups and steps, and each moment within `tol`
    of the largest magnitude of that tensor (fp32 runs on different world sizes; measured <= 2.3e-6)."""
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert torch.equal(got["state"][i]["step"], state["step"]), i
        for key in ("exp_avg", "exp_avg_sq"):
            scale = state[key].abs().max()
            torch.testing.assert_close(
                got["state"][i][key], state[key], rtol=0, atol=float(tol * scale), msg=f"{i} {key}"
            )
