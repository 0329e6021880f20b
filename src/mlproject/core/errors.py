"""The errors a user can fix: each message says how, and the entry points print it as one line."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work; the message says how to fix it."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read; the message names the file and says what to do."""
