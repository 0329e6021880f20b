"""Train a model: `python -m mlproject.train [hydra overrides]`. Reads top to bottom as one run."""

from __future__ import annotations

from omegaconf import DictConfig

from mlproject.config import check_monitors, data_parallel_size, hydra_entry, preflight
from mlproject.distributed.launch import launch_local_ranks


@hydra_entry("train")
def main(cfg: DictConfig) -> float | None:
    # 1. refuse impossible settings before anything heavy is imported or built
    preflight(cfg)
    launch_local_ranks(cfg)  # the other ranks of this node start now: their imports overlap with ours

    import lightning as L
    from hydra.utils import instantiate

    from mlproject.checkpoint.io import PortableCheckpointIO
    from mlproject.checkpoint.resume import resolve_ckpt_path
    from mlproject.checkpoint.state import RunState
    from mlproject.utils.instantiate import build_trainer, instantiate_all
    from mlproject.utils.logging import get_logger
    from mlproject.utils.report import apply_extras, log_hyperparameters, print_summary, write_metrics

    log = get_logger(__name__)
    apply_extras(cfg)
    if cfg.seed is not None:
        L.seed_everything(cfg.seed, workers=True)

    # 2. build: data, model, callbacks, loggers, trainer
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model, _convert_="all", _recursive_=False)
    callbacks = instantiate_all(cfg.get("callbacks"))
    check_monitors(callbacks, model)
    # + RNG states and config in checkpoints; checkpoints of any strategy and world size load
    trainer = build_trainer(cfg, [*callbacks, RunState(cfg)], plugins=(PortableCheckpointIO(),))
    # a tensor-parallel group reads one batch together: the batch divides over data-parallel ranks only
    replicas, accumulate = data_parallel_size(cfg), trainer.accumulate_grad_batches
    log.info(
        f"effective batch size {cfg.data.batch_size} = {datamodule.per_device_batch_size_for(replicas, accumulate)} "
        f"per device x {replicas} data-parallel rank(s) x {accumulate} accumulation step(s); "
        f"precision {trainer.precision}"
    )
    log_hyperparameters(cfg, model, trainer)

    # 3. fit, then test the best checkpoint
    if cfg.train:
        trainer.fit(model, datamodule=datamodule, ckpt_path=resolve_ckpt_path(cfg.ckpt_path, cfg.paths.output_dir))
    metrics = dict(trainer.callback_metrics)
    if cfg.test:
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        trainer.test(model, datamodule=datamodule, ckpt_path=best or None)
        metrics.update(trainer.callback_metrics)

    # 4. report: metrics.json in the run directory, a table, and the value a sweeper optimises
    write_metrics(metrics, cfg.paths.output_dir)
    print_summary(
        {k: float(v) for k, v in sorted(metrics.items()) if k.startswith(("val/", "test/"))},
        cfg.paths.output_dir,
    )
    value = metrics.get(cfg.get("optimized_metric"))
    return None if value is None else float(value)


if __name__ == "__main__":
    main()
