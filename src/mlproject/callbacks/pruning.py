"""Optuna pruning that works under every strategy: rank 0 judges, every rank stops at the same validation."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer

from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


class Pruning(Callback):
    """At the end of each validation, rank 0 reports `monitor` to its Optuna trial and asks the study's pruner;
    the answer is broadcast once (every rank calls this hook, so the collective matches), and all ranks stop
    together. The pruned trial is told as pruned in the study by rank 0, skips its test and exits 0.

    Outside a `hparams_search` sweep (a plain run, the trial's other local ranks) it only takes part in the
    broadcast. The trial is Hydra job number k of the sweep (hydra_plugins/mlproject_sweeper keeps them equal)."""

    def __init__(self, monitor: str) -> None:
        self.monitor = monitor
        self.pruned = False
        self._trial = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            self._trial = current_trial()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        if self._trial is not None and self.monitor in trainer.callback_metrics:
            self._trial.report(float(trainer.callback_metrics[self.monitor]), trainer.global_step)
            prune = self._trial.should_prune()
        if trainer.strategy.broadcast(prune, src=0):
            self.pruned = trainer.should_stop = True
            step = trainer.global_step
            log.info(f"trial pruned at step {step}: {self.monitor} worse than the pruner's bar", all_ranks=True)
            if self._trial is not None:
                import optuna

                self._trial.study.tell(self._trial.number, state=optuna.trial.TrialState.PRUNED)


def current_trial():
    """This Hydra job's trial in the sweep's Optuna study, or None outside a StudySweeper sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    if not HydraConfig.initialized() or HydraConfig.get().mode.name != "MULTIRUN":
        return None
    hc = HydraConfig.get()
    sweeper = hc.sweeper
    if "pruner" not in sweeper or not sweeper.storage:  # another sweeper, or a study in the sweep's memory
        return None
    import optuna

    storage = optuna.storages.RDBStorage(sweeper.storage)
    study_id = storage.get_study_id_from_name(sweeper.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, hc.job.num)
    study = optuna.load_study(study_name=sweeper.study_name, storage=storage, pruner=instantiate(sweeper.pruner))
    return optuna.trial.Trial(study, trial_id)
