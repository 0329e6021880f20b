"""data=images: an image folder written by the test trains and evaluates exactly on 1 and 3 processes, a
run with dataloader workers and random augmentation resumes mid-epoch bitwise, and a resume on another
world size continues with the next global batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mlproject.core.errors import ConfigError
from mlproject.data.images import ImagesDataModule
from tests.checkpoint.helpers import assert_bitwise, kill_at, run_dir, train, weights
from tests.data.resume import assert_close_to, assert_resumed_in_place, record
from tests.helpers.processes import FAST, read_metrics, run, run_dirs, together


def write_folder(root: Path, classes: int = 3, per_class: int = 20) -> Path:
    """RGB PNGs of 12x12 pixels, each class a colour plus noise, in <root>/<class>/<n>.png."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for n in range(per_class):
            pixels = rng.integers(0, 90, (12, 12, 3)) + np.eye(3, dtype=int)[c] * 160
            Image.fromarray(pixels.astype(np.uint8), mode="RGB").save(root / f"class_{c}" / f"{n}.png")
    return root


def test_images_decode_to_the_configured_size_and_augment_only_training(tmp_path):
    dm = ImagesDataModule(dir=str(write_folder(tmp_path / "img")), channels=3, image_size=8, crop_padding=2)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (42, 6, 12)
    x, y = dm.val_set[0]
    assert x.shape == (3, 8, 8) and x.min() >= 0 and x.max() <= 1 and y in (0, 1, 2)
    assert torch.equal(dm.val_set[0][0], x)  # evaluation is never augmented
    torch.manual_seed(0)
    crops = {dm.train_set[0][0].sum().item() for _ in range(10)}
    assert len(crops) > 1  # training samples are


def test_own_folder_with_the_digits_source_names_data_source_null(tmp_path):
    """`data=images data.dir=<my folder>` keeps the default source=digits: the fix the user needs is source=null."""
    dm = ImagesDataModule(dir=str(write_folder(tmp_path / "img")), source="digits")
    with pytest.raises(ConfigError, match=r"holds images of your own: add data\.source=null to train on them"):
        dm.prepare_data()


@pytest.mark.slow
def test_image_folder_trains_on_3_processes_and_evaluates_exactly_on_1_and_3(tmp_path):
    """3 processes train one epoch (its test stage runs on 3 processes with the epoch's checkpoint); the
    same checkpoint evaluated on 1 process gives the same metrics. The 13 test images do not divide by 3:
    padded slots are masked by their index."""
    folder = write_folder(tmp_path / "img")
    data = ["data=images", f"data.dir={folder}", "data.source=null", "data.channels=3", "data.test_fraction=0.22"]
    setup = [*FAST, "trainer.max_epochs=1", *data, "model.num_classes=3", "data.batch_size=12"]
    run("train", *setup, "strategy=ddp", "trainer.devices=3", log_dir=tmp_path / "three")
    (three,) = run_dirs(tmp_path / "three")
    run("eval", f"ckpt_path={three / 'checkpoints' / 'last.ckpt'}", *FAST, log_dir=tmp_path / "one")
    (one,) = run_dirs(tmp_path / "one", "eval")
    m3 = {k: v for k, v in read_metrics(three).items() if k.startswith("test/")}
    m1 = read_metrics(one)
    assert m3["test/samples"] == 13
    assert {k: v for k, v in m1.items() if k != "test/loss"} == {k: v for k, v in m3.items() if k != "test/loss"}
    assert m1["test/loss"] == pytest.approx(m3["test/loss"], rel=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_workers_resume_mid_epoch_bitwise_with_augmentation(tmp_path):
    """The digits as PNGs (written once by the first run's preparation), random crops on, seed_batches=true: 2
    epochs with 2 workers equal 2 epochs with none, bitwise (augmentation does not depend on who loads a sample), and a
    run with 2 workers killed 5 steps into epoch 2 and resumed from its step-21 checkpoint ends bitwise
    equal too. 19 optimizer steps per epoch."""
    setup = [
        *FAST,
        "test=false",
        "data=images",
        f"data.dir={tmp_path}/png",
        "data.crop_padding=1",
        "seed_batches=true",
        "callbacks.last_checkpoint.every_n_train_steps=7",
    ]
    logs = tmp_path / "logs"

    def train(run_id: str, *overrides: str, check: bool = True):
        return run("train", *setup, f"run_id={run_id}", "ckpt_path=auto", *overrides, log_dir=logs, check=check)

    def killed_and_resumed():
        assert train("killed", "data.num_workers=2", *kill_at(24), check=False).returncode != 0
        train("killed", "data.num_workers=2")

    train("workers", "data.num_workers=2")  # alone: it writes the PNGs the others read
    together(lambda: train("main", "data.num_workers=0"), killed_and_resumed)
    straight = weights(run_dir(logs, "workers") / "checkpoints" / "last.ckpt")
    assert_bitwise(straight, weights(run_dir(logs, "main") / "checkpoints" / "last.ckpt"))
    assert_bitwise(straight, weights(run_dir(logs, "killed") / "checkpoints" / "last.ckpt"))


@pytest.mark.slow
def test_resume_from_1_process_on_2_reads_the_next_global_batch(tmp_path):
    """42 training images, 5 steps of 8 per epoch, no random crops: a run on 1 process killed at step 8 (its
    last checkpoint: step 6, one step into epoch 2; steps 6 and 7 are lost) resumes with ckpt_path=auto on 2
    processes. From step 6 on they read the straight run's batches, so each epoch's images are read once over
    the two halves, and the final parameters are the straight run's up to reduction order (CLOSE): no
    dropout, BatchNorm synced over the global batch, no augmentation (drawn per batch of a rank, so it is exact
    on resume on the same world size, test_workers_resume_mid_epoch_bitwise_with_augmentation, not across)."""
    folder = write_folder(tmp_path / "img")
    setup = [
        "trainer.max_epochs=2",
        "data=images",
        f"data.dir={folder}",
        "data.source=null",
        "data.channels=3",
        "data.crop_padding=0",
        "data.batch_size=8",
        "model.num_classes=3",
        "model.net.dropout=0.0",
        "model.scheduler.warmup_steps=2",
        "trainer.sync_batchnorm=true",
        "callbacks.last_checkpoint.every_n_train_steps=3",
    ]
    logs = {name: tmp_path / name for name in ("straight", "killed")}

    def killed_then_resumed():
        one = [*setup, "ckpt_path=auto", *record(tmp_path / "before"), *kill_at(8)]
        assert train(logs["killed"], "killed", *one, check=False).returncode != 0
        two = [*setup, "strategy=ddp", "trainer.devices=2", "ckpt_path=auto", *record(tmp_path / "after")]
        train(logs["killed"], "killed", *two)

    together(lambda: train(logs["straight"], "straight", *setup, *record(tmp_path / "seen")), killed_then_resumed)
    assert_resumed_in_place(tmp_path / "seen", tmp_path / "before", tmp_path / "after", at=(1, 6), batch=8)
    straight, resumed = (weights(run_dir(logs[r], r) / "checkpoints" / "last.ckpt") for r in ("straight", "killed"))
    print(f"max |param - straight run's| after resuming 1 -> 2 processes: {assert_close_to(straight, resumed):.1e}")
