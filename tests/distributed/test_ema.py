"""EMA weights (callbacks=ema) under each layout of RUNS, against an EMA computed by hand from the weights of
every optimizer step; validation and test metrics from the EMA; eval and export of the EMA; a killed fsdp
run resumes bitwise, EMA included.

Real `python -m mlproject.train` runs of the tiny GPT, fp32, gloo processes, a global batch of 8.
"""

from __future__ import annotations

import csv
import subprocess

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import get_class, instantiate

from mlproject.checkpoint.convert import export, load_full, load_module, run_config
from mlproject.core.constants import PROJECT_ROOT
from mlproject.data.text import TextDataModule
from tests.checkpoint.helpers import assert_bitwise, kill_at, run_dir, wait_until_gone
from tests.helpers.processes import PYTHON, clean_env, read_metrics, run, run_dirs

DECAY = 0.75  # 1 - DECAY is exact in binary; after 6 steps the start still weighs 0.75**6 = 18%
STEPS = 6
DATA = ["data.block_size=32", "data.batch_size=8", "data.val_fraction=0.005", "data.test_fraction=0.005"]
GPT = [
    "model=gpt",
    "data=text",
    *DATA,
    "trainer.accelerator=cpu",
    "extras.print_config=false",
    "logger=csv",
    "model.net.n_layer=2",
    "model.net.n_head=4",
    "model.net.n_embd=32",
    "model.optimizer.lr=0.01",
    "model.scheduler.warmup_steps=2",
    "trainer.max_epochs=1",
    f"trainer.max_steps={STEPS}",
]
EMA = ["callbacks=ema", f"callbacks.ema.decay={DECAY}"]
RECORD = ["+callbacks.weights._target_=tests.helpers.callbacks.RecordWeights"]
# Validation half-way (optimizer step 3) and at the end; the single runs accumulate 2 micro-batches per step
SINGLE = ["strategy=single", "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=6"]
RUNS = {
    "plain": ["callbacks=none", *SINGLE],  # no EMA: the training the EMA runs must not change
    "single": [*EMA, *SINGLE],
    "ddp": [*EMA, "strategy=ddp", "trainer.devices=2", "trainer.val_check_interval=3"],
    "fsdp": [*EMA, "strategy=fsdp", "trainer.devices=2", "trainer.val_check_interval=3"],
    # feature: tensor
    # each rank averages its column/row halves; embeddings and norms whole on both
    "tp": [
        *EMA,
        "strategy=tp",
        "trainer.devices=2",
        "strategy.tensor_parallel_size=2",
        "trainer.val_check_interval=3",
    ],
    # /feature: tensor
}
WITH_EMA = [name for name in RUNS if name != "plain"]
SHARDED = [name for name in WITH_EMA if name not in ("single", "ddp")]  # a checkpoint folder of shards


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """name -> {weights (per optimizer step), metrics, ckpt}; the runs start together."""
    procs = {}
    for name, overrides in RUNS.items():
        log_dir = tmp_path_factory.mktemp(name)
        cmd = [PYTHON, "-m", "mlproject.train", f"paths.log_dir={log_dir}", *GPT, *RECORD, *overrides]
        cmd.append(f"+callbacks.weights.path={log_dir / 'weights.pt'}")
        env = clean_env(OMP_NUM_THREADS="1")
        popen = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs[name] = (popen, log_dir)
    out = {}
    for name, (popen, log_dir) in procs.items():
        output = popen.communicate(timeout=600)[0].decode()
        assert popen.returncode == 0, f"{name} exited {popen.returncode}\n{output[-4000:]}"
        (run_dir_,) = run_dirs(log_dir)
        (ckpt,) = run_dir_.rglob("*.ckpt")  # Lightning's default checkpoint (under the logger's folder), tested
        with open(run_dir_ / "csv" / "metrics.csv") as f:
            val = [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]
        metrics = {**read_metrics(run_dir_), "val/loss": val[-1]}  # the last validation's, at the last step
        out[name] = {"weights": torch.load(log_dir / "weights.pt"), "metrics": metrics, "ckpt": ckpt}
    return out


def hand_ema(weights: list[dict[str, torch.Tensor]], exact: bool) -> dict[str, torch.Tensor]:
    """The EMA of the recorded weights: from the first, `ema = DECAY * ema + (1 - DECAY) * w` per optimizer
    step; `exact`: in fp32 with torch's lerp (the same rounding as the callback), else in float64."""
    ema = {k: v.clone() if exact else v.double() for k, v in weights[0].items()}
    for w in weights[1:]:
        for k, v in w.items():
            if exact:
                ema[k].lerp_(v, 1 - DECAY)
            else:
                ema[k] = DECAY * ema[k] + (1 - DECAY) * v.double()
    return ema


