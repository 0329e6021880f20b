"""The sweeper of `hparams_search=<recipe>`: hydra-optuna-sweeper's OptunaSweeper, with a study that survives.

Its study lives in storage (by default a SQLite file in hydra.sweep.dir). Running the same sweep again (same
hydra.sweep.dir) continues it: finished trials (complete or pruned) are kept and count toward n_trials;
a trial that was running when the sweep died is marked failed, and a new trial takes its place. Trial k of
the study is Hydra job k (run directory hydra.sweep.dir/k), which is how a trial's pruning callback finds
its trial (mlproject/callbacks/pruning.py). A pruned trial tells the study itself and ends normally (exit 0).

OptunaSweeper.sweep asks, launches and tells in one method that creates the study itself and always tells a
finished trial as complete; this subclass keeps its search-space helpers and launcher, and owns the loop.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
from omegaconf import OmegaConf

from mlproject.core.constants import CONFIG_DIR
from mlproject.core.errors import ConfigError

log = logging.getLogger(__name__)


class StudySweeper(OptunaSweeper):
    def __init__(self, pruner: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pruner = pruner

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        from mlproject.callbacks.pruning import open_storage
        from mlproject.utils import compat

        State = optuna.trial.TrialState
        impl = self.sweeper
        search_space, fixed = compat.optuna_search_space(impl, arguments)
        for name in fixed:
            search_space.pop(name, None)
        check_search_space(impl.config, list(search_space))
        sweep_dir = Path(impl.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)  # the SQLite file lives there before any trial ran
        storage = open_storage(impl.storage) if impl.storage else None  # None: in memory, gone with this process
        study = optuna.create_study(
            study_name=impl.study_name,
            storage=storage,
            sampler=impl.sampler,
            pruner=self.pruner,
            directions=compat.optuna_directions(impl),
            load_if_exists=True,
        )
        for trial in study.get_trials(deepcopy=False, states=(State.RUNNING,)):
            study.tell(trial.number, state=State.FAIL)
            log.warning(f"trial {trial.number} was running when this sweep stopped: marked failed, a new trial runs")
        to_go = impl.n_trials - len(study.get_trials(deepcopy=False, states=(State.COMPLETE, State.PRUNED)))
        log.info(f"study {study.study_name} in {impl.storage}: {len(study.trials)} trials so far, {max(to_go, 0)} more")
        while to_go > 0:
            trials = [study.ask() for _ in range(min(to_go, impl.n_jobs))]
            overrides = compat.optuna_trial_overrides(impl, trials, search_space, fixed)
            # job number = trial number: the trial's callbacks find it in the study by hydra.job.num
            try:
                returns = impl.launcher.launch(overrides, initial_job_idx=trials[0].number)
            except ConfigError:  # refused before any trial started (too few devices): not left running
                for trial in trials:
                    study.tell(trial.number, state=State.FAIL)
                raise
            failures = [tell(study, storage, trial.number, ret) for trial, ret in zip(trials, returns, strict=True)]
            if sum(failures) / len(returns) > impl.max_failure_rate:
                for ret in returns:
                    ret.return_value  # noqa: B018 (raises the first failure with its traceback)
            to_go -= sum(not failed for failed in failures)
        # this process's study caches the trials it asked for: what the trials told it itself is in storage
        write_summary(optuna.load_study(study_name=study.study_name, storage=storage) if storage else study, sweep_dir)


def tell(study: Any, storage: Any, number: int, ret: Any) -> bool:
    """Record a trial's outcome, unless it recorded one itself (pruned); True if it failed."""
    from optuna.trial import TrialState as State

    if storage is not None:
        trial_id = storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(study.study_name), number
        )
        if storage.get_trial(trial_id).state != State.RUNNING:
            return False
    try:
        value = float(ret.return_value)
    except Exception as exc:  # the trial raised, or returned no metric
        log.warning(f"trial {number} failed: {exc}")
        study.tell(number, state=State.FAIL)
        return True
    study.tell(number, value)
    return False


def check_search_space(config: Any, names: list[str]) -> None:
    """Every searched key must exist in the composed config: a search space for another model is refused
    before any trial runs, naming the file to copy."""
    recipe = config.hydra.runtime.choices.get("hparams_search")
    recipes = sorted(p.stem for p in (CONFIG_DIR / "hparams_search").glob("*.yaml") if p.stem != "optuna")
    if not names:
        raise ConfigError(
            f"hparams_search={recipe} holds no search space; use hparams_search={' or '.join(recipes)}, or copy "
            f"configs/hparams_search/{recipes[0]}.yaml to configs/hparams_search/<your model>.yaml and list its keys"
        )
    absent = object()
    missing = [n for n in names if OmegaConf.select(config, n, default=absent) is absent]
    if missing:
        model = config.hydra.runtime.choices.get("model")
        raise ConfigError(
            f"hparams_search={recipe} searches {', '.join(missing)}, which model={model} does not have; copy "
            f"configs/hparams_search/{recipe}.yaml to configs/hparams_search/{model}.yaml and list its keys"
        )


def write_summary(study: Any, sweep_dir: Path) -> None:
    """summary.csv: one row per trial (number, state, value, params, run directory)."""
    from optuna.trial import TrialState as State

    trials = study.get_trials(deepcopy=False)
    names = sorted({n for t in trials for n in t.params})
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["trial", "state", "value", *names, "run_dir"])
        for t in trials:
            params = [t.params.get(n) for n in names]
            out.writerow([t.number, t.state.name, t.value, *params, sweep_dir / str(t.number)])
    finished = [t for t in trials if t.state == State.COMPLETE]
    if finished:
        log.info(f"best trial {study.best_trial.number}: {study.best_value} with {study.best_trial.params}")
    log.info(f"summary of {len(trials)} trials: {sweep_dir / 'summary.csv'}")
