"""A finished distributed job leaves without interpreter teardown, where torch 2.13 sometimes aborts
after gloo work and would turn a success into a failed job; its exit hooks (loggers flush there) still run."""

from __future__ import annotations

import pytest

from tests.helpers.processes import run


@pytest.mark.slow
def test_finished_ranks_skip_interpreter_teardown(tmp_path):
    probe = ["+callbacks.probe._target_=tests.helpers.callbacks.ExitProbe", f"+callbacks.probe.dir={tmp_path}"]
    ddp = ["trainer=cpu", "strategy=ddp", "trainer.devices=2", "++trainer.fast_dev_run=true"]
    run("train", *ddp, *probe, "extras.print_config=false", log_dir=tmp_path / "logs")
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["atexit\n"] * 2
