"""DeepSpeed ZeRO checkpoints (a directory per checkpoint, every rank writes): atomic, kept by retention,
resumable under DeepSpeed, and exported / evaluated anywhere."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint.helpers import assert_export_matches, kill_at, run_dir, strategy, train

pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra (pip install -e '.[deepspeed]')")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_deepspeed_checkpoint_resumes_and_exports(tmp_path):
    setup = [*strategy("deepspeed_stage_2", 2), "trainer.max_epochs=2", "+trainer.limit_train_batches=6"]
    proc = train(tmp_path, "ds", *setup, "ckpt_path=auto", *kill_at(6), check=False)  # after epoch 1's save
    assert proc.returncode != 0
    checkpoints = run_dir(tmp_path, "ds") / "checkpoints"
    assert (checkpoints / "last.ckpt" / "latest").is_file()
    train(tmp_path, "ds", *setup, "ckpt_path=auto")
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
