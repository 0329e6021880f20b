"""Where the project lives, how a padded evaluation slot is marked, and the exit codes of agreed stops."""

from __future__ import annotations

import os
import signal
from pathlib import Path

# This package's source tree (src/ in the project), or, where the package is installed as a dependency of a
# project (scripts/rename_project.py --machinery=package), the project that runs it: $PROJECT_ROOT or here.
_SOURCE = Path(__file__).resolve().parents[3]
PROJECT_ROOT = Path(os.environ.get("PROJECT_ROOT") or (_SOURCE if (_SOURCE / "configs").is_dir() else ".")).resolve()
CONFIG_DIR = PROJECT_ROOT / "configs"
IGNORE_INDEX = -100  # target value that the GPT's loss skips
# Exit codes of runs that every rank ends together at an agreed step (cluster/requeue.py); a launcher that
# sees one from another rank need not stop this rank, which ends the same way.
EXIT_SIGTERM = 128 + signal.SIGTERM  # stopped on SIGTERM after saving last.ckpt (the shell's code for it)
EXIT_DIVERGED = 3  # stopped on a non-finite training loss; last.ckpt is the last good state
AGREED_EXITS = (EXIT_SIGTERM, EXIT_DIVERGED)
