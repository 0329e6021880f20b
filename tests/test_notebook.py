"""The notebook runs headless against a finished run and reproduces its test accuracy."""

from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient

from mlproject.core.constants import PROJECT_ROOT


@pytest.mark.slow
def test_inspect_run_notebook(trained_run, monkeypatch):
    monkeypatch.setenv("RUN_DIR", str(trained_run))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    path = PROJECT_ROOT / "notebooks" / "inspect_run.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "test accuracy" in printed
    assert os.environ["RUN_DIR"] in printed
