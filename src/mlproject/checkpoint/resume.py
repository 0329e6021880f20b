"""Which checkpoint a run resumes from, and in which run directory."""

from __future__ import annotations

import math
import os
from pathlib import Path


def resolve_ckpt_path(ckpt_path: str | None, run_dir: str | Path, ckpt_dir: str | None = None) -> str | None:
    """`auto`: this run's checkpoints/last.ckpt when it exists (a re-run or requeue of the same run_id),
    else start fresh. Any other value is an explicit path. Either way a damaged checkpoint stops here
    with a one-line error naming it, instead of a pickling traceback deep inside Lightning."""
    from mlproject.checkpoint.convert import checkpoint_format
    from mlproject.core.resolvers import generated_run_id

    # feature: object_storage
    if ckpt_path == "auto" and ckpt_dir:
        from mlproject.checkpoint.object_storage import is_remote, last_checkpoint

        if is_remote(ckpt_dir):  # the checkpoint callback's dirpath in object storage replaces <run_dir>/checkpoints
            ckpt_path = last_checkpoint(ckpt_dir, checkpoint_format)
    # /feature: object_storage
    if ckpt_path == "auto" and Path(run_dir).name == generated_run_id():
        from mlproject.utils.rank_logging import get_logger

        get_logger(__name__).warning(
            f"ckpt_path=auto starts fresh: no run_id= was given, so this run has a new id ({generated_run_id()}) "
            "and no checkpoint of its own; to resume a run, give its run_id= (its folder name under runs/)"
        )
    if ckpt_path == "auto":
        last = Path(run_dir) / "checkpoints" / "last.ckpt"
        aside = Path(f"{last}.old")  # a crash between the two renames of a directory save (checkpoint/storage.py)
        ckpt_path = str(last) if last.exists() else str(aside) if aside.exists() else None
    if ckpt_path is not None:
        checkpoint_format(ckpt_path)
    return ckpt_path


def checkpoint_to_test(trainer) -> tuple[str | None, str]:
    """The checkpoint `trainer.test` loads after fit, and why: the best by a metric when one was ranked (right
    after a validation), else the last one (no validation ran, or nothing ranks), else the weights in memory."""
    callbacks = trainer.checkpoint_callbacks
    for c in callbacks:
        if c.monitor and c.best_model_path and c.best_model_score is not None and math.isfinite(c.best_model_score):
            return c.best_model_path, f"the best by {c.monitor} ({float(c.best_model_score):.4g} at its validation)"
    for c in callbacks:
        if c.last_model_path:
            return c.last_model_path, "the last checkpoint: none was ranked by a metric (no validation ran)"
    return None, "the weights in memory: no checkpoint was saved"


def continue_run_of_checkpoint(args: list[str]) -> None:
    """`ckpt_path=<log_dir>/<task>/runs/<run_id>/checkpoints/<name>` without `run_id=`: resume in that run's
    directory, so its logs and metrics.csv continue (and a logger's run named `<task>-<run_id>`). Sets the id every rank
    and every resolver of `${run_id:}` reads (core/resolvers.run_id)."""
    if os.environ.get("MLPROJECT_RUN_ID") or any(arg.startswith("run_id=") for arg in args):
        return
    for arg in args:
        if arg.startswith("ckpt_path="):
            parts = Path(arg.split("=", 1)[1]).parts
            if len(parts) >= 4 and parts[-2] == "checkpoints" and parts[-4] == "runs":
                os.environ["MLPROJECT_RUN_ID"] = parts[-3]
