"""experiment=gpt_124m on one GPU, eager and compiled, a few steps each: no host-device sync in the steady-state
steps, and the tokens/s, MFU and peak memory of both, printed as scripts/gpu_check.py prints them.

The runs are gpu_check's (`run_one`, with its StepClock timings), with `torch.cuda.set_sync_debug_mode("error")`
over steps 5..13 of 15 (gpu_check.no_sync_overrides): a sync there fails the run. A control run in which a
callback reads the loss (`.item()`) at every step must fail so, or the check proves nothing. Budget: about
2 minutes on one H200 (the compiled run compiles cold).
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from mlproject.callbacks.throughput import peak_flops
from mlproject.core.constants import PROJECT_ROOT
from tests.helpers.gpt import TINY_GPT
from tests.helpers.gpu import requires_gpu

spec = importlib.util.spec_from_file_location("gpu_check", PROJECT_ROOT / "scripts" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # scripts/ is no package
spec.loader.exec_module(gpu_check)

pytestmark = [*requires_gpu, pytest.mark.slow]

STEPS = 15  # an epoch of gpt_124m is 12 steps: the checked steps include an epoch boundary
RUNS = {  # name -> (experiment, overrides); the control is a tiny GPT whose callback reads every step's loss
    "eager": ("gpt_124m", ["model.compile=false"]),
    "compiled": ("gpt_124m", ["model.compile=true"]),
    "control": (
        "gpt",
        ["trainer=gpu", *(o for o in TINY_GPT if not o.startswith(("model=", "data="))), "model.compile=false"],
    ),
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    """name -> gpu_check's row (ok, error, step_s, tokens_per_s, flops_per_token, memory) and every step's
    loss; one run at a time, so that each has the GPU to itself."""
    tmp = tmp_path_factory.mktemp("gpt_124m")
    out = {}
    for name, (experiment, overrides) in RUNS.items():
        losses = tmp / f"{name}_losses.pt"
        record = ["+callbacks.losses._target_=tests.gpu.probe.DeviceLosses", f"+callbacks.losses.path={losses}"]
        record.append(f"+callbacks.losses.read={str(name == 'control').lower()}")
        overrides = [*overrides, *gpu_check.no_sync_overrides(STEPS), *record]
        row = gpu_check.run_one(name, experiment, overrides, STEPS, str(tmp))
        out[name] = {**row, "losses": torch.load(losses).tolist() if row["ok"] else None}
    return out


@pytest.mark.timeout(600)
def test_a_sync_in_the_checked_steps_fails_the_run(rows):
    control = rows["control"]
    assert not control["ok"] and "synchronizing" in control["error"], control


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["eager", "compiled"])
def test_gpt_124m_trains_without_host_syncs(rows, name):
    row = rows[name]
    assert row["ok"], row.get("error")
    losses = row["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    # it learns: on CPU, with 2 of its 12 layers and 4 of its 32 sequences, from 6.0 to 3.0 in these 15 steps
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0


@pytest.mark.timeout(600)
def test_gpt_124m_reports_tokens_per_second_mfu_and_memory(rows, capsys):
    """Printed whatever the outcome, in the suite's output; MFU where the GPU's bf16 peak is known."""
    device = torch.cuda.get_device_properties(0)
    peak = peak_flops(device.name)
    timed = {name: rows[name] for name in ("eager", "compiled") if rows[name]["ok"]}
    mfu = {name: row["flops_per_token"] * row["tokens_per_s"] / peak if peak else None for name, row in timed.items()}
    lines = [f"gpt_124m on {device.name}, bf16, {STEPS} steps (median after {gpu_check.WARMUP_STEPS}):"]
    for name, row in timed.items():
        lines.append(
            f"  {name:<9} {row['step_s'] * 1e3:7.1f} ms/step {row['tokens_per_s']:9.0f} tokens/s "
            f"MFU {f'{mfu[name]:.1%}' if peak else 'n/a (peak unknown)'} peak {row['memory'] / 2**30:.2f} GiB"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(timed) == 2, {name: rows[name].get("error") for name in ("eager", "compiled")}
    for name, row in timed.items():
        assert row["tokens_per_s"] > 0 and 0 < row["memory"] <= device.total_memory
        assert row["flops_per_token"] > 6 * 80e6  # 6 x ~86M weights, plus attention
        assert peak is None or 0 < mfu[name] < 1
