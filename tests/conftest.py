"""Fixtures shared by all tests: composed configs, and one real training run that several tests inspect."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from mlproject.core.constants import CONFIG_DIR
from mlproject.core.resolvers import register_resolvers
from tests.helpers.processes import FAST, run, run_dirs

register_resolvers()  # as the entry points do: composed configs use ${run_id:}, ${precision:}, ...


@pytest.fixture
def compose_cfg(tmp_path):
    """compose_cfg(*overrides) -> the composed train (or eval) config, resolvable outside a Hydra run."""

    def _compose(*overrides: str, config_name: str = "train"):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name, [f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}", *overrides])

    yield _compose
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """One short real training run shared by the tests that inspect a finished run."""
    log_dir = tmp_path_factory.mktemp("trained")
    run("train", *FAST, "trainer.max_epochs=3", log_dir=log_dir)
    (run_dir,) = run_dirs(log_dir)
    return run_dir


@pytest.fixture
def no_sbatch(monkeypatch):
    """Fail the test if submit gets as far as running sbatch."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"submitted: {args}")

    from mlproject import submit

    monkeypatch.setattr(submit.subprocess, "run", refuse)
