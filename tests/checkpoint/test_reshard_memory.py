"""Resuming on another world size and strategy, each rank reads only what it will hold.

Under fsdp (hsdp, tp, pp): a sharded checkpoint is resharded by torch.distributed.checkpoint by the global
offsets of each rank's DTensor shards (Lightning's ModelParallelStrategy loads a checkpoint directory that
way); from a full file (single, ddp), each rank reads the blocks of its shards by element range
(checkpoint/safe_load.read_into) and loads them as sharded state dicts
(distributed/parallel.ModelParallel.load_checkpoint).

Measured as each rank's peak host memory when training starts (after the restore, before the first step),
against a fresh run of the same layout: a resumed rank holds in addition its share of the optimizer state
(a fresh AdamW has none before its first step) plus a constant for the loader's buffers. Reading the whole
checkpoint would cost every rank 230 MB. Each resumed run also saves the state it restored, which must be
the checkpoint's, bitwise.
"""

from __future__ import annotations

import json
from functools import partial

import pytest

from mlproject.checkpoint.convert import load_full
from tests.checkpoint.helpers import assert_bitwise, assert_same_optimizer
from tests.helpers.processes import run, run_dirs, together

# ~19M parameters: 230 MB of fp32 weights and AdamW moments, 58 MB per rank of 4
GPT = [
    "model=gpt",
    "data=text",
    "trainer.accelerator=cpu",
    "extras.print_config=false",
    "callbacks=none",
    "trainer.enable_checkpointing=false",  # the checkpoints read here are the callbacks' (tests/helpers/callbacks.py)
    "~logger",
    "test=false",
    "model.net.n_layer=6",
    "model.net.n_head=8",
    "model.net.n_embd=512",
    "data.block_size=32",
    "data.batch_size=8",
    "trainer.limit_val_batches=0",
    "trainer.max_epochs=2",  # a checkpoint saved at the end of fit counts its epoch as finished
]
HSDP = ["strategy=hsdp", "trainer.devices=4", "strategy.replicate_size=2"]  # writes 2 shards (2 replicas)
FSDP = ["strategy=fsdp", "trainer.devices=4"]  # reads 4
# feature: deepspeed
# A DeepSpeed directory is read by element range as a file is (checkpoint/zero_shards.py). Under deepspeed_*: each
# rank reads the slices of its ZeRO partitions out of another ZeRO layout, a file or fsdp shards (the stored
# chunks that overlap them, checkpoint/dcp_shards.py).
ZERO2 = ["strategy=deepspeed_stage_2", "trainer.devices=2"]  # writes 2 partitions
ZERO3 = ["strategy=deepspeed_stage_3", "trainer.devices=4"]  # reads 4
# /feature: deepspeed
CONSTANT = 64 * 2**20  # the loader's buffers, the checkpoint's metadata, allocator noise between processes


def peaks(path) -> list[int]:
    return [json.loads((path / f"rank{r}.json").read_text()) for r in range(4)]


def train(log_dir, *overrides: str) -> None:
    run("train", *GPT, *overrides, log_dir=log_dir, timeout=600)


def saved(log_dir, *overrides: str):
    steps = ["+callbacks.steps._target_=tests.helpers.callbacks.RecordSteps", "+callbacks.steps.checkpoint=true"]
    train(log_dir, *overrides, "trainer.max_steps=1", *steps)
    (run_dir,) = run_dirs(log_dir)
    return run_dir / "last.ckpt"


def peak_memory(tmp_path, name: str, *overrides: str, layout: list[str] = FSDP) -> list[int]:
    """Peak host memory per rank of `layout` on 4 when training starts (a run of 2 steps under tmp_path/name)."""
    memory = ["+callbacks.memory._target_=tests.helpers.callbacks.HostMemory", "trainer.max_steps=2"]
    train(tmp_path / name, *layout, *memory, f"+callbacks.memory.path={tmp_path / f'peaks_{name}'}", *overrides)
    return peaks(tmp_path / f"peaks_{name}")


