"""Build lists of callbacks and loggers from their config groups, and the Trainer from them."""

from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig


def instantiate_all(group: DictConfig | None) -> list:
    """Instantiate every entry of a group like `callbacks` or `logger` that has a `_target_`."""
    return [instantiate(c) for c in (group or {}).values() if isinstance(c, DictConfig) and "_target_" in c]


def build_trainer(cfg: DictConfig, callbacks: list, plugins: tuple = ()):
    """cfg.trainer with the strategy, callbacks and loggers of their groups.

    Plugins from config (e.g. cluster=slurm's SLURMEnvironment) are kept next to the ones passed here:
    a `plugins=` argument alone would replace them. SyncBatchNorm goes through our plugin, which also
    works on CPU (torch's SyncBatchNorm is CUDA-only). Every run checks for signals every N steps rather
    than Lightning's every step, and for a non-finite loss (cluster/requeue.py); cluster=slurm's Requeue is
    such a check already.
    """
    from lightning.pytorch.callbacks import LearningRateMonitor
    from omegaconf import OmegaConf

    from mlproject.cluster.requeue import Signals
    from mlproject.distributed.syncbn import SyncBatchNormPlugin

    if not any(isinstance(c, Signals) for c in callbacks):
        every = OmegaConf.select(cfg, "cluster.signal_check_every_n_steps", default=10)
        divergence = cfg.get("divergence") or {}
        callbacks = [*callbacks, Signals(every, divergence.get("skip", False), divergence.get("max_skipped", 10))]

    plugins = [*(instantiate(p) for p in cfg.trainer.get("plugins") or []), *plugins]
    if cfg.trainer.get("sync_batchnorm"):
        plugins.append(SyncBatchNormPlugin())
    loggers = instantiate_all(cfg.get("logger"))
    if not loggers:  # `~logger`: the LR monitor has nowhere to write, and Lightning would stop the run for it
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    return instantiate(
        cfg.trainer,
        strategy=instantiate(cfg.strategy),
        callbacks=callbacks,
        logger=loggers or False,
        plugins=plugins or None,
    )
