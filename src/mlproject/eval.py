"""Evaluate a checkpoint on the test split: `python -m mlproject.eval ckpt_path=... [overrides]`."""

from __future__ import annotations

from omegaconf import DictConfig

from mlproject.cli import hydra_entry, run_as_process
from mlproject.distributed.launch import launch_local_ranks
from mlproject.preflight import preflight


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Test the checkpoint `cfg.ckpt_path` (and write predictions.csv with `predict=true`); returns the
    test metrics. No Hydra inside, like `train(cfg)`."""
    launch_local_ranks(cfg, preflight(cfg))  # the other ranks of this node start now: their imports overlap

    import lightning as L
    from hydra.utils import get_class, instantiate

    from mlproject.build import build_trainer, instantiate_all
    from mlproject.callbacks.predictions import PredictionWriter
    from mlproject.checkpoint.convert import load_module
    from mlproject.utils.report import apply_extras, print_summary, write_metrics

    apply_extras(cfg)
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)

    # the architecture comes from the checkpoint's saved hyperparameters, not from cfg.model; the checkpoint
    # may be of any strategy and world size (a file, a sharded or a DeepSpeed directory)
    model = load_module(get_class(cfg.model._target_), cfg.ckpt_path)
    datamodule = instantiate(cfg.data)
    trainer = build_trainer(cfg, instantiate_all(cfg.get("callbacks")))
    trainer.test(model, datamodule=datamodule)
    values = write_metrics(trainer.callback_metrics, cfg.paths.output_dir)
    if cfg.predict:  # predictions.csv: id, label, pred of every test sample, once, in dataset order
        trainer.callbacks.append(PredictionWriter(f"{cfg.paths.output_dir}/predictions.csv"))
        trainer.predict(model, datamodule=datamodule, return_predictions=False)

    print_summary(values, cfg.paths.output_dir)
    return values


@hydra_entry("eval")
def main(cfg: DictConfig) -> dict[str, float]:
    return evaluate(cfg)


if __name__ == "__main__":
    run_as_process(main)
