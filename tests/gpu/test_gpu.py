"""GPU acceptance suite: every strategy, both examples, bf16, on every visible GPU (`make test-gpu`).

Skipped where no CUDA GPU is visible. On one GPU the multi-process strategies run with one process each
(NCCL between devices needs 2+ GPUs: run `make test-gpu` on such a machine), and pipeline parallelism, which
needs a process per stage, runs only on an even number of GPUs. Budget: < 8 minutes on one
H200; the strategy runs start 4 at a time, each a few steps of a small model.
"""

from __future__ import annotations

import csv
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.checkpoint.helpers import strategy
from tests.checkpoint.test_resume import straight_vs_interrupted
from tests.distributed.conftest import EXACT
from tests.distributed.test_model_parallel import TINY
from tests.helpers.gpu import requires_gpu
from tests.helpers.processes import read_metrics, run, run_dirs

pytestmark = [*requires_gpu, pytest.mark.slow]

GPUS = max(torch.cuda.device_count(), 1)
HEADS = math.lcm(4, GPUS)  # tp splits the heads over every GPU
# 20 steps of the digits CNN with SyncBN and 6 of the tiny GPT (a record per step), global batches that
# divide over every GPU
DIGITS = [*(o for o in EXACT if o != "trainer=cpu"), f"data.batch_size={math.lcm(64, GPUS)}"]
REPLACED = ("trainer.accelerator", "model.net.n_head", "model.net.n_embd", "data.batch_size")
GPT = [o for o in TINY if not o.startswith(REPLACED)]
GPT += [f"model.net.n_head={HEADS}", f"model.net.n_embd={8 * HEADS}", f"data.batch_size={math.lcm(8, GPUS)}"]
RUNS = {  # (example, strategy); fsdp shards the digits CNN (no plan) whole (tests/distributed/test_fsdp_any_model.py)
    **{(example, s): [f"strategy={s}"] for example in ("digits", "gpt") for s in ["single", "ddp", "fsdp"]},
    # hsdp is fsdp's code with replicas
    ("gpt", "hsdp"): ["strategy=hsdp", f"strategy.replicate_size={2 if GPUS % 2 == 0 else 1}"],
    ("gpt_moe", "single"): ["model=gpt_moe", "strategy=single"],  # 4 experts, split over up to 4 GPUs
    # feature: tensor
    # tp splits the layers the GPT's plan names
    ("gpt", "tp"): ["strategy=tp", f"strategy.tensor_parallel_size={GPUS}"],
    # /feature: tensor
    # feature: expert
    ("gpt_moe", "fsdp_ep"): ["model=gpt_moe", "strategy=fsdp", f"strategy.expert_parallel_size={math.gcd(4, GPUS)}"],
    # /feature: expert
}
# feature: pipeline
if GPUS % 2 == 0:  # 2 stages of the tiny GPT's 2 blocks, FSDP over the rest; 1F1B on 2 micro-batches
    RUNS["gpt", "pp"] = ["strategy=pp", "strategy.pipeline_parallel_size=2", "strategy.pipeline.microbatches=2"]
# /feature: pipeline
# The CPU bound for autocast (tests/distributed/test_bf16.py: one bf16 rounding, 2**-9) x 4 for GPU kernels
# that may split sums differently per strategy
RTOL = {"autocast": 2**-7}


# feature: deepspeed
def deepspeed_installed() -> bool:  # the optional extra; the GPU machine gets it as a wheel
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


if deepspeed_installed():
    stages = [f"deepspeed_stage_{s}" for s in (1, 2, 3)] + ["deepspeed_stage_3_offload"]
    RUNS |= {(example, s): [f"strategy={s}"] for example in ("digits", "gpt") for s in stages}
# DeepSpeed's bf16 runs the whole model in bf16 (no autocast), like bf16-true on the CPU (2**-5)
RTOL["deepspeed"] = 2**-5


