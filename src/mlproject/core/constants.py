"""Where the project lives, and the target value that marks a padded evaluation sample."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[3]
CONFIG_DIR = PROJECT_ROOT / "configs"
IGNORE_INDEX = -100  # target value of padded evaluation samples; losses and metrics skip it
