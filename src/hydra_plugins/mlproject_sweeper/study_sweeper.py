"""The sweeper of `hparams_search=<recipe>`: an Optuna study driven by ask-and-tell, with a study that survives.

Its study lives in storage (by default a SQLite file in hydra.sweep.dir). Running the same sweep again (same
hydra.sweep.dir) continues it: finished trials (complete or pruned) are kept and count toward n_trials;
a trial that was running when the sweep died is marked failed, and a new trial takes its place. Trial k of
the study is Hydra job k (run directory hydra.sweep.dir/k), which is how a trial's pruning callback finds
its trial (mlproject/callbacks/pruning.py). A pruned trial tells the study itself and ends normally (exit 0).

The search space is `params` and the command line's sweeps, in hydra-optuna-sweeper's grammar:
`choice(a, b)` or `a,b` (categorical), `range(a, b[, step])` (ints or floats on a grid, b included),
`interval(a, b)` (uniform floats) and `tag(log, interval(a, b))` (log-uniform). Any other
override is passed to every trial as given; a later one for the same key replaces an earlier one.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer, ValueType
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from mlproject.core.constants import CONFIG_DIR
from mlproject.core.errors import ConfigError

log = logging.getLogger(__name__)


class StudySweeper(Sweeper):
    def __init__(
        self,
        sampler: Any,
        pruner: Any,
        direction: str | list[str],
        storage: str | None,
        study_name: str,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        params: DictConfig | None = None,
        custom_search_space: str | None = None,
    ) -> None:
        self.sampler, self.pruner, self.storage, self.study_name = sampler, pruner, storage, study_name
        self.directions = [direction] if isinstance(direction, str) else list(direction)
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.params = params or {}
        self.custom_search_space = custom_search_space

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        import optuna
        from hydra.utils import get_method

        State = optuna.trial.TrialState
        search_space, fixed = parse_overrides([*(f"{k}={v}" for k, v in self.params.items()), *arguments])
        extend = get_method(self.custom_search_space) if self.custom_search_space else None
        check_search_space(self.config, list(search_space), extended=extend is not None)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)  # the SQLite file lives there before any trial ran
        # an object, not the URL: tell() asks it whether a trial recorded its own outcome; None: in this process only
        storage = optuna.storages.RDBStorage(self.storage) if self.storage else None
        study = optuna.create_study(
            study_name=self.study_name,
            storage=storage,
            sampler=self.sampler,
            pruner=self.pruner,
            directions=self.directions,
            load_if_exists=True,
        )
        for trial in study.get_trials(deepcopy=False, states=(State.RUNNING,)):
            study.tell(trial.number, state=State.FAIL)
            log.warning(f"trial {trial.number} was running when this sweep stopped: marked failed, a new trial runs")
        to_go = self.n_trials - len(study.get_trials(deepcopy=False, states=(State.COMPLETE, State.PRUNED)))
        log.info(f"study {study.study_name} in {self.storage}: {len(study.trials)} trials so far, {max(to_go, 0)} more")
        while to_go > 0:
            trials = [study.ask(search_space) for _ in range(min(to_go, self.n_jobs))]
            if extend:
                for trial in trials:
                    extend(self.config, trial)  # suggests more parameters on the trial itself
            overrides = [[*(f"{k}={v}" for k, v in t.params.items()), *fixed.values()] for t in trials]
            # job number = trial number: the trial's callbacks find it in the study by hydra.job.num
            try:
                returns = self.launcher.launch(overrides, initial_job_idx=trials[0].number)
            except ConfigError:  # refused before any trial started (too few devices): not left running
                for trial in trials:
                    study.tell(trial.number, state=State.FAIL)
                raise
            failures = [tell(study, storage, trial.number, ret) for trial, ret in zip(trials, returns, strict=True)]
            if sum(failures) / len(returns) > self.max_failure_rate:
                for ret in returns:
                    ret.return_value  # noqa: B018 (raises the first failure with its traceback)
            to_go -= len(returns)  # a failed trial counts: a sweep whose every trial fails (no metric) ends
        # this process's study caches the trials it asked for: what the trials told it itself is in storage
        write_summary(optuna.load_study(study_name=study.study_name, storage=storage) if storage else study, sweep_dir)


def parse_overrides(lines: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(search space: key -> Optuna distribution, fixed: key -> override line) of sweep overrides, in order."""
    search_space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.get_key_element()
        search_space.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            search_space[key] = distribution(override)
        else:
            fixed[key] = override.input_line
    return search_space, fixed


