"""Sharded (fsdp) checkpoints of the test GPT in object storage (tests/checkpoint/conftest.py's S3 server):
written through DCP's fsspec writer, resumed, exported and evaluated from the bucket."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from mlproject.checkpoint.convert import export, load_full
from tests.checkpoint.conftest import BUCKET, ckpt_dir, net_weights
from tests.checkpoint.helpers import assert_bitwise, kill_at, run_dir, train, weights
from tests.helpers.processes import read_metrics, run, run_dirs, together


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_s3_sharded_checkpoints_resume_bitwise_under_fsdp(s3, tmp_path):
    """fsdp on 2 processes writes its DCP folders into the bucket (through DCP's fsspec writer) until rank 0 is
    SIGKILLed at step 10, and resumes with ckpt_path=auto bitwise from its last complete save (step 8's, or step
    4's when step 8's asynchronous write was still in flight at the kill). Retention
    removes each replaced best checkpoint's whole folder."""
    from tests.checkpoint.test_sharded import FSDP2

    setup = [*FSDP2, "callbacks.last_checkpoint.every_n_train_steps=4", *ckpt_dir("fsdp")]
    keep_one = ["callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=1"]

    def killed():
        proc = train(tmp_path, "fsdp", *setup, *keep_one, "ckpt_path=auto", *kill_at(10, 0), check=False)
        assert proc.returncode != 0
        # fsdp saves asynchronously by default: step 8's write may still be in flight at the kill (under load)
        step = load_full(f"s3://{BUCKET}/fsdp/last.ckpt")["global_step"]
        assert step in (4, 8)
        async_save = "callbacks.model_checkpoint.async_save=true"
        train(tmp_path, "fsdp", *setup, *keep_one, async_save, "ckpt_path=auto")
        return step

    _, resumed_from = together(lambda: train(tmp_path, "straight", *FSDP2), killed)
    want = weights(run_dir(tmp_path, "straight") / "checkpoints" / "last.ckpt")
    got = load_full(f"s3://{BUCKET}/fsdp/last.ckpt")
    assert got["global_step"] == 18
    assert not (run_dir(tmp_path, "fsdp") / "checkpoints").exists()  # nothing went to a local folder
    export(f"s3://{BUCKET}/fsdp/last.ckpt", tmp_path / "fsdp.safetensors")  # export reads a bucket's folder too
    assert_bitwise(load_file(tmp_path / "fsdp.safetensors"), net_weights(want))
    # eval too, with the model and data of the run that wrote it (its saved config): the straight run's metrics
    evaluate = ["trainer=cpu", "extras.print_config=false"]
    local = run_dir(tmp_path, "straight") / "checkpoints" / "last.ckpt"
    together(
        lambda: run("eval", *evaluate, f"ckpt_path=s3://{BUCKET}/fsdp/last.ckpt", log_dir=tmp_path / "bucket"),
        lambda: run("eval", *evaluate, f"ckpt_path={local}", log_dir=tmp_path / "local"),
    )
    tested = {where: read_metrics(run_dirs(tmp_path / where, "eval")[0]) for where in ("bucket", "local")}
    assert tested["bucket"] == tested["local"] and any(k.startswith("test/") for k in tested["bucket"])
    assert_bitwise(want, got["state_dict"])
    # epoch 0's best checkpoint (the killed run's) and epoch 1's were replaced: no object of their folders is
    # left, nor of a .tmp. Resumed from step 4, before epoch 0 ended, the run saves epoch 0 again as
    # epoch_000-v1.ckpt (Lightning never overwrites), which retention replaces; the killed run's epoch_000 is
    # not this run's to remove (if its write completed before the kill), as on a local disk.
    names = sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{BUCKET}/fsdp"))
    if resumed_from == 4:
        names = [name for name in names if name != "epoch_000.ckpt"]
    assert names == ["epoch_002.ckpt", "last.ckpt"], names
    assert sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{BUCKET}/fsdp/last.ckpt")) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]
