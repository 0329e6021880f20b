"""Preflight's memory check: a run whose planned per-rank memory exceeds the device's stops before it builds
anything, in one line naming the figures and `make plan`, where the kernel's OOM killer would end it silently."""

from __future__ import annotations

import time

from omegaconf import OmegaConf

from mlproject.core.topology import Topology
from mlproject.preflight import available_ram, check_memory
from tests.helpers.processes import run


def test_gpt_large_on_the_cpu_is_refused_in_one_line(tmp_path):
    start = time.monotonic()
    proc = run("train", "experiment=gpt_large", "trainer=cpu", "++trainer.fast_dev_run=true", log_dir=tmp_path,
               check=False, timeout=120)  # fmt: skip
    assert time.monotonic() - start < 120 and proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    # 1.70 GiB of model states, 25.23 MiB: the largest unit (a block) gathered, 24.60 GiB of activations
    assert line.startswith("error: strategy=fsdp needs 26.32 GiB per rank") and "available RAM" in line
    assert "`make plan ARGS=" in line and 'experiment=gpt_large trainer=cpu ++trainer.fast_dev_run=true"`' in line


def test_a_small_run_passes_and_the_check_can_be_skipped(compose_cfg):
    cfg = compose_cfg("experiment=gpt_large", "trainer=cpu")
    assert available_ram() is not None
    OmegaConf.update(cfg, "cluster.check_memory", False)
    check_memory(cfg, Topology.of(cfg))  # no planning at all: returns at once
    cfg = compose_cfg("trainer=cpu")  # digits: a few MiB
    check_memory(cfg, Topology.of(cfg))
