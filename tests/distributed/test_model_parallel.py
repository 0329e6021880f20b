"""Every strategy of STRATEGIES trains the tiny GPT exactly as one process does.

Every run is a real `python -m mlproject.train` with gloo processes on this machine, fp32, the same
seed and the same GLOBAL batch. Compared with the single-process run: the global loss of every step,
the final parameters, and the test metrics (token-weighted loss, accuracy, sequence count). The
fsdp run also checkpoints activations, which may not change a number.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from mlproject.core.constants import PROJECT_ROOT
from tests.helpers.gpt import TINY_GPT, assert_trains_like
from tests.helpers.processes import PYTHON, clean_env, read_metrics, run_dirs

TINY = [
    *TINY_GPT,
    "trainer.accelerator=cpu",
    "extras.print_config=false",
    "callbacks=none",
    "+callbacks.footprint._target_=mlproject.callbacks.footprint.ModelFootprint",
    "+callbacks.recorder._target_=tests.helpers.callbacks.RecordSteps",
    "model.optimizer.lr=0.01",
    "model.scheduler.warmup_steps=2",
    "trainer.max_epochs=1",
    "trainer.max_steps=6",
    "trainer.limit_val_batches=0",
]
STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "fsdp": ["strategy=fsdp", "trainer.devices=2", "strategy.fsdp.activation_checkpointing=true"],
    "hsdp": ["strategy=hsdp", "trainer.devices=4", "strategy.replicate_size=2"],  # 2 replicas x 2 shards
    # feature: tensor
    "tp": ["strategy=tp", "trainer.devices=2", "strategy.tensor_parallel_size=2"],
    # 2-D FSDP x TP, keeping parameters gathered after forward
    "fsdp_tp": [
        "strategy=fsdp_tp",
        "trainer.devices=4",
        "strategy.tensor_parallel_size=2",
        "strategy.fsdp.reshard_after_forward=false",
    ],
    # /feature: tensor
}
TORCH = list(STRATEGIES)  # the strategies of torch's own parallelism (the planner's)


# feature: deepspeed
def deepspeed_installed() -> bool:  # an optional extra; tests/distributed/test_deepspeed.py says so
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


if deepspeed_installed():
    STRATEGIES["deepspeed_stage_1"] = ["strategy=deepspeed_stage_1", "trainer.devices=2"]  # shards optimizer state
    STRATEGIES["deepspeed_stage_2"] = ["strategy=deepspeed_stage_2", "trainer.devices=2"]  # clips in its own partitions
# /feature: deepspeed
LOSS_RTOL = 2e-6  # fp32; the order of additions differs between strategies (measured <= 3e-7)
PARAM_ATOL = 5e-6  # after 6 AdamW steps of lr 0.01 the weights moved ~0.05 (measured differences <= 1.1e-6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    return start_runs(tmp_path_factory, TINY, STRATEGIES)


def start_runs(tmp_path_factory, common: list[str], strategies: dict[str, list[str]]) -> dict[str, dict]:
    """name -> {losses, state, metrics, footprint (bytes per rank), run_dir}.

    The runs start together, one thread per process, to fill the CPUs without oversubscribing them.
    """
    procs = {}
    for name, overrides in strategies.items():
        log_dir = tmp_path_factory.mktemp(name)
        cmd = [PYTHON, "-m", "mlproject.train", f"paths.log_dir={log_dir}", *common, *overrides]
        cmd.append(f"+callbacks.recorder.path={log_dir / 'record.pt'}")
        popen = subprocess.Popen(
            cmd, cwd=PROJECT_ROOT, env=clean_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        procs[name] = (popen, log_dir)
    out = {}
    for name, (popen, log_dir) in procs.items():
        output = popen.communicate(timeout=600)[0].decode()
        assert popen.returncode == 0, f"{name} exited {popen.returncode}\n{output[-4000:]}"
        (run_dir,) = run_dirs(log_dir)
        logs = "".join(p.read_text() for p in run_dir.glob("*.log"))
        footprint = [int(b) for b in re.findall(r"model footprint on this rank: .* = (\d+) bytes", logs)]
        record = torch.load(log_dir / "record.pt")
        out[name] = {**record, "metrics": read_metrics(run_dir), "footprint": footprint, "run_dir": run_dir}
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test waits for all runs
@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "single"])
def test_same_training_as_one_process(runs, name):
    assert_trains_like(runs[name], runs["single"], LOSS_RTOL, PARAM_ATOL)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test waits for all runs
def test_fsdp_holds_a_share_of_the_model(runs):
    """Per-rank parameter + optimizer bytes, logged by every run: FSDP on 2 ranks holds half of DDP's."""
    single, ddp, fsdp = runs["single"]["footprint"], runs["ddp"]["footprint"], runs["fsdp"]["footprint"]
    hsdp = runs["hsdp"]["footprint"]
    assert len(ddp) == len(fsdp) == 2 and len(hsdp) == 4
    assert ddp == single * 2  # DDP replicates the whole model on every rank
    for rank_bytes in fsdp:
        assert rank_bytes == pytest.approx(ddp[0] / 2, rel=0.02)
    assert sorted(hsdp) == sorted(fsdp * 2)  # HSDP over 2 x 2 holds what FSDP over 2 does: 1/shard size
    # feature: tensor
    tp, fsdp_tp = runs["tp"]["footprint"], runs["fsdp_tp"]["footprint"]
    assert len(tp) == 2 and len(fsdp_tp) == 4
    assert max(tp) < single[0] and max(fsdp_tp) < min(fsdp)  # TP splits the blocks; 2-D also shards the rest
    # /feature: tensor


# feature: planner
@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test waits for all runs
# feature: deepspeed
# Not deepspeed_stage_1/2: there the planner gives DeepSpeed's estimate, all model states as one sum for 16-bit
# mixed precision, not the fp32 parameter and optimizer bytes the footprint line counts
# /feature: deepspeed
@pytest.mark.parametrize("name", TORCH)
def test_planner_predicts_every_rank_to_the_byte(runs, compose_cfg, name):
    """mlproject.plan, on the meta device and a fake process group, against the footprint line of the real run."""
    from mlproject.plan import estimate

    cfg = compose_cfg(*TINY, *STRATEGIES[name])
    measured = runs[name]["footprint"]
    planned = [(row := estimate(cfg, rank=rank)).params + row.optimizer for rank in range(len(measured))]
    assert sorted(planned) == sorted(measured)  # the logs of the ranks are read in no particular order


# /feature: planner
