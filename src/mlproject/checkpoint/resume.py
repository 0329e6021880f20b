"""Which checkpoint a run resumes from."""

from __future__ import annotations

from pathlib import Path


def resolve_ckpt_path(ckpt_path: str | None, run_dir: str | Path) -> str | None:
    """`auto`: this run's checkpoints/last.ckpt when it exists (a re-run or requeue of the same run_id),
    else start fresh. Any other value is an explicit path (preflight checked it exists)."""
    if ckpt_path != "auto":
        return ckpt_path
    last = Path(run_dir) / "checkpoints" / "last.ckpt"
    return str(last) if last.exists() else None
