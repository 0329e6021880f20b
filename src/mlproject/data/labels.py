"""Labels against the model's class count, checked when the template's datasets are set up: a label at or
beyond `num_classes` would fail only at the first batch, deep inside cross-entropy."""

from __future__ import annotations

from collections.abc import Mapping

from mlproject.core.errors import ConfigError


def check_labels(datamodule, largest: int, labels: str) -> None:
    """Refuse a model whose `num_classes` (its own hyperparameter, model.num_classes, or one of its parts',
    e.g. model.net.num_classes) is at most `largest`, the largest label of `labels` (what the message calls
    them). A model that names its class count otherwise, or a datamodule used without a Trainer, goes unchecked."""
    module = datamodule.trainer.lightning_module if datamodule.trainer is not None else None
    hparams = getattr(module, "hparams", {})
    counts = {"model.num_classes": hparams.get("num_classes")}
    counts |= {f"model.{k}.num_classes": v.get("num_classes") for k, v in hparams.items() if isinstance(v, Mapping)}
    for key, n in counts.items():
        if isinstance(n, int) and n <= largest:
            raise ConfigError(f"{key}={n} is too few: {labels} go up to {largest}; set {key}={largest + 1}")
