"""The commands README.md shows run as shown, so the first steps cannot rot.

Each `make <target> ...` line of the README's shell blocks is checked twice: `make -n` must turn it into
the `python -m mlproject.<module>` command with the same overrides, and that command must run, shortened
to one batch of everything (`trainer.fast_dev_run`) and writing under a temporary directory.
"""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from mlproject.core.constants import PROJECT_ROOT
from tests.helpers.processes import PYTHON, clean_env, make_command, run

README = PROJECT_ROOT / "README.md"
NOT_RUN = {"test", "test-fast", "lint", "format", "install"}  # the suite itself, and the tools around it
MODULES = {
    "train": "train",
    "eval": "eval",
    "export": "export",
    # feature: slurm
    "submit-dryrun": "submit",
    # /feature: slurm
}


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = [ln.split("  #")[0].strip() for block in blocks for ln in block.splitlines()]
    return [ln.removeprefix("make ") for ln in lines if ln.startswith("make ") and ln.split()[1] not in NOT_RUN]


def test_readme_shows_the_first_steps():
    commands = readme_commands()
    assert "train" in commands and any(c.startswith("eval ") for c in commands), commands


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, trained_run, tmp_path):
    command = command.replace("logs/train/runs/<run_id>", str(trained_run)).replace(
        "OUT=model.pt", f"OUT={tmp_path}/m.pt"
    )
    target, args = shlex.split(command)[0], make_command(command)
    module = MODULES[target]
    # feature: slurm
    if module == "submit":  # renders the sbatch script only; tests/cluster/ submits for real
        proc = run(module, *args, log_dir=tmp_path)
        assert "#SBATCH --nodes=" in proc.stdout
        return
    # /feature: slurm
    if module == "export":  # writes one file, no run directory
        cmd = [PYTHON, "-m", "mlproject.export", *args]
        subprocess.run(cmd, cwd=PROJECT_ROOT, env=clean_env(), check=True, capture_output=True, timeout=120)
        assert (tmp_path / "m.pt").stat().st_size > 0
        return
    run(module, *args, "++trainer.fast_dev_run=true", "extras.print_config=false", log_dir=tmp_path)
