"""configs/logger/wandb.yaml: Weights & Biases, offline (and saying so) without credentials."""

from __future__ import annotations

import os

from lightning.pytorch.loggers import WandbLogger as _WandbLogger

from mlproject.loggers import sweep_trial
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


def wandb_credentials() -> bool:
    import netrc

    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_logger(offline: bool | None = None, id: str | None = None, name: str | None = None, **kwargs):
    """A WandbLogger that goes offline (and says so) when there are no credentials.

    The run id comes from the config (task name + run id), so a resumed run continues the same W&B run;
    in a sweep each trial gets its own (`-<trial>` appended), as it gets its own run directory.
    """
    trial = sweep_trial()
    if trial is not None:
        id, name = f"{id}-{trial}", f"{name}-{trial}"

    if offline is None:
        offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not wandb_credentials()
        if offline:
            log.info(
                "wandb: no credentials found (WANDB_API_KEY or ~/.netrc), logging offline; "
                "upload later with `wandb sync <run dir>/wandb/offline-run-*`"
            )
    return WandbLogger(offline=offline, resume="allow", id=id, name=name, **kwargs)


class WandbLogger(_WandbLogger):
    """Lightning's WandbLogger, with the run's outcome in its summary and a run that ends with the training run."""

    def log_outcome(self, best: dict) -> None:
        self.experiment.summary.update(best)

    def finish(self) -> None:
        import wandb

        if wandb.run is not None:  # the run this logger started (its `experiment` property would start one)
            wandb.finish()
