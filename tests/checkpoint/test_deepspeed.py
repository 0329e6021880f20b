"""DeepSpeed ZeRO checkpoints (a directory per checkpoint, every rank writes): atomic, kept by retention,
resumable under DeepSpeed and, converted on load, under any strategy and back; exported / evaluated anywhere."""

from __future__ import annotations

import shutil

import pytest
import torch

from mlproject.checkpoint.convert import load_full
from tests.checkpoint.helpers import (
    assert_export_matches,
    assert_same_optimizer,
    kill_at,
    max_diff,
    run_dir,
    strategy,
    train,
)
from tests.helpers.processes import together

pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra (pip install -e '.[deepspeed]')")

# 2 ranks train like one process: BatchNorm sees the global batch, no dropout (tests/distributed)
EXACT = [
    "trainer.sync_batchnorm=true",
    "model.net.dropout=0.0",
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=6",
]
CLOSE = 1e-5  # fp32 after 12 AdamW steps; measured ~2e-7 (a resume with fresh Adam moments: 0.1)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_deepspeed_checkpoint_resumes_anywhere_and_back_and_exports(tmp_path):
    setup = [*strategy("deepspeed_stage_2", 2), *EXACT]
    proc = train(tmp_path, "ds", *setup, "ckpt_path=auto", *kill_at(6), check=False)  # after epoch 1's save
    assert proc.returncode != 0
    checkpoints = run_dir(tmp_path, "ds") / "checkpoints"
    assert (checkpoints / "last.ckpt" / "latest").is_file()
    epoch1 = tmp_path / "epoch1.ckpt"
    shutil.copytree(checkpoints / "last.ckpt", epoch1)  # 2 ZeRO-2 shards after 6 steps

    def single_then_zero3():
        # ZeRO-2 on 2 processes -> one plain process (converted on load), a checkpoint every 3 steps, killed at
        # step 9 -> ZeRO-3 on 2 processes from that file, mid-epoch (scattered into its partitions on load)
        one = [*strategy("single"), *EXACT, "callbacks.last_checkpoint.every_n_train_steps=3"]
        proc = train(tmp_path, "single", *one, f"ckpt_path={epoch1}", *kill_at(9), check=False)
        assert proc.returncode != 0
        single = run_dir(tmp_path, "single") / "checkpoints" / "last.ckpt"
        assert load_full(single)["global_step"] == 9
        train(tmp_path, "zero3", *strategy("deepspeed_stage_3", 2), *EXACT, f"ckpt_path={single}")

    together(lambda: train(tmp_path, "ds", *setup, "ckpt_path=auto"), single_then_zero3)
    # last + the best one, as directories; no temporary leftovers
    names = sorted(p.name for p in checkpoints.iterdir())
    assert len(names) == 2 and names[0].startswith("epoch_") and names[1] == "last.ckpt", names
    assert (
        torch.load(checkpoints / "last.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=False)[
            "global_step"
        ]
        == 12
    )
    assert_export_matches(checkpoints / "last.ckpt", tmp_path / "model.pt", torch.rand(8, 1, 8, 8))

    ds, zero3 = (
        load_full(checkpoints / "last.ckpt"),
        load_full(run_dir(tmp_path, "zero3") / "checkpoints" / "last.ckpt"),
    )
    diff = max_diff(ds["state_dict"], zero3["state_dict"])
    print("max |param - DeepSpeed run's| after ZeRO-2 -> single -> ZeRO-3:", diff)
    assert diff < CLOSE
    assert_same_optimizer(zero3["optimizer_states"][0], ds["optimizer_states"][0])
    assert zero3["lr_schedulers"] == ds["lr_schedulers"]
