"""Resuming on another world size and layout, each rank reads only what it will hold.

A sharded checkpoint: torch.distributed.checkpoint reshards by the global offsets of each rank's DTensor
shards (Lightning's ModelParallelStrategy loads a checkpoint directory that way). A full file (single, ddp):
memory-mapped, each rank copies its own shard out of it (distributed/parallel.ModelParallel.load_checkpoint),
but torch's optimizer loader gathers the present optimizer state in full on rank 0 once. A DeepSpeed
directory of another ZeRO layout: memory-mapped, each rank copies the slices of its partitions out of the
other layout's (checkpoint/zero_shards.py).

Measured as each rank's peak host memory when training starts (after the restore, before the first step),
against a fresh run of the same layout: a resumed rank holds in addition its share of the optimizer state
(a fresh AdamW has none before its first step) plus a constant for the loader's buffers; rank 0 of a resume
from a full file also the full model state once. Reading the whole checkpoint would cost every rank 230 MB.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.processes import run, run_dirs, together

# ~19M parameters: 230 MB of fp32 weights and AdamW moments, 58 MB per rank of 4
GPT = [
    "model=gpt",
    "data=text",
    "trainer.accelerator=cpu",
    "extras.print_config=false",
    "callbacks=none",
    "~logger",
    "test=false",
    "model.net.n_layer=6",
    "model.net.n_head=8",
    "model.net.n_embd=512",
    "data.block_size=32",
    "data.batch_size=8",
    "+trainer.limit_val_batches=0",
    "trainer.max_epochs=2",  # a checkpoint saved at the end of fit counts its epoch as finished
]
HSDP = ["strategy=hsdp", "trainer.devices=4", "strategy.replicate_size=2"]  # writes 2 shards (2 replicas)
FSDP = ["strategy=fsdp", "trainer.devices=4"]  # reads 4
CONSTANT = 64 * 2**20  # the loader's buffers, the checkpoint's metadata, allocator noise between processes


def peaks(path) -> list[int]:
    return [json.loads((path / f"rank{r}.json").read_text()) for r in range(4)]


def train(log_dir, *overrides: str) -> None:
    run("train", *GPT, *overrides, log_dir=log_dir, timeout=600)


def saved(log_dir, *overrides: str):
    steps = ["+callbacks.steps._target_=tests.helpers.callbacks.RecordSteps", "+callbacks.steps.checkpoint=true"]
    train(log_dir, *overrides, "+trainer.max_steps=1", *steps)
    (run_dir,) = run_dirs(log_dir)
    return run_dir / "last.ckpt"


def peak_memory(tmp_path, name: str, *overrides: str, layout: list[str] = FSDP) -> list[int]:
    """Peak host memory per rank of `layout` on 4 when training starts (a run of 2 steps under tmp_path/name)."""
    memory = ["+callbacks.memory._target_=tests.helpers.callbacks.HostMemory", "+trainer.max_steps=2"]
    train(tmp_path / name, *layout, *memory, f"+callbacks.memory.path={tmp_path / f'peaks_{name}'}", *overrides)
    return peaks(tmp_path / f"peaks_{name}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_each_rank_reads_only_its_share_when_resharding(tmp_path):
    from mlproject.models.components.gpt import GPT as Net

    params = sum(p.numel() for p in Net(256, 32, n_layer=6, n_head=8, n_embd=512).parameters())
    share, full = 2 * 4 * params // 4, 3 * 4 * params  # AdamW's moments of a quarter; weights and moments
    # the fresh run and the two saving runs start together, then the two resumed runs
    fresh, sharded, single = together(
        lambda: peak_memory(tmp_path, "fresh"),
        lambda: saved(tmp_path / "hsdp", *HSDP),
        lambda: saved(tmp_path / "single", "strategy=single"),
    )
    assert (sharded / ".metadata").is_file()  # a directory of shards
    resumed_sharded, resumed_single = together(
        lambda: peak_memory(tmp_path, "resumed_hsdp", f"ckpt_path={sharded}"),
        lambda: peak_memory(tmp_path, "resumed_single", f"ckpt_path={single}"),
    )
    extra_sharded = [r - f for r, f in zip(resumed_sharded, fresh, strict=True)]  # over the fresh run's
    extra_single = [r - f for r, f in zip(resumed_single, fresh, strict=True)]

    print("extra peak host memory per rank, resumed from shards (MB):", [e / 1e6 for e in extra_sharded], share / 1e6)
    assert all(e < share + CONSTANT for e in extra_sharded), extra_sharded

    print("extra peak host memory per rank, resumed from a full file (MB):", [e / 1e6 for e in extra_single])
    assert all(e < share + CONSTANT for e in extra_single[1:]), extra_single
    assert extra_single[0] < full + share + CONSTANT, extra_single


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_deepspeed_ranks_read_only_their_share_of_another_zero_layout(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra (pip install -e '.[deepspeed]')")
    from mlproject.models.components.gpt import GPT as Net

    params = sum(p.numel() for p in Net(256, 32, n_layer=6, n_head=8, n_embd=512).parameters())
    share = 2 * 4 * params // 4  # AdamW's moments of a quarter; the whole checkpoint is 3 * 4 * params
    zero3 = ["strategy=deepspeed_stage_3", "trainer.devices=4"]
    fresh, saved_zero2 = together(
        lambda: peak_memory(tmp_path, "fresh", layout=zero3),
        lambda: saved(tmp_path / "zero2", "strategy=deepspeed_stage_2", "trainer.devices=2"),
    )
    assert (saved_zero2 / "latest").is_file()  # a DeepSpeed directory of 2 ZeRO-2 partitions
    resumed = peak_memory(tmp_path, "resumed", f"ckpt_path={saved_zero2}", layout=zero3)
    extra = [r - f for r, f in zip(resumed, fresh, strict=True)]
    print("extra peak host memory per rank, ZeRO-2 on 2 -> ZeRO-3 on 4 (MB):", [e / 1e6 for e in extra], share / 1e6)
    assert all(e < share + CONSTANT for e in extra), extra