# feature: deepspeed
def import_cost(module: str) -> int:
    """Resident bytes a process gains by importing `module` after torch and Lightning."""
    import resource
    import subprocess
    import sys

    from tests.helpers.processes import clean_env

    rss = "int(open('/proc/self/statm').read().split()[1])"
    code = f"import lightning, torch; a = {rss}; import {module}; print(({rss} - a) * {resource.getpagesize()})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=clean_env())
    return int(proc.stdout.split()[-1])


# /feature: deepspeed
def assert_restored(start, ckpt) -> None:
    """The state a run restored (saved when training started, in its own layout) is the checkpoint's."""
    got, want = load_full(start), load_full(ckpt)
    assert_bitwise(got["state_dict"], want["state_dict"])
    assert_same_optimizer(got["optimizer_states"][0], want["optimizer_states"][0], tol=0)
    assert got["lr_schedulers"] == want["lr_schedulers"] and got["global_step"] == want["global_step"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_each_rank_reads_only_its_share_when_resuming_across_strategies(tmp_path):
    # feature: deepspeed
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra (pip install -e '.[deepspeed]')")
    # /feature: deepspeed
    from mlproject.models.components.gpt import GPT as Net

    params = sum(p.numel() for p in Net(256, 32, n_layer=6, n_head=8, n_embd=512).parameters())
    share = 2 * 4 * params // 4  # AdamW's moments of a quarter; the whole checkpoint is 3 * 4 * params
    # the three saving runs and a fresh run start together, then the resumed runs of each layout (with its
    # fresh run): at most 12 processes at once
    fresh_fsdp, sharded, single, *zero2 = together(
        lambda: peak_memory(tmp_path, "fresh_fsdp"),
        lambda: saved(tmp_path / "hsdp", *HSDP),
        lambda: saved(tmp_path / "single", "strategy=single"),
        # feature: deepspeed
        lambda: saved(tmp_path / "zero2", *ZERO2),
        # /feature: deepspeed
    )
    assert (sharded / ".metadata").is_file()  # DCP shards
    cases = {  # run: checkpoint, layout
        "hsdp_to_fsdp": (sharded, FSDP),
        "single_to_fsdp": (single, FSDP),
    }
    fresh = {"fsdp": fresh_fsdp}
    # feature: deepspeed
    assert (zero2[0] / "latest").is_file()  # 2 ZeRO-2 partitions
    cases |= {"zero2_to_fsdp": (zero2[0], FSDP), "zero2_to_zero3": (zero2[0], ZERO3), "hsdp_to_zero3": (sharded, ZERO3)}
    # /feature: deepspeed

    def resume(name: str) -> list[int]:
        ckpt, layout = cases[name]
        return peak_memory(tmp_path, name, f"ckpt_path={ckpt}", "+callbacks.memory.checkpoint=true", layout=layout)

    to_fsdp = [name for name, (_, layout) in cases.items() if layout == FSDP]
    resumed = dict(zip(to_fsdp, together(*(partial(resume, name) for name in to_fsdp)), strict=True))
    # feature: deepspeed
    to_zero3 = [name for name in cases if name not in to_fsdp]
    fresh["zero3"], *zero3 = together(
        lambda: peak_memory(tmp_path, "fresh_zero3", layout=ZERO3), *(partial(resume, name) for name in to_zero3)
    )
    resumed |= dict(zip(to_zero3, zero3, strict=True))
    # /feature: deepspeed
    extra = {
        name: [r - f for r, f in zip(ranks, fresh[name.split("_to_")[1]], strict=True)]
        for name, ranks in resumed.items()
    }
    for name, ranks in extra.items():  # over the fresh run's
        print(f"extra peak host memory per rank, {name} (MB):", [e / 1e6 for e in ranks], "share", share / 1e6)
    bound = dict.fromkeys(cases, share + CONSTANT)
    # feature: deepspeed
    bound["zero2_to_fsdp"] += import_cost("deepspeed")  # its checkpoint's pickles import DeepSpeed, fsdp does not
    # /feature: deepspeed
    print("bound per rank (MB):", {name: b / 1e6 for name, b in bound.items()})
    assert all(e < bound[name] for name, ranks in extra.items() for e in ranks), extra
    for name, (ckpt, _) in cases.items():
        assert_restored(tmp_path / f"peaks_{name}" / "start.ckpt", ckpt)
