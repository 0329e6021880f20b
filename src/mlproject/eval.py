"""Evaluate a checkpoint on the test split: `python -m mlproject.eval ckpt_path=... [overrides]`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mlproject.cli import hydra_entry, run_as_process
from mlproject.distributed.launch import launch_local_ranks
from mlproject.preflight import preflight

EXAMPLE_GROUPS = ("data", "model")  # what a checkpoint's own run decides for eval


def with_checkpoint_config(cfg: DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """`cfg` with the data and model config of the run that wrote `cfg.ckpt_path`, then `overrides` on top.

    `overrides` are the command line's (Hydra's task overrides): choosing a group (`data=text`, or an
    `experiment=` that picks both) keeps the composed group; a key (`data.test_size=100`) takes its
    composed value. A checkpoint without a saved config (or a missing path, refused by preflight) keeps `cfg`.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from mlproject.checkpoint.convert import is_remote, load_full, run_config

    ckpt = str(cfg.ckpt_path)
    if not (is_remote(ckpt) or Path(ckpt).exists()) or not (saved := run_config(load_full(ckpt))):
        return cfg
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    chosen = {o.key_or_group for o in parsed}
    merged = cfg.copy()
    for group in EXAMPLE_GROUPS:
        if group in saved and not chosen & {group, "experiment"}:
            merged[group] = saved[group]
    for o in parsed:
        key = o.key_or_group
        if key.split(".")[0] not in EXAMPLE_GROUPS or "." not in key:
            continue
        if o.is_delete():  # ~data.key
            parent, _, leaf = key.rpartition(".")
            OmegaConf.select(merged, parent).pop(leaf, None)
        else:
            OmegaConf.update(merged, key, OmegaConf.select(cfg, key), force_add=True)
    return merged


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Test the checkpoint `cfg.ckpt_path` (and write predictions.csv with `predict=true`); returns the
    test metrics. No Hydra inside, like `train(cfg)`: it evaluates the config it is given, so from Python
    pass `with_checkpoint_config(cfg)` to use the checkpoint's data and model as `make eval` does."""
    launch_local_ranks(cfg, preflight(cfg))  # the other ranks of this node start now: their imports overlap

    import lightning as L
    from hydra.utils import get_class

    from mlproject.build import build_trainer, first_batch_fits, instantiate_all, instantiate_at
    from mlproject.callbacks.predictions import PredictionWriter
    from mlproject.checkpoint.convert import load_module
    from mlproject.training.loaders import with_template_samplers
    from mlproject.utils.report import apply_extras, print_summary, write_metrics

    apply_extras(cfg)
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)

    # the architecture comes from the checkpoint's saved hyperparameters, not from cfg.model; the checkpoint
    # may be of any strategy and world size (a file, a sharded or a DeepSpeed directory)
    model = load_module(get_class(cfg.model._target_), cfg.ckpt_path)
    datamodule = with_template_samplers(instantiate_at(cfg, "data"))  # every sample counted once
    trainer = build_trainer(cfg, instantiate_all(cfg, "callbacks"))
    with first_batch_fits(cfg, trainer):
        trainer.test(model, datamodule=datamodule)
    values = write_metrics(trainer.callback_metrics, cfg.paths.output_dir)
    if cfg.predict:  # predictions.csv: id, label, pred of every test sample, once, in dataset order
        trainer.callbacks.append(PredictionWriter(f"{cfg.paths.output_dir}/predictions.csv"))
        trainer.predict(model, datamodule=datamodule, return_predictions=False)

    print_summary(values, cfg.paths.output_dir)
    return values


@hydra_entry("eval")
def main(cfg: DictConfig) -> dict[str, float]:
    from hydra.core.hydra_config import HydraConfig

    # The merge happens here, where the command line is known: the checkpoint's data and model are the
    # base, and what the user typed for them (Hydra's task overrides) is applied on top.
    return evaluate(with_checkpoint_config(cfg, HydraConfig.get().overrides.task))


if __name__ == "__main__":
    run_as_process(main)
