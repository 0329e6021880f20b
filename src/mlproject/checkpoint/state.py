"""What Lightning leaves out of a checkpoint: every rank's RNG states and metric states, and the config.

Lightning saves model, optimizers, schedulers, loop counters and precision state, and the data position
through the StatefulDataLoader (training/loaders.py). Without the RNG states a resumed run draws different
dropout masks than a straight one; without the torchmetrics states (non-persistent, and per rank) an epoch
resumed mid-way reports train metrics of its post-resume batches only; without the config a checkpoint
cannot rebuild its model on its own.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from omegaconf import Container, DictConfig, OmegaConf
from torchmetrics import Metric

from mlproject.utils import compat
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)

PLAIN = (torch.Tensor, torch.Size, torch.dtype, torch.device)  # besides numbers, strings, bytes and None


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values, so `torch.load(weights_only=True)` reads them."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": list(random.getstate()),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def metric_states(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """The accumulated state of every torchmetrics metric in `module` that has been updated since its reset,
    on the CPU (a GPU tensor would be unpickled onto the sender's GPU by every rank it is gathered to)."""

    def cpu(value):
        return [v.detach().cpu() for v in value] if isinstance(value, list) else value.detach().cpu()

    return {
        name: {"updates": metric.update_count, "state": {k: cpu(v) for k, v in metric.metric_state.items()}}
        for name, metric in module.named_modules()
        if isinstance(metric, Metric) and metric.update_count
    }


def set_metric_states(module: torch.nn.Module, states: dict[str, dict[str, Any]]) -> None:
    for name, saved in states.items():
        metric = module.get_submodule(name)
        for attr, value in saved["state"].items():
            setattr(
                metric,
                attr,
                [v.to(metric.device) for v in value] if isinstance(value, list) else value.to(metric.device),
            )
        compat.set_update_count(metric, saved["updates"])


def plain(value: Any) -> Any:
    """`value` as data a weights-only load reads: OmegaConf containers and dict subclasses as dicts and lists.
    Anything else that is not a tensor, a number, a string, bytes, None, a dtype or a device raises TypeError:
    an object, such as a module or a partial that Hydra built from the config."""
    if isinstance(value, Container):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(plain(v) for v in value)
    if type(value) in (str, int, float, bool, bytes, type(None)) or isinstance(value, PLAIN):
        return value
    raise TypeError(type(value).__qualname__)


def plain_hyperparameters(checkpoint: dict[str, Any]) -> list[str]:
    """Lightning saves a module's and a datamodule's hyperparameters as they are, which a weights-only load
    refuses unless they are plain data: OmegaConf containers become plain dicts and lists, without the class
    Lightning records for them (load_from_checkpoint then passes the plain dicts a run passes too, _convert_: all);
    objects (a module, an optimizer's partial, as a lightning-hydra-template module is given them) are left out,
    and their names returned. The run's config, saved with them, says how they were built."""
    dropped = []
    for owner in (L.LightningModule, L.LightningDataModule):
        key, kind = owner.CHECKPOINT_HYPER_PARAMS_KEY, owner.CHECKPOINT_HYPER_PARAMS_TYPE
        if key in checkpoint:
            kept = {}
            for name, value in checkpoint[key].items():
                try:
                    kept[name] = plain(value)
                except TypeError:
                    dropped.append(name)
            checkpoint[key] = kept
        checkpoint.pop(kind, None)
    return dropped


class RunState(L.Callback):
    """Adds each rank's RNG and metric states and the resolved config to every checkpoint; restores the RNG,
    and the metric states when resuming mid-epoch.

    Every rank takes part in each save (Lightning calls `state_dict` on all ranks), so rank 0, which writes
    the non-sharded part of the checkpoint, holds all ranks' states. Loggers are flushed at each save and
    each epoch start: the CSV logger otherwise buffers 100 steps, which a kill would lose for good.
    """

    def __init__(self, config: DictConfig | dict | None = None):
        self.config = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config
        self.module: torch.nn.Module | None = None
        self.loaded_metrics: dict[str, dict[str, Any]] | None = None
        self.dropped: list[str] = []  # hyperparameters left out of the last checkpoint (said once)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.module = pl_module

    def state_dict(self) -> dict[str, Any]:
        state = {"rng": rng_state(), "metrics": metric_states(self.module) if self.module is not None else {}}
        states = [state]
        if dist.is_available() and dist.is_initialized():
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
        return {"rng": [s["rng"] for s in states], "metrics": [s["metrics"] for s in states], "config": self.config}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        for logger in trainer.loggers:
            logger.save()
        dropped = plain_hyperparameters(checkpoint)
        if dropped and not self.dropped:
            log.info(
                f"hyperparameters {', '.join(dropped)} are objects, left out of the checkpoints (which load with "
                "weights_only=True); the run's config in them says how they were built"
            )
        self.dropped = dropped

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning bug #20550: when configure_optimizers reads trainer.estimated_stepping_batches (ours do, for
        # the schedule), the train loader is built before the checkpoint is restored and the position saved
        # in a mid-epoch checkpoint is never loaded; load it here, with the metrics of the epoch so far.
        if compat.reload_loader_position(trainer) and self.loaded_metrics:
            set_metric_states(pl_module, self.loaded_metrics)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        for logger in trainer.loggers:
            logger.save()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get("rng") or []
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        if len(states) != world:
            log.warning(
                f"checkpoint holds RNG and metric states of {len(states)} rank(s), this run has {world}: training "
                "continues from the seeded RNG, so the result is close but not bitwise a straight run, and train "
                "metrics of an epoch resumed mid-way count the batches after the resume only"
            )
            return
        set_rng_state(states[rank])
        self.loaded_metrics = (state_dict.get("metrics") or [None] * world)[rank]
