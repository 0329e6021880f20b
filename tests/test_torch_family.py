"""torchvision/torchaudio of another torch build stop `make install` in one line naming both builds."""

from __future__ import annotations

import subprocess
import sys

from mlproject.core.constants import PROJECT_ROOT

SCRIPT = PROJECT_ROOT / "scripts" / "check_torch_family.py"


def fake_dist(site, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def check(site) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True)


def test_pypi_torchvision_beside_a_cpu_torch_fails_in_one_line(tmp_path):
    fake_dist(tmp_path, "torch", "2.13.0+cpu")
    fake_dist(tmp_path, "torchvision", "0.28.0", ("torch==2.13.0", "numpy"))
    proc = check(tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        "error: torchvision 0.28.0 (PyPI build, for torch 2.13.0) does not match torch 2.13.0+cpu (cpu build): "
        "take both from one index, pinned by `make lock TORCH=... TORCH_INDEX=...` (README, Install)\n"
    )


def test_another_torch_release_fails_and_a_matching_build_passes(tmp_path):
    fake_dist(tmp_path / "old", "torch", "2.13.0+cpu")
    fake_dist(tmp_path / "old", "torchaudio", "2.12.0+cpu", ("torch==2.12.0",))
    assert "torchaudio 2.12.0+cpu (cpu build, for torch 2.12.0) does not match" in check(tmp_path / "old").stderr
    fake_dist(tmp_path / "ok", "torch", "2.13.0+cu128")
    fake_dist(tmp_path / "ok", "torchvision", "0.28.0+cu128", ("torch==2.13.0",))
    proc = check(tmp_path / "ok")
    assert proc.returncode == 0 and proc.stderr == ""


def test_make_install_runs_the_check():
    out = subprocess.run(
        ["make", "-n", "install", "VENV=/nonexistent"], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert "/nonexistent/bin/python scripts/check_torch_family.py" in out.stdout
