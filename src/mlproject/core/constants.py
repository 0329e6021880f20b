"""Where the project lives, the sampler index of a padded evaluation slot, and the target value losses skip."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[3]
CONFIG_DIR = PROJECT_ROOT / "configs"
PAD = -1  # sampler index of a padded evaluation slot: metrics mask it by this index, whatever its target
IGNORE_INDEX = -100  # target value that losses and metrics skip (metrics put it on padded slots)
