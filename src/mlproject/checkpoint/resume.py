"""Which checkpoint a run resumes from."""

from __future__ import annotations

from pathlib import Path

from mlproject.checkpoint.convert import kind


def resolve_ckpt_path(ckpt_path: str | None, run_dir: str | Path) -> str | None:
    """`auto`: this run's checkpoints/last.ckpt when it exists (a re-run or requeue of the same run_id),
    else start fresh. Any other value is an explicit path. Either way a damaged checkpoint stops here with
    a one-line error naming it, instead of a pickling traceback deep inside Lightning."""
    if ckpt_path == "auto":
        last = Path(run_dir) / "checkpoints" / "last.ckpt"
        aside = Path(f"{last}.old")  # a crash between the two renames of a directory save (checkpoint/io.py)
        ckpt_path = str(last) if last.exists() else str(aside) if aside.exists() else None
    if ckpt_path is not None:
        kind(ckpt_path)
    return ckpt_path
