"""Build the objects of a run from their config keys, and the Trainer from them. A mistake in a `_target_` or
a constructor argument ends as one line naming the config key, the file it came from and the bad name."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import re

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from mlproject.core.errors import ConfigError


def source(cfg: DictConfig, key: str) -> str:
    """Where `key` was set: the command line, or the config file of its group's option."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "the composed config"
    hc = HydraConfig.get()
    set_keys = [o.lstrip("+~").split("=")[0] for o in hc.overrides.task]
    if any("." in k and (k == key or k.startswith(key + ".")) for k in set_keys):
        return "the command line"
    group = key.split(".")[0]
    choice = hc.runtime.choices.get(group)
    return f"configs/{group}/{choice}.yaml" if choice else f"configs/{hc.job.config_name}.yaml"


def chosen(cfg: DictConfig, group: str) -> str:
    """`data=digits (configs/data/digits.yaml)`: a group's option as the user would name it."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return f"{group} ({cfg[group]._target_})"
    return f"{group}={HydraConfig.get().runtime.choices.get(group)} ({source(cfg, group)})"


def targets(node, prefix: str) -> dict[str, str]:
    """config key -> `_target_` of every node under `node` (itself included)."""
    found = {prefix: node["_target_"]} if isinstance(node, DictConfig) and "_target_" in node else {}
    for key, value in node.items() if isinstance(node, DictConfig) else ():
        if isinstance(value, DictConfig):
            found |= targets(value, f"{prefix}.{key}")
    return found


def did_you_mean(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def explain(cfg: DictConfig, key: str, exc: Exception) -> str:
    """One line for Hydra's nested instantiation errors (a module's constructor instantiates its own net)."""
    text = str(exc).replace("\\'", "'")
    found = targets(OmegaConf.select(cfg, key), key)
    if m := re.search(r"Error locating target '([\w.]+)'", text):
        bad = m.group(1)
        at = next((k for k, t in found.items() if t == bad), key)
        module, _, name = bad.rpartition(".")
        hint = ""
        with contextlib.suppress(ImportError, ValueError):
            hint = did_you_mean(name, dir(importlib.import_module(module)))
            hint = hint and hint.replace("mean ", f"mean {module}.")
        return f"{at}._target_={bad} ({source(cfg, at)}) cannot be imported{hint}"
    if m := re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", text):
        cls, arg = m.groups()
        at = next((k for k, t in found.items() if t.endswith(f".{cls}")), key)
        params = inspect.signature(get_class(found[at])).parameters if at in found else ()
        hint = did_you_mean(arg, params).replace("mean ", f"mean {at}.") or f"; it takes {', '.join(params)}"
        return f"{at}.{arg} ({source(cfg, f'{at}.{arg}')}): {cls} takes no argument {arg!r}{hint}"
    cause = str(exc.__cause__ or exc).replace("\\'", "'")
    return f"{key} ({source(cfg, key)}) could not be built: {cause}"


def instantiate_at(cfg: DictConfig, key: str, **kwargs):
    """`instantiate(cfg.<key>)`; a wrong `_target_` or argument is a ConfigError naming key, file and name."""
    try:
        return instantiate(OmegaConf.select(cfg, key), **kwargs)
    except InstantiationException as exc:
        raise ConfigError(explain(cfg, key, exc)) from None


def instantiate_all(cfg: DictConfig, group: str) -> list:
    """Instantiate every entry of a group like `callbacks` or `logger` that has a `_target_`."""
    node = cfg.get(group) or {}
    return [
        instantiate_at(cfg, f"{group}.{name}")
        for name, c in node.items()
        if isinstance(c, DictConfig) and "_target_" in c
    ]


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
    loggers = instantiate_all(cfg, "logger")
    if not loggers:  # `~logger`: the LR monitor has nowhere to write, and Lightning would stop the run for it
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    return instantiate_at(
        cfg,
        "trainer",
        strategy=instantiate_at(cfg, "strategy"),
        callbacks=callbacks,
        logger=loggers or False,
        plugins=plugins or None,
    )


@contextlib.contextmanager
def first_batch_fits(cfg: DictConfig, trainer):
    """Around fit/test: a shape error before the first optimizer step means data and model disagree; say which."""
    try:
        yield
    except RuntimeError as exc:
        words = ("shape", "size", "channels", "dimension")
        if trainer.global_step or not any(w in str(exc) for w in words):
            raise
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(
            f"{chosen(cfg, 'data')} does not fit {chosen(cfg, 'model')} at the first batch: {first}; pick a "
            "matching data= and model= pair (or an experiment=), or make the model's input size the data's"
        ) from None