def hand_losses(ema: dict[str, torch.Tensor], ckpt) -> dict[str, float]:
    """val/loss and test/loss of the bare network with the hand EMA: the mean cross-entropy of every token."""
    net = instantiate(run_config(load_full(ckpt))["model"]["net"])
    net.load_state_dict({k.removeprefix("net."): v for k, v in ema.items()})
    _, val, test = TextDataModule(block_size=32, val_fraction=0.005, test_fraction=0.005).splits()  # DATA's
    losses = {}
    for stage, chunks in (("val", val), ("test", test)):
        x, y = (torch.stack(t) for t in zip(*(chunks[i] for i in range(len(chunks))), strict=True))
        with torch.no_grad():
            losses[f"{stage}/loss"] = F.cross_entropy(net(x).flatten(0, 1).double(), y.flatten()).item()
    return losses


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test waits for all runs
@pytest.mark.parametrize("name", WITH_EMA)
def test_ema_is_the_hand_computed_average(runs, name):
    """The checkpoint's EMA is the average of the weights after each optimizer step (the single run
    accumulates 2 micro-batches per step: an update per micro-batch would differ), to the bit in fp32
    lerp and within fp32 rounding of the float64 formula; SHARDED layouts save it sharded like the parameters."""
    weights = runs[name]["weights"]
    assert len(weights) == STEPS + 1
    state = load_full(runs[name]["ckpt"])["state_dict"]
    ema = {k.removeprefix("ema."): v for k, v in state.items() if k.startswith("ema.")}
    assert ema.keys() == weights[0].keys()
    assert_bitwise(ema, hand_ema(weights, exact=True))
    for k, v in hand_ema(weights, exact=False).items():
        torch.testing.assert_close(ema[k].double(), v, rtol=0, atol=1e-6, msg=k)
    assert max((ema[k] - weights[-1][k]).abs().max() for k in ema) > 1e-2  # not the last weights
    assert_bitwise({k: state[k] for k in ema}, weights[-1])  # the raw weights are the trained ones
    if name in SHARDED:  # every rank wrote its half of each average (tp: q is split by columns)
        from torch.distributed.checkpoint import FileSystemReader

        chunks = FileSystemReader(runs[name]["ckpt"]).read_metadata().state_dict_metadata
        assert len(chunks["state_dict.ema.net.blocks.0.attn.q.weight"].chunks) == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ema_does_not_change_training(runs):
    """Validation swaps the EMA in and back: the single run trains bitwise as the one without EMA."""
    assert len(runs["plain"]["weights"]) == len(runs["single"]["weights"])
    for plain, single in zip(runs["plain"]["weights"], runs["single"]["weights"], strict=True):
        assert_bitwise(single, plain)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", WITH_EMA)
def test_validation_and_test_use_the_ema(runs, name):
    """val/loss (the last validation) and test/loss (the checkpoint, tested) are those of the hand EMA."""
    want = hand_losses(hand_ema(runs[name]["weights"], exact=True), runs[name]["ckpt"])
    raw = hand_losses(runs[name]["weights"][-1], runs[name]["ckpt"])
    for key, value in want.items():
        assert runs[name]["metrics"][key] == pytest.approx(value, rel=1e-5), key
        assert abs(raw[key] - value) > 1e-3  # the raw weights would score otherwise


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["single", *SHARDED])
def test_eval_and_export_take_the_ema(runs, name, tmp_path):
    """export writes the EMA weights (ema=false: the raw ones), and eval's load_module loads them, from a
    file (single) or a sharded directory (fsdp)."""
    ckpt = runs[name]["ckpt"]
    state = load_full(ckpt)["state_dict"]
    net = {k.removeprefix("ema.net."): v for k, v in state.items() if k.startswith("ema.net.")}
    export(ckpt, tmp_path / "ema.pt")
    export(ckpt, tmp_path / "raw.pt", ema=False)
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)["state_dict"]
    raw = torch.load(tmp_path / "raw.pt", weights_only=True)["state_dict"]
    assert exported.keys() == raw.keys() == net.keys()
    assert_bitwise(exported, net)
    assert_bitwise(raw, {k: state[f"net.{k}"] for k in net})
    module = load_module(get_class(run_config(load_full(ckpt))["model"]["_target_"]), ckpt)
    assert_bitwise({k: v for k, v in module.net.state_dict().items() if k in net}, net)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp_resume_with_ema_is_bitwise(tmp_path):
    """Killed at step 5 (checkpoints every 2 steps, validation every 2), resumed with ckpt_path=auto: the
    final checkpoint, EMA included, equals a straight run's bit for bit."""
    setup = [
        *(o for o in GPT if not o.startswith("trainer.max_steps")),
        "trainer.max_steps=8",
        "callbacks=[last_checkpoint,model_checkpoint,ema]",
        f"callbacks.ema.decay={DECAY}",
        "callbacks.last_checkpoint.every_n_train_steps=2",
        "strategy=fsdp",
        "trainer.devices=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "test=false",
        "run_id=run",
    ]
    logs = {name: tmp_path / name for name in ("straight", "mid")}
    cmd = [PYTHON, "-m", "mlproject.train", f"paths.log_dir={logs['straight']}", *setup]
    straight = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=clean_env(OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
    killed = run("train", *setup, "ckpt_path=auto", *kill_at(5), log_dir=logs["mid"], check=False)
    assert killed.returncode != 0
    wait_until_gone(f"paths.log_dir={logs['mid']}", 120)  # rank 1 dies at step 5 too
    run("train", *setup, "ckpt_path=auto", log_dir=logs["mid"])
    assert straight.wait(timeout=600) == 0
    want, got = (load_full(run_dir(log, "run") / "checkpoints" / "last.ckpt") for log in logs.values())
    assert got["global_step"] == want["global_step"] == 8
    assert any(k.startswith("ema.") for k in want["state_dict"])
    assert_bitwise(got["state_dict"], want["state_dict"])
