"""Train a model: `python -m mlproject.train [hydra overrides]`. `train(cfg)` reads top to bottom as one run."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from mlproject.cli import hydra_entry, run_as_process
from mlproject.distributed.launch import launch_local_ranks
from mlproject.preflight import preflight


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and test the model of a composed train config; returns the final metrics. No Hydra inside: call
    it from Python with a config from `hydra.compose` (one process), or through `main` (any strategy)."""
    # 1. refuse impossible settings before anything heavy is imported or built
    topology = preflight(cfg)
    launch_local_ranks(cfg, topology)  # the other ranks of this node start now: their imports overlap with ours

    import lightning as L

    from mlproject.build import build_trainer, first_batch_fits, instantiate_all, instantiate_at
    from mlproject.callbacks.monitors import MonitorsAgree
    from mlproject.checkpoint.resume import checkpoint_to_test, resolve_ckpt_path
    from mlproject.checkpoint.state import RunState
    from mlproject.checkpoint.storage import PortableCheckpointIO
    from mlproject.loggers import finish_loggers
    from mlproject.training.loaders import with_template_samplers
    from mlproject.utils.rank_logging import get_logger
    from mlproject.utils.report import apply_extras, log_hyperparameters, log_outcome, print_summary, write_metrics

    log = get_logger(__name__)
    apply_extras(cfg)
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)

    # 2. build: data, model, callbacks, loggers, trainer
    # exact batches on any world size; with seed_batches, random augmentation resumed exactly too
    datamodule = with_template_samplers(instantiate_at(cfg, "data"), cfg.seed_batches)
    model = instantiate_at(cfg, "model")  # as Hydra builds it: nested _target_s too, unless the yaml says otherwise
    callbacks = instantiate_all(cfg, "callbacks")
    # + a check that monitors agree across ranks, RNG states and config in checkpoints; checkpoints of any
    # strategy and world size load
    callbacks = [*callbacks, MonitorsAgree(callbacks), RunState(cfg)]
    trainer = build_trainer(cfg, callbacks, plugins=(PortableCheckpointIO(model),))
    # a tensor-parallel group reads one batch together: the batch divides over data-parallel ranks only (a plain
    # LightningDataModule's batch_size is per device: configure_optimizers of the examples logs the effective one)
    if topology.global_batch_size is not None:
        log.info(
            f"effective batch size {cfg.data.batch_size} = {topology.per_device_batch_size} per device x "
            f"{topology.data_parallel_size} data-parallel rank(s) x {topology.accumulate} accumulation step(s); "
            f"precision {trainer.precision}"
        )
    else:
        log.info(f"precision {trainer.precision}")
    log_hyperparameters(cfg, model, trainer)

    # 3. fit, then test the best checkpoint
    if cfg.train:
        with first_batch_fits(cfg, trainer):
            ckpt_dir = trainer.checkpoint_callback.dirpath if trainer.checkpoint_callback else None
            ckpt_path = resolve_ckpt_path(cfg.ckpt_path, cfg.paths.output_dir, ckpt_dir)
            trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = dict(trainer.callback_metrics)
    best, why = checkpoint_to_test(trainer)
    if cfg.test and not any(getattr(c, "pruned", False) for c in callbacks):  # a pruned sweep trial: no test
        log.info(f"testing {best or 'the model'}: {why}")
        trainer.test(model, datamodule=datamodule, ckpt_path=best)
        metrics.update(trainer.callback_metrics)

    # 4. report: metrics.json in the run directory, a table, and the outcome to every logger
    write_metrics(metrics, cfg.paths.output_dir)
    final = {k: float(v) for k, v in sorted(metrics.items())}
    print_summary({k: v for k, v in final.items() if k.startswith(("val/", "test/"))}, cfg.paths.output_dir)
    log_outcome(cfg, trainer, final, best or "")
    finish_loggers(trainer.loggers)
    return final


@hydra_entry("train")
def main(cfg: DictConfig) -> float | None:
    """Hydra's entry: the value returned is what a sweeper optimises."""
    return train(cfg).get(cfg.get("optimized_metric"))


if __name__ == "__main__":
    from mlproject.checkpoint.resume import continue_run_of_checkpoint

    continue_run_of_checkpoint(sys.argv[1:])  # ckpt_path=<another run's checkpoint>: continue in its directory
    run_as_process(main)
