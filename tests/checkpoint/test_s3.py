"""Checkpoints in object storage: a real S3 HTTP endpoint (moto's standalone server on 127.0.0.1, started by
conftest.py; the GPT's fsdp proof is in test_s3_gpt.py), the real s3fs client, the endpoint given the
standard way (AWS_ENDPOINT_URL) and credentials only from the environment. A run saving into s3://,
SIGKILLed, resumes with ckpt_path=auto bitwise; a resumed run's retention leaves the checkpoint it resumed
from (Lightning issue 21813)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mlproject.checkpoint.convert import export, load_full
from tests.checkpoint.conftest import BUCKET, ckpt_dir, net_weights
from tests.checkpoint.helpers import assert_bitwise, kill_at, run_dir, strategy, train, weights
from tests.helpers.processes import together


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_s3_checkpoints_resume_bitwise_under_single_and_ddp(s3, tmp_path):
    every_7 = ["callbacks.last_checkpoint.every_n_train_steps=7"]
    single, ddp = strategy("single"), strategy("ddp", 2)

    def killed(setup, name, rank):
        # killed at step 47: the last checkpoint (step 42) lives only in the bucket
        proc = train(
            tmp_path, name, *setup, *every_7, *ckpt_dir(name), "ckpt_path=auto", *kill_at(47, rank), check=False
        )
        assert proc.returncode != 0
        assert load_full(f"s3://{BUCKET}/{name}/last.ckpt")["global_step"] == 42
        train(tmp_path, name, *setup, *every_7, *ckpt_dir(name), "ckpt_path=auto")

    together(
        lambda: train(tmp_path, "straight", *single),
        lambda: train(tmp_path, "straight_ddp", *ddp),
        lambda: killed(single, "single", None),
        lambda: killed(ddp, "ddp", 0),
    )
    for straight, name in (("straight", "single"), ("straight_ddp", "ddp")):
        want = weights(run_dir(tmp_path, straight) / "checkpoints" / "last.ckpt")
        assert_bitwise(want, load_full(f"s3://{BUCKET}/{name}/last.ckpt")["state_dict"])
        assert not s3.exists(f"{BUCKET}/{name}/last.ckpt.tmp")
    # export reads the bucket too
    export(f"s3://{BUCKET}/single/last.ckpt", tmp_path / "model.safetensors")
    straight = weights(run_dir(tmp_path, "straight") / "checkpoints" / "last.ckpt")
    assert_bitwise(load_file(tmp_path / "model.safetensors"), net_weights(straight))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_s3_retention_keeps_the_checkpoint_a_run_resumed_from(s3, tmp_path):
    """Keep only the newest checkpoint (monitor=null, save_top_k=1). A run resumed from epoch 0's checkpoint
    writes epoch 1's and 2's, each removing the one before, but never its source (Lightning removes it in
    object storage: issue 21813)."""
    single = strategy("single")
    keep_one = ["callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=1"]
    train(tmp_path, "source", *single, *keep_one, *ckpt_dir("ret"), "trainer.max_epochs=1")
    source = f"s3://{BUCKET}/ret/epoch_000.ckpt"
    assert s3.exists(source)
    train(tmp_path, "resumed", *single, *keep_one, *ckpt_dir("ret"), f"ckpt_path={source}")
    assert s3.exists(source), "retention deleted the checkpoint the run resumed from"
    names = sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{BUCKET}/ret"))
    assert names == ["epoch_000.ckpt", "epoch_002.ckpt", "last.ckpt"], names


# feature: deepspeed
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_s3_deepspeed_checkpoints_resume_bitwise(s3, tmp_path):
    """ZeRO-2 on 2 processes writes its folders into the bucket (DeepSpeed's own file I/O, through a copy on
    the node's disk) until it is SIGKILLed at step 10, and resumes from step 8's with ckpt_path=auto bitwise.
    Retention removes a replaced checkpoint's whole folder; export reads the bucket's folder."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra (pip install -e '.[deepspeed]')")
    from mlproject.distributed.zero import staging
    from tests.checkpoint.test_deepspeed import EXACT

    setup = [*strategy("deepspeed_stage_2", 2), *EXACT, "callbacks.last_checkpoint.every_n_train_steps=4"]
    keep_one = ["callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=1"]

    def killed():
        proc = train(tmp_path, "ds", *setup, *keep_one, *ckpt_dir("ds"), "ckpt_path=auto", *kill_at(10), check=False)
        assert proc.returncode != 0
        assert load_full(f"s3://{BUCKET}/ds/last.ckpt")["global_step"] == 8
        train(tmp_path, "ds", *setup, *keep_one, *ckpt_dir("ds"), "ckpt_path=auto")

    together(lambda: train(tmp_path, "straight", *setup), killed)
    straight = run_dir(tmp_path, "straight") / "checkpoints" / "last.ckpt"
    want = weights(straight)
    got = load_full(f"s3://{BUCKET}/ds/last.ckpt")
    assert got["global_step"] == 12
    assert_bitwise(want, got["state_dict"])
    assert not (run_dir(tmp_path, "ds") / "checkpoints").exists()  # nothing went to a local folder
    assert not staging(f"s3://{BUCKET}/ds/last.ckpt.tmp").exists()  # the node's copies are gone
    export(f"s3://{BUCKET}/ds/last.ckpt", tmp_path / "ds.safetensors")
    assert_bitwise(load_file(tmp_path / "ds.safetensors"), net_weights(want))
    names = sorted(p.rsplit("/", 1)[1] for p in s3.ls(f"{BUCKET}/ds"))
    assert names == ["epoch_001.ckpt", "last.ckpt"], names
    local = sorted(str(p.relative_to(straight)) for p in straight.rglob("*") if p.is_file())
    assert sorted(p.split("/last.ckpt/", 1)[1] for p in s3.find(f"{BUCKET}/ds/last.ckpt")) == local


