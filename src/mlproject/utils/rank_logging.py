"""A rank-aware logger: messages carry the rank, and run-level messages come from rank 0 only."""

from __future__ import annotations

import logging


def rank() -> int:
    # Lightning reads the rank from the launcher's environment at import and updates it at setup.
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0)


class RankLogger(logging.LoggerAdapter):
    """`log.info(...)` prints on rank 0 only; `log.info(..., all_ranks=True)` prints on every rank."""

    def log(self, level, msg, *args, all_ranks: bool = False, **kwargs):
        r = rank()
        if (all_ranks or r == 0) and self.isEnabledFor(level):
            msg, kwargs = self.process(f"[rank {r}] {msg}", kwargs)
            self.logger.log(level, msg, *args, **kwargs)

    def info(self, msg, *args, **kwargs):
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg, *args, **kwargs):
        self.log(logging.WARNING, msg, *args, **kwargs)


def get_logger(name: str) -> RankLogger:
    return RankLogger(logging.getLogger(name), {})


def drop_lightning_console_handler() -> None:
    """`import lightning` adds its own console handler; Hydra's handlers already print and file every
    record, so without this each Lightning message shows twice."""
    lightning_logger = logging.getLogger("lightning")
    for handler in list(lightning_logger.handlers):
        lightning_logger.removeHandler(handler)
    # Lightning advertises its cloud products ("Tip: ... litlogger", "litmodels") at INFO on every run; only
    # those records are dropped, its warnings and other messages pass.
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, NoTips) for f in tips.filters):
        tips.addFilter(NoTips())


class NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)
