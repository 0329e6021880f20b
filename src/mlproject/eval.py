"""Evaluate a checkpoint on the test split: `python -m mlproject.eval ckpt_path=... [overrides]`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mlproject.cli import hydra_entry, run_as_process
from mlproject.core.errors import ConfigError
from mlproject.distributed.launch import launch_local_ranks
from mlproject.preflight import preflight

EXAMPLE_GROUPS = ("data", "model")  # what a checkpoint's own run decides for eval
SAVED = "from_checkpoint"  # the option of each of them that is the checkpoint's own config (on_checkpoint_config)


def with_checkpoint_config(cfg: DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """`cfg` with the data and model config of the run that wrote `cfg.ckpt_path`, then `overrides` on top.

    `overrides` are the command line's (Hydra's task overrides): choosing a group (`data=text`, or an
    `experiment=` that picks both) keeps the composed group; a key (`data.test_size=100`) takes its
    composed value. A checkpoint without a saved config (or a missing path, refused by preflight) keeps `cfg`.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from mlproject.checkpoint.convert import load_full, run_config
    from mlproject.core.paths import is_url

    ckpt = str(cfg.ckpt_path)
    if not (is_url(ckpt) or Path(ckpt).exists()) or not (saved := run_config(load_full(ckpt))):
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

    from mlproject.build import build_trainer, first_batch_fits, instantiate_all, instantiate_at
    from mlproject.callbacks.predictions import PredictionWriter
    from mlproject.training.loaders import with_template_samplers
    from mlproject.utils.report import apply_extras, print_summary, write_metrics

    apply_extras(cfg)
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)

    # built as train builds it, from the checkpoint's own model config (with_checkpoint_config), then given its
    # weights; the checkpoint may be of any strategy and world size (any format of checkpoint/convert.py)
    model = instantiate_at(cfg, "model")
    load_weights(model, cfg.ckpt_path)
    datamodule = with_template_samplers(instantiate_at(cfg, "data"))  # every sample counted once
    if cfg.predict:
        check_predicts(model, datamodule)
    trainer = build_trainer(cfg, instantiate_all(cfg, "callbacks"))
    with first_batch_fits(cfg, trainer):
        trainer.test(model, datamodule=datamodule)
    values = write_metrics(trainer.callback_metrics, cfg.paths.output_dir)
    if cfg.predict:  # predictions.csv: id, label, pred of every test sample, once, in dataset order
        trainer.callbacks.append(PredictionWriter(f"{cfg.paths.output_dir}/predictions.csv"))
        trainer.predict(model, datamodule=datamodule, return_predictions=False)

    print_summary(values, cfg.paths.output_dir)
    return values


def check_predicts(model, datamodule) -> None:
    """predict=true needs what Lightning's predict loop calls, refused in one line before the test runs."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    missing = [
        f"{type(owner).__name__}.{hook}"
        for owner, hook in ((model, "predict_step"), (datamodule, "predict_dataloader"))
        if not is_overridden(hook, owner)
    ]
    if missing:
        raise ConfigError(
            f"predict=true needs {' and '.join(missing)}: predictions.csv holds what predict_step returns for each "
            "batch, {'target': labels, 'pred': predictions} (as models/classifier.py's), over predict_dataloader's "
            "samples (the template's DataModule: the test split); add them, or drop predict=true"
        )


def load_weights(model, ckpt_path: str) -> None:
    """The checkpoint's weights into `model` (the EMA where the run kept one); one that does not fit is refused
    in one line."""
    from mlproject.checkpoint.convert import averaged, check_fits, load_full

    state_dict = averaged(load_full(ckpt_path)["state_dict"])
    check_fits(state_dict, model, ckpt_path)
    model.load_state_dict(state_dict)


def on_checkpoint_config(args: list[str]) -> list[str]:
    """`args` choosing `data=from_checkpoint` (`model=` alike) where they set a key of that group and no option of
    it (or an experiment): Hydra then composes the checkpoint's own data config, stored under that name in its
    ConfigStore, and checks the keys against it, so that a key only the user's datamodule has is found and a
    misspelled one refused as in train. Where they choose it already (a local rank's command line), it is stored."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from mlproject.checkpoint.convert import load_full, run_config

    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except HydraException:  # Hydra says what is wrong with the line in its own words
        return args
    keys = {o.key_or_group: o for o in parsed}
    choose = [
        g for g in EXAMPLE_GROUPS if any(k.startswith(f"{g}.") for k in keys) and not keys.keys() & {g, "experiment"}
    ]
    chosen = [g for g in EXAMPLE_GROUPS if g in keys and keys[g].value() == SAVED]
    if not (choose or chosen) or "ckpt_path" not in keys:
        return args
    try:
        saved = run_config(load_full(str(keys["ckpt_path"].value())))
    except Exception:  # noqa: BLE001 (missing, unreadable: the run refuses it in one line, with the config it has)
        return args
    groups = [g for g in (*choose, *chosen) if saved and g in saved]
    for group in groups:
        ConfigStore.instance().store(group=group, name=SAVED, node=saved[group])
    return [*args, *(f"{g}={SAVED}" for g in choose if g in groups)]


@hydra_entry("eval")
def evaluate_checkpoint(cfg: DictConfig) -> dict[str, float]:
    from hydra.core.hydra_config import HydraConfig

    # The merge happens here, where the command line is known: the checkpoint's data and model are the
    # base, and what the user typed for them (Hydra's task overrides) is applied on top.
    return evaluate(with_checkpoint_config(cfg, HydraConfig.get().overrides.task))


def main() -> dict[str, float]:
    sys.argv[1:] = on_checkpoint_config(sys.argv[1:])
    return evaluate_checkpoint()


if __name__ == "__main__":
    run_as_process(main)