def distribution(override: Override) -> Any:
    """The Optuna distribution of one sweep override (hydra-optuna-sweeper's mapping)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    sweep = override.value()
    allowed_tags = {"log"} if override.is_interval_sweep() else set()
    if override.value_type == ValueType.GLOB_CHOICE_SWEEP or sweep.tags - allowed_tags:
        raise ConfigError(
            f"{override.input_line}: the study sweeper takes choice(a, b), a,b, range(a, b[, step]), interval(a, b) "
            "or tag(log, interval(a, b)); write it as one of these"
        )
    try:
        if override.is_choice_sweep() or (override.is_range_sweep() and sweep.shuffle):
            # lists and dicts come encoded as override strings ("[1,2]"), as the trial's override needs them
            return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
        if override.is_range_sweep():  # hydra-optuna-sweeper's range includes its end, unlike Hydra's
            if all(isinstance(x, int) for x in (sweep.start, sweep.stop, sweep.step)):
                return IntDistribution(sweep.start, sweep.stop, step=sweep.step)
            return FloatDistribution(sweep.start, sweep.stop, step=sweep.step)
        return FloatDistribution(sweep.start, sweep.end, log="log" in sweep.tags)  # Hydra's interval is float
    except ValueError as exc:  # Optuna's refusals: low > high, a log bound <= 0
        raise ConfigError(f"{override.input_line}: {exc}") from None


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
        value = ret.return_value
        values = [float(v) for v in value] if len(study.directions) > 1 else float(value)
    except Exception as exc:  # the trial raised, or returned no metric
        log.warning(f"trial {number} failed: {exc}")
        study.tell(number, state=State.FAIL)
        return True
    study.tell(number, values)
    return False


def check_search_space(config: Any, names: list[str], extended: bool = False) -> None:
    """Every searched key must exist in the composed config: a search space for another model is refused
    before any trial runs, naming the file to copy. `extended`: custom_search_space adds the rest."""
    recipe = config.hydra.runtime.choices.get("hparams_search")
    recipes = sorted(p.stem for p in (CONFIG_DIR / "hparams_search").glob("*.yaml") if p.stem != "optuna")
    if not names and not extended:
        raise ConfigError(
            f"hparams_search={recipe} holds no search space; use hparams_search={' or '.join(recipes)}, or copy "
            f"configs/hparams_search/{recipes[0]}.yaml to configs/hparams_search/<your model>.yaml and list its keys"
        )
    absent = object()
    # +key adds a key the config lacks
    missing = [n for n in names if n[0] != "+" and OmegaConf.select(config, n, default=absent) is absent]
    if missing:
        model = config.hydra.runtime.choices.get("model")
        raise ConfigError(
            f"hparams_search={recipe} searches {', '.join(missing)}, which model={model} does not have; copy "
            f"configs/hparams_search/{recipe}.yaml to configs/hparams_search/{model}.yaml and list its keys"
        )


def write_summary(study: Any, sweep_dir: Path) -> None:
    """summary.csv: one row per trial (number, state, value(s), params, run directory)."""
    trials = study.get_trials(deepcopy=False)
    names = sorted({n for t in trials for n in t.params})
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["trial", "state", "value", *names, "run_dir"])
        for t in trials:
            value = t.values[0] if t.values and len(t.values) == 1 else t.values
            out.writerow([t.number, t.state.name, value, *(t.params.get(n) for n in names), sweep_dir / str(t.number)])
    for best in study.best_trials:  # complete trials only
        log.info(f"best trial {best.number}: {best.values} with {best.params}")
    log.info(f"summary of {len(trials)} trials: {sweep_dir / 'summary.csv'}")