# /feature: deepspeed
def train_one(tmp_path_factory, example: str, name: str) -> dict:
    log_dir = tmp_path_factory.mktemp(f"{example}_{name}")
    devices = 1 if name == "single" else GPUS
    overrides = ["trainer=gpu", f"trainer.devices={devices}", "trainer.precision=bf16-mixed", *RUNS[example, name]]
    if example == "digits":
        bn = log_dir / "bn.json"
        overrides += ["+callbacks.bn._target_=tests.gpu.probe.BatchNormTypes", f"+callbacks.bn.path={bn}"]
        run("train", *DIGITS, *overrides, log_dir=log_dir, timeout=300)
        (run_dir,) = run_dirs(log_dir)
        return {**torch.load(run_dir / "steps.pt"), "bn": json.loads(bn.read_text())}
    record = log_dir / "record.pt"
    run("train", *GPT, *overrides, f"+callbacks.recorder.path={record}", log_dir=log_dir, timeout=300)
    (run_dir,) = run_dirs(log_dir)
    return {**torch.load(record), "metrics": read_metrics(run_dir)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    with ThreadPoolExecutor(4) as pool:
        futures = {key: pool.submit(train_one, tmp_path_factory, *key) for key in RUNS}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", [k for k in RUNS if k[1] != "single"], ids="-".join)
def test_strategy_trains_like_one_gpu(runs, key):
    got, ref = runs[key], runs[key[0], "single"]
    losses = torch.tensor(got["losses"])
    assert len(losses) == len(ref["losses"]) and all(math.isfinite(x) for x in got["losses"])
    assert losses[-1] < losses[0] - 0.3  # it learns
    rtol = RTOL.get(key[1].partition("_")[0], RTOL["autocast"])  # deepspeed_stage_*: "deepspeed"
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=rtol, atol=0)
    if key[0].startswith("gpt"):
        assert got["metrics"]["test/samples"] == ref["metrics"]["test/samples"]  # each sequence counted once


@pytest.mark.timeout(600)
def test_syncbn_under_ddp_and_fsdp_is_torchs(runs):
    assert runs["digits", "ddp"]["bn"] == runs["digits", "fsdp"]["bn"] == ["SyncBatchNorm"]
    assert runs["digits", "single"]["bn"] == ["BatchNorm2d"]  # one process: nothing to synchronise


@pytest.mark.timeout(600)
def test_digits_reaches_95_percent_and_eval_is_exact(tmp_path):
    """`make train trainer=gpu` as shipped (15 epochs, bf16-mixed); eval and predict=true on the GPU count
    every test sample once, and their accuracy is the predictions' accuracy."""
    run("train", "trainer=gpu", "extras.print_config=false", log_dir=tmp_path, timeout=300)
    (run_dir,) = run_dirs(tmp_path)
    trained = read_metrics(run_dir)
    assert trained["test/acc"] >= 0.95 and trained["test/samples"] == 360
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    run("eval", f"ckpt_path={ckpt}", "trainer=gpu", "predict=true", "extras.print_config=false", log_dir=tmp_path)
    (eval_dir,) = run_dirs(tmp_path, "eval")
    metrics = read_metrics(eval_dir)
    rows = list(csv.DictReader((eval_dir / "predictions.csv").open()))
    assert metrics["test/samples"] == 360 and [int(r["id"]) for r in rows] == list(range(360))
    assert sum(r["label"] == r["pred"] for r in rows) / 360 == pytest.approx(metrics["test/acc"], abs=1e-6)


@pytest.mark.timeout(900)
def test_resume_on_the_gpu_is_bitwise_and_exports(tmp_path):
    """Killed and resumed (after an epoch, and mid-epoch) equals a straight run bitwise: weights, optimizer,
    loops and RNGs, CUDA's included (dropout draws on the GPU); the checkpoint then exports. Not with
    trainer.deterministic=true: AdaptiveAvgPool2d's CUDA backward has no deterministic version and would
    raise. cudnn.benchmark stays off, so both runs pick the same kernels; if the runs differ, a
    non-deterministic cuDNN kernel is the first suspect."""
    setup = [*strategy("single"), "trainer=gpu", "trainer.precision=bf16-mixed"]
    straight_vs_interrupted(tmp_path, setup, kill_rank=None, mid_kill_rank=None)
