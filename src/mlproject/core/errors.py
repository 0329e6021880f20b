"""The errors a user can fix: each message says how, and the entry points print it as one line."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work; the message says how to fix it."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read; the message names the file and says what to do."""


def library_dirs() -> tuple[str, ...]:
    """Where installed libraries and the standard library live: frames there are not the user's code."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def root_cause(exc: BaseException) -> BaseException:
    """The first exception of a chain (Hydra's InstantiationException wraps what a constructor raised)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def user_frame(exc: BaseException):
    """The innermost frame outside installed libraries where the root cause of `exc` was raised (a
    `traceback.FrameSummary`), or None when it was raised by a library itself, e.g. Hydra calling a
    constructor with an argument it does not take."""
    import traceback

    frames = traceback.extract_tb(root_cause(exc).__traceback__)
    outside = [f for f in frames if not f.filename.startswith((*library_dirs(), "<"))]
    return outside[-1] if outside else None
