"""FSDP, tensor parallel and 2-D FSDP x TP train the tiny GPT exactly as one process does.

Every run is a real `python -m mlproject.train` with gloo processes on this machine, fp32, the same
seed and the same GLOBAL batch. Compared with the single-process run: the global loss of every step,
the final parameters, and the test metrics (token-weighted loss, accuracy, sequence count).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import read_metrics, run, run_dirs

TINY = [
    "model=gpt",
    "data=text",
    "trainer.accelerator=cpu",
    "extras.print_config=false",
    "callbacks=none",
    "+callbacks.footprint._target_=mlproject.callbacks.footprint.ModelFootprint",
    "+callbacks.recorder._target_=tests.distributed.recorder.Recorder",
    "model.net.n_layer=2",
    "model.net.n_head=4",
    "model.net.n_embd=32",
    "data.block_size=32",
    "data.batch_size=8",
    "data.val_fraction=0.005",
    "data.test_fraction=0.005",
    "model.optimizer.lr=0.01",
    "model.scheduler.warmup_steps=2",
    "trainer.max_epochs=1",
    "+trainer.max_steps=6",
    "+trainer.limit_val_batches=0",
]
STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "fsdp": ["strategy=fsdp", "trainer.devices=2"],
    "tp": ["strategy=tp", "trainer.devices=2", "strategy.tensor_parallel_size=2"],
    "fsdp_tp": ["strategy=fsdp_tp", "trainer.devices=4", "strategy.tensor_parallel_size=2"],
}
LOSS_RTOL = 1e-5  # fp32; reduction order differs between strategies (all-reduce, sharded matmuls)
PARAM_ATOL = 1e-5  # after 6 AdamW steps of lr 0.01 (the parameters move by ~0.05)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """name -> {losses, params, metrics, footprint (bytes per rank)} for every strategy."""
    out = {}
    for name, overrides in STRATEGIES.items():
        log_dir = tmp_path_factory.mktemp(name)
        record = log_dir / "record.pt"
        run("train", *TINY, *overrides, f"+callbacks.recorder.path={record}", log_dir=log_dir, timeout=300)
        (run_dir,) = run_dirs(log_dir)
        logs = "".join(p.read_text() for p in run_dir.glob("*.log"))
        footprint = [int(b) for b in re.findall(r"model footprint on this rank: .* = (\d+) bytes", logs)]
        out[name] = {**torch.load(record), "metrics": read_metrics(run_dir), "footprint": footprint}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "single"])
def test_same_training_as_one_process(runs, name):
    ref, got = runs["single"], runs[name]
    assert len(got["losses"]) == len(ref["losses"]) == 6
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # it learns: the comparison is not between constants
    assert got["params"].keys() == ref["params"].keys()
    for key, value in ref["params"].items():
        torch.testing.assert_close(got["params"][key], value, rtol=0, atol=PARAM_ATOL, msg=key)
    for key in ("test/loss", "test/acc"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5), key
    assert got["metrics"]["test/samples"] == ref["metrics"]["test/samples"]  # each sequence counted once


@pytest.mark.slow
def test_fsdp_holds_a_share_of_the_model(runs):
    """Per-rank parameter + optimizer bytes, logged by every run: FSDP on 2 ranks holds half of DDP's."""
    single, ddp, fsdp = runs["single"]["footprint"], runs["ddp"]["footprint"], runs["fsdp"]["footprint"]
    tp, fsdp_tp = runs["tp"]["footprint"], runs["fsdp_tp"]["footprint"]
    assert len(ddp) == len(fsdp) == len(tp) == 2 and len(fsdp_tp) == 4
    assert ddp == single * 2  # DDP replicates the whole model on every rank
    for rank_bytes in fsdp:
        assert rank_bytes == pytest.approx(ddp[0] / 2, rel=0.02)
    assert max(tp) < single[0] and max(fsdp_tp) < min(fsdp)  # TP splits the blocks; 2-D also shards the rest
