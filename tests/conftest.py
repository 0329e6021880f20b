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


def pytest_configure(config):
    """In the template's repository, child runs start from a warm interpreter (tests/helpers/warm.py): imports
    once, not once a process. A project made from the template has no such file: its runs start cold."""
    import os

    import torch

    from mlproject.core.constants import PROJECT_ROOT

    # one thread, as child runs have (clean_env): this process trains beside other processes on few cores
    torch.set_num_threads(1)
    controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    cold = os.environ.get("MLPROJECT_COLD_TESTS") == "1" or not (PROJECT_ROOT / "tests/helpers/warm.py").exists()
    if not cold and not controller:  # xdist's workers run the tests
        from tests.helpers import processes, warm

        processes.PYTHON, config._warm_server = warm.start(PROJECT_ROOT, processes.clean_env())


# Session fixtures that several test files share: under `pytest -n` (make test) the files that use one run on
# one worker, so each is built once. Every other file is a group of its own: its module fixtures, once too.
SHARED = ("slurm", "single_reference", "trained_run")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the markers into the groups
def pytest_collection_modifyitems(config, items):
    groups = {str(item.path): str(item.path) for item in items}
    for item in items:
        for name in SHARED:
            if name in item.fixturenames:
                groups[str(item.path)] = name
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[str(item.path)]))


def pytest_collection_finish(session):
    # A worker whose tests lost their group (xdist names it in the node id; pytest 9.2's ids ignore that) builds
    # every module fixture on both workers: the suite then takes longer than serial. Stop instead.
    loadgroup = getattr(session.config.option, "loadgroup", False)  # set on xdist's workers
    if loadgroup and any("@" not in item.nodeid for item in session.items):
        raise pytest.UsageError(
            "pytest-xdist lost the test groups (--dist loadgroup): install the locked pytest with make install-dev"
        )


def pytest_unconfigure(config):
    if server := getattr(config, "_warm_server", None):
        server.kill()
        server.wait()


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
