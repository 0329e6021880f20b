"""Diagnostics of a 2-process job on gloo: a rank that stops ends the job with every rank's stacks and one line
naming it; a rank 3x slower is named once, and the slowest and fastest rank's step times are logged, through the
signal check's all-reduce (no collective added to any step)."""

from __future__ import annotations

import csv
import json
import subprocess
import time

import pytest

from mlproject.core.constants import PROJECT_ROOT
from tests.helpers.gpt import TINY_GPT
from tests.helpers.processes import PYTHON, clean_env, run_dirs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVERY, STEPS, TIMEOUT, END_AFTER = 4, 12, 5, 5
BASE = [
    *TINY_GPT,
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "strategy=ddp",
    "extras.print_config=false",
    "trainer.max_epochs=1",
    f"trainer.max_steps={STEPS}",
    "trainer.limit_val_batches=0",
    "test=false",
    f"cluster.signal_check_every_n_steps={EVERY}",
]
RUNS = {
    "stall": [
        "debug=distributed",
        "cluster.collective_timeout_s=300",  # the watchdog ends the job, not gloo's timeout
        f"callbacks.stall_watchdog.timeout={TIMEOUT}",
        f"callbacks.stall_watchdog.end_after={END_AFTER}",
        "+callbacks.stall._target_=tests.distributed.collectives.Stall",
        "+callbacks.stall.step=3",
    ],
    "slow": [
        "logger=csv",
        "trainer.log_every_n_steps=1",
        "+callbacks.slow._target_=tests.distributed.collectives.Slow",
        "+callbacks.slow.seconds=0.1",
        "+callbacks.count._target_=tests.distributed.collectives.CountCollectives",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """name -> (exit code, output, log dir, seconds); the runs start together."""
    procs = {}
    for name, overrides in RUNS.items():
        out = tmp_path_factory.mktemp(name)
        cmd = [PYTHON, "-m", "mlproject.train", f"paths.log_dir={out}", *BASE, *overrides]
        if name == "slow":
            cmd.append(f"+callbacks.count.dir={out}")
        popen = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs[name] = (popen, out, time.monotonic())
    results = {}
    for name, (popen, out, start) in procs.items():
        stdout, stderr = popen.communicate(timeout=500)
        results[name] = (popen.returncode, stdout.decode() + stderr.decode(), out, time.monotonic() - start)
    return results


def test_a_rank_that_stops_ends_the_job_naming_it(runs):
    code, output, out, seconds = runs["stall"]
    assert code != 0, output[-4000:]
    assert seconds < 60 + TIMEOUT + END_AFTER + 60  # start-up, the steps, the watchdog, and the margin
    lines = [line for line in output.splitlines() if line.startswith("error: training stalled")]
    assert len(lines) == 1 and "rank 1 stopped first (at step 3)" in lines[0], output[-4000:]
    (run_dir,) = run_dirs(out, "debug")
    for rank in (0, 1):
        assert "Thread" in (run_dir / "stalls" / f"rank{rank}.txt").read_text()  # its stacks, dumped
    assert "in on_train_batch_start" in (run_dir / "stalls" / "rank1.txt").read_text()


def test_a_slow_rank_is_named_once_and_step_times_are_logged(runs):
    code, output, out, _ = runs["slow"]
    assert code == 0, output[-4000:]
    warnings = [line for line in output.splitlines() if "is a straggler" in line]
    assert len(warnings) == 1 and "rank 1 is a straggler" in warnings[0], output[-4000:]
    (run_dir,) = run_dirs(out)
    (metrics,) = run_dir.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("perf/step_time_max")]
    assert [int(r["step"]) for r in rows] == [EVERY, 2 * EVERY, 3 * EVERY]
    for row in rows:
        slowest, fastest = float(row["perf/step_time_max"]), float(row["perf/step_time_min"])
        # 3 x 0.1 s and 0.1 s of sleep, each plus a forward (and on rank 0 the logger's writing)
        assert slowest > 0.3 and fastest > 0.1 and slowest - fastest > 0.1
    for rank in (0, 1):  # the figures ride on the signal check: one all-reduce every EVERY steps, none between
        steps = json.loads((out / f"rank{rank}.json").read_text())["steps"]
        for step, got in enumerate(steps[1:], start=2):
            # Signals runs after the counter (build_trainer appends it): its check at step 4 counts in step 5
            assert got == ({"all_reduce": 1} if step % EVERY == 1 else {}), f"rank {rank} step {step}"
