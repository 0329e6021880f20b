"""`cluster.collective_timeout_s` is the one key for every strategy's process-group timeout: each strategy config
that starts a process group (the default, auto, included: ddp on several devices) reads it, so debug=distributed's
short timeout reaches them all."""

from __future__ import annotations

import pytest

from mlproject.core.constants import CONFIG_DIR

GROUPS = sorted(p.stem for p in (CONFIG_DIR / "strategy").glob("*.yaml") if p.stem != "single")


@pytest.mark.parametrize("strategy", GROUPS)
def test_every_strategy_takes_the_cluster_timeout(compose_cfg, strategy):
    assert compose_cfg(f"strategy={strategy}", "cluster.collective_timeout_s=77").strategy.timeout == 77
    assert compose_cfg(f"strategy={strategy}", "debug=distributed").strategy.timeout == 120
