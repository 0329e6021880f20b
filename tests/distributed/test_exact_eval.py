"""Evaluation is exact: N processes report what one process computes over the whole split, for any
split size (dividing, odd; one smaller than the world is refused, tests/test_units.py) — and every rank holds the
same value. No padding: ranks' last batches differ in size (training/loaders.EvalBatches)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import multiclass_accuracy, multiclass_auroc, multiclass_f1_score

from mlproject.data.digits import DigitsDataModule
from tests.distributed import eval_worker
from tests.helpers.processes import launch, read_metrics, run, run_dirs, together

WORKER = Path(eval_worker.__file__)


def reference(dataset) -> dict[str, float]:
    """The metrics of the whole split, computed directly on one process."""
    model = eval_worker.fixed_model().eval()
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    y = torch.stack([dataset[i][1] for i in range(len(dataset))])
    with torch.no_grad():
        logits = model(x)
    return {
        "acc": multiclass_accuracy(logits, y, num_classes=10, average="micro").item(),
        "f1": multiclass_f1_score(logits, y, num_classes=10, average="macro").item(),
        "auroc": multiclass_auroc(logits, y, num_classes=10).item(),
        "loss": F.cross_entropy(logits.double(), y).item(),
        "samples": float(len(y)),
    }


def splits() -> dict[str, object]:
    out = {}
    for n in eval_worker.VAL_SIZES:
        dm = DigitsDataModule(val_size=n, test_size=eval_worker.TEST_SIZE)
        dm.setup()
        out[f"val{n}"] = dm.val_set
    out["test"] = dm.test_set
    return out


WORLDS = [1, 2, 3]


@pytest.fixture(scope="module")
def rank_metrics(tmp_path_factory) -> dict[int, list[dict]]:
    """world size -> what each rank of the eval job wrote; the jobs of every world size start together."""
    outs = {world: tmp_path_factory.mktemp(f"world{world}") for world in WORLDS}

    def job(world: int):
        return lambda: launch(WORKER, str(outs[world]), "ddp" if world > 1 else "auto", world=world)

    together(*(job(world) for world in WORLDS))
    return {w: [json.loads((out / f"rank{r}.json").read_text()) for r in range(w)] for w, out in outs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_metrics_equal_single_process_reference(world, rank_metrics):
    ranks = rank_metrics[world]
    assert all(r == ranks[0] for r in ranks), "ranks disagree on a synced metric"
    for split, dataset in splits().items():
        stage = "test" if split == "test" else "val"
        got = {k.split("/")[1]: v for k, v in ranks[0][split].items()}
        want = reference(dataset)
        assert got == pytest.approx(want, abs=1e-6), f"{stage} split of {len(dataset)} samples"
        assert got["samples"] == len(dataset)


@pytest.mark.slow
def test_eval_one_vs_three_processes_and_predictions(trained_run, tmp_path):
    """`mlproject.eval` on one checkpoint: 1 process and ddp x 3 write the same metrics.json, and the
    predictions file holds each test sample once, in order, agreeing with test/acc. The global batch (64)
    does not divide by 3: evaluation rounds the per-device batch up (22) and masks the padded slots."""
    ckpt = f"ckpt_path={trained_run / 'checkpoints' / 'last.ckpt'}"
    common = [ckpt, "extras.print_config=false", "trainer=cpu"]
    together(
        lambda: run("eval", *common, "trainer.devices=1", log_dir=tmp_path / "one"),
        lambda: run("eval", *common, "strategy=ddp", "trainer.devices=3", "predict=true", log_dir=tmp_path / "three"),
    )
    (one,), (two,) = run_dirs(tmp_path / "one", "eval"), run_dirs(tmp_path / "three", "eval")
    m1, m2 = read_metrics(one), read_metrics(two)
    # acc, f1, auroc and samples are bitwise equal; the loss sums floats in another order (float64
    # accumulation keeps the difference ~1e-9)
    assert {k: v for k, v in m1.items() if k != "test/loss"} == {k: v for k, v in m2.items() if k != "test/loss"}
    assert m1["test/loss"] == pytest.approx(m2["test/loss"], rel=1e-7)

    rows = list(csv.DictReader((two / "predictions.csv").open()))
    assert [int(r["id"]) for r in rows] == list(range(360))
    dm = DigitsDataModule()  # the default split that eval used
    dm.setup()
    assert [int(r["label"]) for r in rows] == [int(y) for _, y in dm.test_set]
    acc = sum(r["label"] == r["pred"] for r in rows) / len(rows)
    assert acc == pytest.approx(m2["test/acc"], abs=1e-6)


# feature: deepspeed
@pytest.mark.slow
def test_deepspeed_stage_3_counts_each_sample_once(tmp_path):
    """ZeRO-3 partitions the parameters, so every rank must join every forward pass (a rank that stops
    early hangs the others): the digits CNN on a 9-sample split over 2 processes finishes, and gives
    the direct single-process numbers."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the optional extra .[deepspeed]")
    from tests.distributed import sharded_eval_worker

    got, want = sharded_eval_worker.compare(tmp_path, "deepspeed_stage_3", ["data.val_size=9", "data.batch_size=4"])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert got["samples"] == 9


# /feature: deepspeed
