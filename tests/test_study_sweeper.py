"""The study sweeper's override grammar maps onto Optuna's distributions as hydra-optuna-sweeper's did, and its
ask-and-tell loop launches, tells and continues a study (a stand-in launcher: no training)."""

from __future__ import annotations

import csv
import re

import optuna
import pytest
from hydra_plugins.mlproject_sweeper.study_sweeper import StudySweeper, parse_overrides
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from mlproject.core.errors import ConfigError


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("x=range(1,4)", IntDistribution(1, 4)),  # the end included, unlike Hydra's own range
        ("x=range(0,10,5)", IntDistribution(0, 10, step=5)),
        ("x=range(0.1,0.5,0.1)", FloatDistribution(0.1, 0.5, step=0.1)),
        ("x=interval(0, 1)", FloatDistribution(0.0, 1.0)),
        ("x=interval(1, 8)", FloatDistribution(1.0, 8.0)),  # Hydra's interval is a float one
        ("x=tag(log, interval(1e-4, 1e-1))", FloatDistribution(1e-4, 0.1, log=True)),
        ("x=choice(16, 32, 64)", CategoricalDistribution([16, 32, 64])),
        ("x=adam,sgd", CategoricalDistribution(["adam", "sgd"])),
        ("x=choice([1,2],[3])", CategoricalDistribution(["[1,2]", "[3]"])),  # as the trial's override writes them
    ],
)
def test_each_sweep_form_is_its_optuna_distribution(line, expected):
    assert parse_overrides([line]) == ({"x": expected}, {})


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("model=glob(*)", "model=glob(*): the study sweeper takes choice(a, b), a,b, range(a, b[, step]), "),
        ("x=tag(lg, interval(1, 2))", "x=tag(lg, interval(1, 2)): the study sweeper takes "),
        ("x=tag(log, range(1, 4))", "x=tag(log, range(1, 4)): the study sweeper takes "),
        ("x=interval(3, 1)", "x=interval(3, 1): `low <= high` must hold"),
        ("x=tag(log, interval(0, 1))", "x=tag(log, interval(0, 1)): `low > 0` must hold for `log=True`"),
    ],
)
def test_an_unsupported_form_is_one_line_naming_it(line, says):
    with pytest.raises(ConfigError) as err:
        parse_overrides([line])
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_a_later_override_replaces_an_earlier_one_and_others_pass_through():
    search_space, fixed = parse_overrides(["lr=interval(0.1, 1)", "n=1,2", "lr=0.5", "~logger", "++a.b='x,y'", "n=3,4"])
    assert search_space == {"n": CategoricalDistribution([3, 4])}
    assert fixed == {"lr": "lr=0.5", "~logger": "~logger", "++a.b": "++a.b='x,y'"}


class Returned:
    def __init__(self, value):
        self.value = value

    @property
    def return_value(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


class Launcher:
    """Each job returns x * 10 + n (or what `values` computes); records what it was asked to launch."""

    def __init__(self, values=None):
        self.batches, self.values = [], values or (lambda p: float(p["x"]) * 10 + float(p.get("n", 0)))

    def launch(self, overrides, initial_job_idx):
        self.batches.append((initial_job_idx, [list(o) for o in overrides]))
        return [Returned(self.values(dict(o.split("=", 1) for o in job if "=" in o))) for job in overrides]


def sweeper(tmp_path, launcher, params, n_trials=4, n_jobs=2, **kwargs):
    config = OmegaConf.create(
        {
            "hydra": {"sweep": {"dir": str(tmp_path)}, "runtime": {"choices": {"hparams_search": "t", "model": "m"}}},
            "x": 0,
            "n": 0,
        }
    )
    kwargs = {"direction": "maximize", "storage": f"sqlite:///{tmp_path}/study.db", **kwargs}
    s = StudySweeper(
        sampler=optuna.samplers.RandomSampler(seed=3),
        pruner=None,
        study_name="sweep",
        n_trials=n_trials,
        n_jobs=n_jobs,
        max_failure_rate=1.0,
        params=OmegaConf.create(params),
        **kwargs,
    )
    s.config, s.launcher = config, launcher
    return s


def test_trials_run_in_batches_of_n_jobs_with_their_job_number_and_the_range_end(tmp_path):
    launcher = Launcher()
    sweeper(tmp_path, launcher, {"x": "range(1,4)"}, n_trials=8, n_jobs=3).sweep(["~logger", "trainer=cpu"])
    assert [(start, len(jobs)) for start, jobs in launcher.batches] == [(0, 3), (3, 3), (6, 2)]
    jobs = [job for _, batch in launcher.batches for job in batch]
    assert {job[0] for job in jobs} == {"x=1", "x=2", "x=3", "x=4"}
    assert all(job[1:] == ["~logger", "trainer=cpu"] for job in jobs)
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [(r["trial"], r["state"], float(r["value"])) for r in rows] == [
        (str(n), "COMPLETE", float(job[0][2:]) * 10) for n, job in enumerate(jobs)
    ]
    assert rows[0]["run_dir"] == str(tmp_path / "0")


def test_failed_trials_count_so_a_sweep_of_failures_ends_and_a_rerun_runs_what_did_not_finish(tmp_path):
    """A trial that returns no metric (e.g. optimized_metric names one the model never logs) is told failed and
    takes its place in n_trials, so the sweep ends. Run again, the study runs the trials it has not finished."""
    sweeper(tmp_path, Launcher(lambda p: RuntimeError("no metric")), {"x": "range(1,3)"}, n_trials=2).sweep([])
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{tmp_path}/study.db")
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]
    sweeper(tmp_path, Launcher(), {"x": "range(1,3)"}, n_trials=3, n_jobs=1).sweep([])
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{tmp_path}/study.db")
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL", "COMPLETE", "COMPLETE", "COMPLETE"]


def test_log_interval_trials_stay_in_bounds_and_a_fixed_key_leaves_the_search_space(tmp_path):
    launcher = Launcher(lambda p: float(p["x"]))
    sweeper(tmp_path, launcher, {"x": "tag(log, interval(1e-4, 1e-1))", "n": "choice(1, 2)"}).sweep(["n=7"])
    jobs = [job for _, batch in launcher.batches for job in batch]
    assert all(re.fullmatch(r"x=\S+", job[0]) and 1e-4 <= float(job[0][2:]) <= 0.1 for job in jobs)
    assert all(job[1:] == ["n=7"] for job in jobs)


def extend(cfg, trial):
    trial.suggest_int("n", 5, 5 + cfg.n)


def test_custom_search_space_and_two_directions(tmp_path):
    launcher = Launcher(lambda p: [float(p["x"]), -float(p["n"])])
    kwargs = {"custom_search_space": f"{__name__}.extend", "direction": ["maximize", "minimize"]}
    sweeper(tmp_path, launcher, {"x": "1,2"}, n_trials=6, **kwargs).sweep([])
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{tmp_path}/study.db")
    assert len(study.trials) == 6
    assert all(t.params["n"] == 5 and t.values == [t.params["x"], -5.0] for t in study.trials)
    assert all(job[1] == "n=5" for _, batch in launcher.batches for job in batch)  # the trial's override too


def test_a_search_space_with_no_searched_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="hparams_search=t holds no search space"):
        sweeper(tmp_path, Launcher(), {"x": 1}).sweep([])
    with pytest.raises(ConfigError, match="hparams_search=t searches y, which model=m does not have"):
        sweeper(tmp_path, Launcher(), {"y": "1,2"}).sweep([])
