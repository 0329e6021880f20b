"""Logger factories where Lightning's constructors need a decision made first."""

from __future__ import annotations

import netrc
import os

from mlproject.utils.logging import get_logger

log = get_logger(__name__)


def _wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_logger(offline: bool | None = None, **kwargs):
    """A WandbLogger that goes offline (and says so) when there are no credentials.

    The run id comes from the config (task name + run id), so a resumed run continues the same W&B run.
    """
    from lightning.pytorch.loggers import WandbLogger

    if offline is None:
        offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not _wandb_credentials()
        if offline:
            log.info(
                "wandb: no credentials found (WANDB_API_KEY or ~/.netrc), logging offline; "
                "upload later with `wandb sync <run dir>/wandb/offline-run-*`"
            )
    return WandbLogger(offline=offline, resume="allow", **kwargs)
