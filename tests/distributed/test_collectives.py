"""No collective of our own per training step: what a step issues is the strategy's minimum.

Real 2-process gloo runs of the tiny GPT with the default callbacks, the CSV logger (writing every 2
steps) and the Signals callback (cluster/requeue.py) named in the config, ahead of the counter. A test
callback wraps the real torch.distributed functions (and the functional collectives DTensor uses) and
counts the calls of every step. Signals are agreed every 4 steps here (cluster.signal_check_every_n_steps):
one all-reduce at those steps, none in between; Lightning's per-step SIGTERM broadcast is gone.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from mlproject.core.constants import EXIT_SIGTERM, PROJECT_ROOT
from tests.helpers.gpt import TINY_GPT
from tests.helpers.processes import PYTHON, clean_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVERY = 4  # optimizer steps between the signal checks
STEPS = 10
TINY = [
    *TINY_GPT,
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "extras.print_config=false",
    "trainer.max_epochs=1",
    f"trainer.max_steps={STEPS}",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=2",
    "test=false",
    "+callbacks.signals._target_=mlproject.cluster.requeue.Signals",
    f"+callbacks.signals.every_n_steps={EVERY}",
]
RUNS = {
    "ddp": ["strategy=ddp", "+callbacks.count._target_=tests.distributed.collectives.CountCollectives"],
    "fsdp": ["strategy=fsdp", "+callbacks.count._target_=tests.distributed.collectives.CountCollectives"],
    # rank 1 alone gets SIGTERM after step 5: both ranks stop together at the next check, step 8
    "sigterm": [
        "strategy=ddp",
        f"++trainer.max_steps={STEPS * 3}",
        "+callbacks.signal._target_=tests.distributed.collectives.SendSignal",
        "+callbacks.signal.step=5",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """name -> the run's directory; the runs start together, one thread per process."""
    procs = {}
    for name, overrides in RUNS.items():
        out = tmp_path_factory.mktemp(name)
        key = "count" if name != "sigterm" else "signal"
        cmd = [PYTHON, "-m", "mlproject.train", f"paths.log_dir={out}", *TINY, *overrides]
        cmd.append(f"+callbacks.{key}.dir={out}")
        popen = subprocess.Popen(
            cmd, cwd=PROJECT_ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        procs[name] = (popen, out)
    for name, (popen, _) in procs.items():
        output = popen.communicate(timeout=500)[0].decode()
        expected = EXIT_SIGTERM if name == "sigterm" else 0  # saved last.ckpt, then exited as on SIGTERM
        assert popen.returncode == expected, f"{name} exited {popen.returncode}\n{output[-4000:]}"
    return {name: out for name, (_, out) in procs.items()}


def counts(out) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_steps_issue_only_the_strategys_collectives(runs, name):
    for record in counts(runs[name]):
        steps = record["steps"]
        assert len(steps) == STEPS
        # DDP: its bucket all-reduces run in its C++ reducer (not counted), nothing else. FSDP2 with
        # reshard_after_forward: each unit gathered in forward and again in backward, its gradient
        # reduce-scattered once; plus the one all-reduce of the gradient clipping norm.
        units = record["fsdp_units"]
        assert (units > 0) == (name == "fsdp")
        minimum = {"all_gather_single": 2 * units, "reduce_scatter_single": units, "all_reduce": 1} if units else {}
        for step, got in enumerate(steps[1:], start=2):  # the first step also sets up (not steady state)
            expected = dict(minimum)
            if step % EVERY == 0:  # Signals' check: it runs before the counter (callbacks in config order)
                expected["all_reduce"] = expected.get("all_reduce", 0) + 1
            assert got == expected, f"step {step}"


def test_sigterm_on_one_rank_stops_all_within_the_check_interval(runs):
    stopped = [json.loads((runs["sigterm"] / f"stopped{r}.json").read_text()) for r in (0, 1)]
    assert stopped == [{"step": 8, "exception": "SIGTERMException"}] * 2  # signal after step 5, check at 8
    (ckpt,) = runs["sigterm"].rglob("last.ckpt")
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] == 8
