"""`make export OUT=<a file in a directory that does not exist>` is refused in one line before the checkpoint is
read: no directory is made, no file (or partial file) written, and the directory export runs in (its
hydra.run.dir is `.`) keeps every file."""

from __future__ import annotations

import subprocess

import pytest
import torch

from mlproject.core.errors import ConfigError
from mlproject.export import check_out
from tests.helpers.processes import PYTHON, clean_env


def test_output_in_a_missing_directory_is_refused_and_nothing_is_written(tmp_path):
    project = tmp_path / "project"  # where the user runs export: the project root under `make export`
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    net = torch.nn.Linear(3, 2)
    config = {"net": {"_target_": "torch.nn.Linear", "in_features": 3, "out_features": 2}}
    state = {f"net.{k}": v for k, v in net.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": config}, project / "last.ckpt")

    def export(out: str) -> subprocess.CompletedProcess:
        cmd = [PYTHON, "-m", "mlproject.export", "ckpt_path=last.ckpt", f"out={out}"]
        return subprocess.run(cmd, cwd=project, env=clean_env(), capture_output=True, text=True, timeout=120)

    refused = export("missing/dir/model.pt")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "error: out=missing/dir/model.pt: the directory missing/dir does not exist; create it (mkdir -p "
        "missing/dir) or give out= a file in an existing one."
    )
    assert sorted(p.name for p in project.iterdir()) == ["last.ckpt", "notes.txt"]
    assert (project / "notes.txt").read_text() == "mine"

    done = export("model.pt")  # the same checkpoint, to a directory that exists: the refusal was the directory's
    assert done.returncode == 0, done.stderr
    weights = torch.load(project / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())


def test_output_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=f"^out={tmp_path} is a directory; name the file to write, e.g. out="):
        check_out(str(tmp_path))
