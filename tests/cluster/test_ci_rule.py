"""Under CI=true the SLURM tests fail when SLURM is unavailable; elsewhere they skip. One rule decides that and
whether the fixture may install SLURM. In-process: SLURM looks absent and apt-get is never really run."""

from __future__ import annotations

import subprocess

import pytest

from tests.cluster import conftest


@pytest.mark.parametrize("ci", ["true", "TRUE", "1", "false", "0", ""])
def test_unavailable_slurm_fails_only_under_ci(ci, monkeypatch):
    installs = []
    monkeypatch.setenv("CI", ci)
    monkeypatch.delenv("MLPROJECT_SLURM_INSTALL", raising=False)
    monkeypatch.setattr(conftest.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)
    monkeypatch.setattr(conftest.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        conftest.subprocess,
        "run",
        lambda *a, **k: installs.append(a) or subprocess.CompletedProcess(a, 100, "", "E: offline"),
    )
    reason = conftest.install_reason()
    if ci.lower() in ("true", "1"):
        assert installs and reason == "installing SLURM failed: E: offline"
        with pytest.raises(pytest.fail.Exception, match="CI=true but SLURM is unavailable: installing SLURM failed"):
            conftest.unavailable(reason)
    else:  # not CI: no install without MLPROJECT_SLURM_INSTALL=1 (CI=false counted as CI before), and a skip
        assert not installs and reason.startswith("SLURM is not installed")
        with pytest.raises(pytest.skip.Exception, match="SLURM is not installed"):
            conftest.unavailable(reason)