# /feature: deepspeed
def test_sharded_folders_in_a_bucket_are_replaced_and_resumed_whole(s3, tmp_path):
    """A DCP folder in object storage is complete while it holds .metadata: replace_checkpoint (object_storage.replace)
    copies it last and removes the old folder's first, so a crash in between leaves the complete .tmp, which auto
    resumes."""
    from mlproject.checkpoint.object_storage import remove_remote
    from mlproject.checkpoint.resume import resolve_ckpt_path
    from mlproject.checkpoint.storage import replace_checkpoint

    root = f"s3://{BUCKET}/unit"
    last, tmp = f"{root}/last.ckpt", f"{root}/last.ckpt.tmp"

    def write(url: str, step: int, complete: bool = True) -> None:
        s3.pipe(f"{url}/__0_0.distcp", b"shard")
        with s3.open(f"{url}/meta.pt", "wb") as f:
            torch.save({"global_step": step}, f)
        if complete:
            s3.pipe(f"{url}/.metadata", b"metadata")

    def step(url: str) -> int:
        with s3.open(f"{url}/meta.pt", "rb") as f:
            return torch.load(f)["global_step"]

    write(tmp, 1, complete=False)  # a first save killed while writing: start fresh
    assert resolve_ckpt_path("auto", tmp_path, root) is None
    write(tmp, 1)
    replace_checkpoint(tmp, last)
    write(tmp, 2)
    replace_checkpoint(tmp, last)  # over an existing folder: replaced, not nested inside it
    assert sorted(p.rsplit("/", 1)[1] for p in s3.ls(last)) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert not s3.exists(tmp) and step(last) == 2
    assert resolve_ckpt_path("auto", tmp_path, root) == last
    write(tmp, 3)
    s3.rm(f"{last}/.metadata")  # killed inside replace_checkpoint, after the old folder lost its .metadata
    assert resolve_ckpt_path("auto", tmp_path, root) == tmp
    remove_remote(last)
    remove_remote(tmp)
    assert not s3.find(root)
