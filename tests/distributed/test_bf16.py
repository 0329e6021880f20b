"""bf16 on the CPU: Lightning's bf16 plugins, FSDP2's MixedPrecisionPolicy and SyncBN train like fp32 does.

Tolerance, derived: bf16 keeps 8 significant bits, so one rounding is off by at most u = 2**-9 (2e-3)
relative. Under bf16-mixed only the inputs of matmuls and convolutions are rounded (products accumulate
in fp32, the loss and optimizer stay fp32), and those errors partly cancel over a batch: the per-step loss
stays within u of the fp32 run's, and two bf16 runs that differ only in how the batch is split over ranks
(another summation order) stay within u of each other. Measured over 20 digits steps: bf16 vs fp32 6.8e-4,
ddp vs single 6.6e-4 (a later run: 7.8e-4 and 5.4e-4, with ddp_spawn's losses and weights bitwise ddp's);
over 6 GPT steps, fsdp / tp / fsdp_tp vs single <= 4.1e-4. bf16-true also stores the weights and returns
the loss in bf16: an update under u of a weight is lost, so it only tracks fp32 within 2**-5 (measured
1.0e-2). Weights are not compared: after a few AdamW steps of lr 5e-3 (digits) and
1e-2 (GPT) bf16 rounding moves them by up to ~0.04, as much as training did.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from mlproject.checkpoint.convert import load_full
from mlproject.core.constants import PROJECT_ROOT
from tests.checkpoint.helpers import assert_export_matches
from tests.distributed.conftest import EXACT
from tests.distributed.test_model_parallel import TINY
from tests.helpers.processes import PYTHON, clean_env, read_metrics, run_dirs

U = 2**-9  # bf16's unit roundoff
MIXED = "trainer.precision=bf16-mixed"
DIGITS = {  # 20 steps of the digits CNN with SyncBN (tests/distributed/conftest.py), fp32 reference there
    "single": [MIXED],
    "ddp": [MIXED, "strategy=ddp", "trainer.devices=2"],
    "ddp_spawn": [MIXED, "strategy=ddp_spawn", "trainer.devices=2"],  # autocast inside processes fit starts
    "true": ["trainer.precision=bf16-true", "+callbacks.steps.checkpoint=true"],
}
GPT = {  # 6 steps of the tiny GPT (tests/distributed/test_model_parallel.py)
    "gpt": [MIXED],
    "gpt_fsdp": [
        MIXED,
        "strategy=fsdp",
        "trainer.devices=2",
        # FSDP2's MixedPrecisionPolicy on top of autocast: bf16 gathers, fp32 reduction (the bf16-mixed default)
        "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        "+callbacks.ckpt.save_last=true",  # a sharded checkpoint (a folder) to convert
    ],
    # feature: tensor
    "gpt_tp": [MIXED, "strategy=tp", "trainer.devices=2"],
    "gpt_fsdp_tp": [MIXED, "strategy=fsdp_tp", "trainer.devices=4"],
    # /feature: tensor
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, single_reference) -> dict[str, dict]:
    """name -> {losses, state or params, run_dir}; all runs start together, one thread per process."""
    procs = {}
    for name, overrides in {**DIGITS, **GPT}.items():
        log_dir = tmp_path_factory.mktemp(name)
        base = [*TINY, f"+callbacks.recorder.path={log_dir / 'record.pt'}"] if name in GPT else EXACT
        cmd = [PYTHON, "-m", "mlproject.train", f"paths.log_dir={log_dir}", *base, *overrides]
        if name == "gpt_fsdp":
            cmd.append(f"+callbacks.ckpt.dirpath={log_dir / 'checkpoints'}")
        env = clean_env(OMP_NUM_THREADS="1")
        popen = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs[name] = (popen, log_dir)
    out = {"fp32": single_reference}
    for name, (popen, log_dir) in procs.items():
        output = popen.communicate(timeout=600)[0].decode()
        assert popen.returncode == 0, f"{name} exited {popen.returncode}\n{output[-4000:]}"
        (run_dir,) = run_dirs(log_dir)
        record = torch.load(log_dir / "record.pt" if name in GPT else run_dir / "steps.pt")
        out[name] = {**record, "run_dir": run_dir, "log_dir": log_dir}
    return out


def assert_tracks(got: list[float], want: list[float], rtol: float) -> None:
    assert len(got) == len(want) and got[-1] < got[0] - 0.3  # it learns
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test waits for all runs
def test_bf16_mixed_tracks_fp32(runs):
    assert_tracks(runs["single"]["losses"], runs["fp32"]["losses"], rtol=U)
    state = runs["single"]["state"]
    assert state["net.features.0.1.running_mean"].dtype == torch.float32  # SyncBN statistics in fp32


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["ddp", "ddp_spawn", *(name for name in GPT if name != "gpt")])
def test_bf16_strategies_match_one_process_in_bf16(runs, name):
    reference = runs["gpt" if name.startswith("gpt") else "single"]
    assert_tracks(runs[name]["losses"], reference["losses"], rtol=U)
    if name.startswith("gpt"):
        got, want = read_metrics(runs[name]["run_dir"]), read_metrics(reference["run_dir"])
        assert got["test/samples"] == want["test/samples"]
        assert got["test/loss"] == pytest.approx(want["test/loss"], rel=U)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_true_trains_with_bf16_weights(runs):
    assert_tracks(runs["true"]["losses"], runs["fp32"]["losses"], rtol=2**-5)
    assert all(v.dtype == torch.bfloat16 for v in runs["true"]["state"].values() if v.is_floating_point())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_checkpoints_convert_and_export_like_fp32(runs, tmp_path):
    """A sharded checkpoint of the FSDP bf16 run holds the fp32 weights the run ended with; it and the
    bf16-true file (bf16 weights) export to a bare network that predicts what the checkpoint's module does."""
    fsdp = runs["gpt_fsdp"]
    (ckpt,) = (fsdp["log_dir"] / "checkpoints").glob("last.ckpt")
    state = load_full(ckpt)["state_dict"]
    for key, value in fsdp["state"].items():
        assert torch.equal(state[key], value), key
    assert_export_matches(ckpt, tmp_path / "gpt.pt", torch.randint(0, 256, (2, 32)))
    true_ckpt = runs["true"]["run_dir"] / "last.ckpt"
    assert load_full(true_ckpt)["state_dict"]["net.head.2.weight"].dtype == torch.bfloat16
    assert_export_matches(true_ckpt, tmp_path / "digits.pt", torch.rand(8, 1, 8, 8))
