"""Where the project lives, how a padded evaluation slot is marked, and the exit codes of agreed stops."""

from __future__ import annotations

import signal
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[3]
CONFIG_DIR = PROJECT_ROOT / "configs"
IGNORE_INDEX = -100  # target value that the GPT's loss skips
# Exit codes of runs that every rank ends together at an agreed step (cluster/requeue.py); a launcher that
# sees one from another rank need not stop this rank, which ends the same way.
EXIT_SIGTERM = 128 + signal.SIGTERM  # stopped on SIGTERM after saving last.ckpt (the shell's code for it)
EXIT_DIVERGED = 3  # stopped on a non-finite training loss; last.ckpt is the last good state
AGREED_EXITS = (EXIT_SIGTERM, EXIT_DIVERGED)
