"""Loggers, one module each (configs/logger/<name>.yaml builds it): Lightning's, where a decision comes first."""

from __future__ import annotations


def sweep_trial() -> int | None:
    """The trial number inside a Hydra sweep (multirun), else None: each trial is its own logger run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or HydraConfig.get().mode.name != "MULTIRUN":
        return None
    return HydraConfig.get().job.num


def finish_loggers(loggers) -> None:
    """End the loggers' runs now, not at interpreter exit: the next trial of a sweep runs in this process
    and would otherwise log into this trial's run. Lightning finalized them after fit and test already;
    again here, since the run's outcome (report.log_outcome) came after. A logger with a run of its own to
    end has `finish()`."""
    for logger in loggers:
        logger.finalize("success")
        if callable(finish := getattr(type(logger), "finish", None)):
            finish(logger)
