"""Every trial of a sweep is its own run (its own directory, W&B and MLflow runs, ranks); studies survive and prune."""

from __future__ import annotations

import contextlib
import csv
import os
import re
import subprocess
from pathlib import Path

import pytest
from lightning.pytorch import Callback

from mlproject.core.constants import PROJECT_ROOT
from mlproject.core.errors import ConfigError
from tests.data.folds import check_folds
from tests.helpers.processes import PIPES, PYTHON, clean_env, kill_group, read_metrics, run

SHORT = [f"trainer.limit_{s}_batches=2" for s in ("train", "val", "test")]  # hparams_search=<recipe> implies -m


@pytest.mark.slow
def test_optuna_trials_are_separate_wandb_and_mlflow_runs(tmp_path):
    sweep = ["hparams_search=digits", "hydra.sweeper.n_trials=2", "logger=many", "run_id=sweep"]
    run("train", *sweep, "trainer=cpu", "trainer.max_epochs=1", *SHORT, "extras.print_config=false", log_dir=tmp_path)
    trials = [tmp_path / "train" / "multiruns" / "sweep" / str(n) for n in (0, 1)]
    logs = [(t / "wandb" / "debug.log").read_text() for t in trials]
    for n, log in enumerate(logs):
        assert f"finishing run mlproject/train-sweep-{n}" in log  # its own id, finished by train()
    finished = re.search(r"^(\S+ \S+) .*finishing run", logs[0], flags=re.M).group(1)
    started = re.match(r"(\S+ \S+)", logs[1]).group(1)
    assert finished < started  # trial 0's run ended before trial 1's began

    from mlflow.tracking import MlflowClient

    runs = []
    for n, trial in enumerate(trials):
        client = MlflowClient(f"sqlite:///{trial}/mlflow/mlflow.db")
        (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert found.info.run_name == f"train-sweep-{n}" and found.info.status == "FINISHED"
        runs.append(found.info)
    assert runs[0].end_time <= runs[1].start_time


TINY = ["trainer=cpu", "trainer.max_epochs=1", *[f"++trainer.limit_{s}_batches=2" for s in ("train", "val", "test")]]


def study(sweep_dir):
    import optuna

    return optuna.load_study(study_name="sweep", storage=f"sqlite:///{sweep_dir}/study.db")


@pytest.mark.slow
def test_ddp_trials_of_a_multirun_each_start_their_ranks(tmp_path):
    """`-m strategy=ddp trainer.devices=2 lr=a,b`: each trial starts its own second rank (its own command, not
    the sweep's), one run directory per trial holds both ranks' logs, and the trials differ by their lr."""
    sweep = ["hydra.mode=MULTIRUN", "strategy=ddp", "trainer.devices=2", "model.optimizer.lr=0.002,0.02", "run_id=ddp"]
    run("train", *sweep, *TINY, "extras.print_config=false", log_dir=tmp_path, timeout=400)
    trials = [tmp_path / "train" / "multiruns" / "ddp" / str(n) for n in (0, 1)]
    assert sorted(p.name for p in trials[0].parent.iterdir() if p.is_dir()) == ["0", "1"]  # no third trial
    for trial, lr in zip(trials, ("0.002", "0.02"), strict=True):
        assert f"model.optimizer.lr={lr}" in (trial / ".hydra" / "overrides.yaml").read_text()
        assert "x 2 data-parallel rank(s)" in (trial / "train.log").read_text()
        assert (trial / "train_ddp_process_1.log").exists()  # rank 1 wrote into this trial's directory
        assert read_metrics(trial)["test/acc"] >= 0
    assert read_metrics(trials[0]) != read_metrics(trials[1])


@pytest.mark.slow
def test_a_ddp_trial_whose_rank_dies_fails_alone(tmp_path):
    """Rank 1 SIGKILLed in every trial: each trial reports it and fails, the next trial still starts its own
    ranks, and the sweep ends non-zero long before the collective timeout (300 s)."""
    kill = ["+callbacks.kill._target_=tests.helpers.callbacks.KillAt", "+callbacks.kill.step=1"]
    kill += ["+callbacks.kill.rank=1", "strategy.timeout=300"]
    sweep = ["hydra.mode=MULTIRUN", "strategy=ddp", "trainer.devices=2", "model.optimizer.lr=0.002,0.005"]
    sweep += ["run_id=dies", "~logger", "extras.print_config=false"]
    proc = run("train", *sweep, *kill, *TINY, log_dir=tmp_path, check=False, timeout=200)
    assert proc.returncode != 0
    assert proc.stderr.count("error: local rank 1") == 2, proc.stderr[-3000:]
    for n in ("0", "1"):
        assert "x 2 data-parallel rank(s)" in (tmp_path / "train" / "multiruns" / "dies" / n / "train.log").read_text()


@pytest.mark.slow
def test_a_failed_trial_is_reported_and_the_sweep_goes_on(tmp_path):
    """Trial 0 is refused (lr=0): one line names it, trial 1 still trains; the sweep then exits non-zero."""
    sweep = ["hydra.mode=MULTIRUN", "model.optimizer.lr=0,0.005", "run_id=fail", "~logger"]
    proc = run("train", *sweep, *TINY, "extras.print_config=false", log_dir=tmp_path, check=False)
    assert proc.returncode == 2
    assert re.search(r"^error: trial 0: model.optimizer.lr=0 .*", proc.stderr, flags=re.M), proc.stderr[-2000:]
    trials = tmp_path / "train" / "multiruns" / "fail"
    assert not (trials / "0" / "metrics.json").exists() and read_metrics(trials / "1")["test/acc"] >= 0


class RecordDevices(Callback):
    """Each rank writes the CUDA_VISIBLE_DEVICES it runs with into its trial's directory."""

    def setup(self, trainer, pl_module, stage):
        from hydra.core.hydra_config import HydraConfig

        out = Path(HydraConfig.get().runtime.output_dir) / f"devices_{trainer.global_rank}.txt"
        out.write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))


@pytest.mark.slow
def test_two_ddp_trials_side_by_side_on_disjoint_devices(tmp_path):
    """hydra/launcher=local with n_jobs=2 and trainer.devices=2 of 4 visible devices: the two trials of a batch
    train at the same time, each a process tree of its own with its own run directory, both ranks of trial k
    see devices 2k and 2k+1 only, and both trials reach the study."""
    from datetime import datetime

    sweep = ["hparams_search=digits", "hydra/launcher=local", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2"]
    sweep += ["strategy=ddp", "trainer.devices=2", "run_id=side", "~logger", "extras.print_config=false"]
    sweep += [f"+callbacks.devices._target_={__name__}.RecordDevices"]
    run("train", *sweep, *TINY, log_dir=tmp_path, timeout=400, env=clean_env(CUDA_VISIBLE_DEVICES="0,1,2,3"))
    sweep_dir = tmp_path / "train" / "multiruns" / "side"
    for k in (0, 1):
        seen = [(sweep_dir / str(k) / f"devices_{rank}.txt").read_text() for rank in (0, 1)]
        assert seen == [f"{2 * k},{2 * k + 1}"] * 2
    spans = []
    for n in ("0", "1"):
        stamps = re.findall(r"^\[([\d-]+ [\d:,]+)\]", (sweep_dir / n / "train.log").read_text(), flags=re.M)
        spans.append([datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t in (stamps[0], stamps[-1])])
    assert max(start for start, _ in spans) < min(end for _, end in spans)  # both ran at once
    assert [t.state.name for t in study(sweep_dir).trials] == ["COMPLETE", "COMPLETE"]


def test_trials_needing_more_devices_than_visible_are_refused_before_any_starts(tmp_path):
    """3 visible devices, 2 trials at once of 2 devices each: one line names the fix; no trial directory."""
    sweep = ["hparams_search=digits", "hydra/launcher=local", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2"]
    sweep += ["strategy=ddp", "trainer.devices=2", "run_id=many", "~logger", "extras.print_config=false"]
    env = clean_env(CUDA_VISIBLE_DEVICES="0,1,2")
    proc = run("train", *sweep, *TINY, log_dir=tmp_path, check=False, env=env)
    assert proc.returncode != 0
    line = "error: 2 trials at once need 4 devices (trainer.devices=2+2) but 3 are visible (0,1,2); lower "
    assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-2000:]
    sweep_dir = tmp_path / "train" / "multiruns" / "many"
    assert not [p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()]
    assert [t.state.name for t in study(sweep_dir).trials] == ["FAIL", "FAIL"]  # none left running


def test_devices_are_split_into_consecutive_disjoint_slices():
    from hydra_plugins.mlproject_sweeper.local_launcher import split_devices

    assert split_devices(["0", "1", "2", "3"], [2, 2]) == ["0,1", "2,3"]
    assert split_devices(["4", "6", "7"], [1, 2]) == ["4", "6,7"]
    with pytest.raises(ConfigError, match="2 trials at once need 5 devices"):
        split_devices(["0", "1", "2", "3"], [2, 3])


@pytest.mark.slow
def test_a_killed_sweep_continues_its_study(tmp_path):
    """Killed while its third trial runs, the same command again ends with exactly 4 finished trials; the
    first two are kept as they were, the one that was running is marked failed and run anew."""
    import sqlite3
    import time

    cmd = [PYTHON, "-m", "mlproject.train", f"paths.log_dir={tmp_path}", "hparams_search=digits"]
    cmd += ["hydra.sweeper.n_trials=4", "run_id=study", "extras.print_config=false", "~logger", *TINY]
    cmd += ["hydra.sweeper.pruner.n_startup_trials=10"]  # no pruning: every trial completes
    sweep_dir = tmp_path / "train" / "multiruns" / "study"
    with subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=clean_env(), start_new_session=True, **PIPES) as first:
        try:
            while first.poll() is None:  # until trial 2 runs, then kill the whole sweep
                with contextlib.suppress(sqlite3.Error, FileNotFoundError):
                    db = sqlite3.connect(f"file:{sweep_dir / 'study.db'}?mode=ro", uri=True)
                    with contextlib.closing(db):
                        if db.execute("select count(*) from trials").fetchone()[0] >= 3:
                            break
                time.sleep(0.2)
        finally:
            kill_group(first.pid)
    assert first.wait() != 0, first.stderr.read()[-2000:]
    before = [(t.number, t.state.name, t.value, t.params) for t in study(sweep_dir).trials]
    assert [b[1] for b in before] == ["COMPLETE", "COMPLETE", "RUNNING"]

    run("train", *cmd[4:], log_dir=tmp_path)
    after = study(sweep_dir).trials
    assert [(t.number, t.state.name, t.value, t.params) for t in after[:2]] == before[:2]
    assert [t.state.name for t in after[2:]] == ["FAIL", "COMPLETE", "COMPLETE"]
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [r["state"] for r in rows].count("COMPLETE") == 4
    assert all(float(r["value"]) >= 0 for r in rows if r["state"] == "COMPLETE")


@pytest.mark.slow
def test_a_hopeless_ddp_trial_is_pruned_on_both_ranks(tmp_path):
    """Trial 0 trains well; trial 1 (same study, lr far too high) is judged worse than the median at a
    validation before its last: both ranks stop at that one, it is recorded as pruned, and the sweep exits 0."""
    common = ["hparams_search=digits", "run_id=prune", "strategy=ddp", "trainer.devices=2", *TINY[:1]]
    common += ["trainer.max_epochs=3", "++trainer.limit_train_batches=4", "++trainer.limit_val_batches=2"]
    common += ["model.scheduler.warmup_steps=0"]  # the bad lr is bad from the first step
    common += ["hydra.sweeper.pruner.n_startup_trials=1", "extras.print_config=false", "test=false"]
    run("train", *common, "hydra.sweeper.n_trials=1", "model.optimizer.lr=0.005", log_dir=tmp_path, timeout=400)
    run("train", *common, "hydra.sweeper.n_trials=2", "model.optimizer.lr=5.0", log_dir=tmp_path, timeout=400)
    sweep_dir = tmp_path / "train" / "multiruns" / "prune"
    good, bad = study(sweep_dir).trials
    assert (good.state.name, bad.state.name) == ("COMPLETE", "PRUNED")
    assert list(good.intermediate_values) == [4, 8, 12]  # a validation after each epoch of 4 steps
    *kept, stop = sorted(bad.intermediate_values)  # judged at each validation until the one that pruned it
    assert stop < 12 and bad.intermediate_values[stop] < good.intermediate_values[stop]
    assert all(bad.intermediate_values[s] >= good.intermediate_values[s] for s in kept)  # not pruned before
    for rank, log in enumerate(("train.log", "train_ddp_process_1.log")):
        text = (sweep_dir / "1" / log).read_text()
        assert re.findall(r"\[rank (\d)\] trial pruned at step (\d+)", text) == [(str(rank), str(stop))]


def test_k_folds_of_the_digits_validate_every_training_sample_once():
    """data.folds=3: the folds' validation sets partition train + val; the test set is the one without folds."""
    from mlproject.data.digits import DigitsDataModule

    plain = DigitsDataModule()
    plain.setup()
    folds = [DigitsDataModule(folds=3, fold=k) for k in range(3)]
    for dm in folds:
        dm.setup()
        assert dm.test_set.indices == plain.test_set.indices
        assert sorted(dm.train_set.indices + dm.val_set.indices) == list(
            range(len(plain.train_set) + len(plain.val_set))
        )
    validated = sorted(i for dm in folds for i in dm.val_set.indices)
    assert validated == list(range(len(plain.train_set) + len(plain.val_set)))  # each sample in one fold's val
    assert [len(dm.val_set) for dm in folds] == [479, 479, 479]  # 1,437 train + val samples in 3 equal parts


def test_k_folds_of_image_files_keep_training_augmentation_off_validation(tmp_path):
    from mlproject.data.images import ImagesDataModule

    def make(folds, fold):
        dm = ImagesDataModule(dir=str(tmp_path / "png"), source="digits", folds=folds, fold=fold)
        dm.prepare_data()
        return dm

    def files(d):  # a dataset's files, or a plain datamodule's train + val files
        return files(d.train_set) + files(d.val_set) if isinstance(d, ImagesDataModule) else [p for p, _ in d.samples]

    folds = check_folds(make, files, files)
    for dm in folds:
        assert (dm.train_set.crop_padding, dm.val_set.crop_padding) == (1, 0)  # only training images are cropped
    assert [len(dm.val_set) for dm in folds] == [480, 479, 479]  # 1,439 train + val files in 3 parts


def test_a_datamodule_that_cannot_fold_says_so_in_one_line(tmp_path):
    """data.folds=3 for a datamodule config without folds (a user's own): one line naming why, not `+data.folds`."""
    (tmp_path / "cfg" / "data").mkdir(parents=True)
    (tmp_path / "cfg" / "data" / "mine.yaml").write_text("_target_: my.datamodule.Plain\nbatch_size: 64\n")
    search = f"hydra.searchpath=[file://{tmp_path / 'cfg'}]"
    proc = run("train", search, "data=mine", "data.folds=3", "trainer=cpu", log_dir=tmp_path, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: 'data' has no key 'folds': this datamodule cannot fold; k-fold needs a subclass of "
        "mlproject.training.datamodule.DataModule given folds and fold (as configs/data/digits.yaml)."
    ]


@pytest.mark.slow
def test_make_cv_writes_each_folds_metrics_and_their_mean_and_std(tmp_path):
    """`make cv ARGS="... data.folds=3"` runs folds 0, 1, 2 as one sweep; cv.json holds each fold's metrics.json,
    and the mean and std that recomputing from them gives; each fold validated its third of train + val."""
    import json
    import statistics

    args = f"paths.log_dir={tmp_path} data.folds=3 run_id=cv trainer=cpu trainer.max_epochs=1 ~logger"
    args += " ++trainer.limit_train_batches=2 ++trainer.limit_test_batches=2 extras.print_config=false"
    proc = subprocess.run(["make", "cv", f"ARGS={args}"], cwd=PROJECT_ROOT, env=clean_env(), **PIPES, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep_dir = tmp_path / "train" / "multiruns" / "cv"
    cv = json.loads((sweep_dir / "cv.json").read_text())
    metrics = [read_metrics(sweep_dir / str(k)) for k in range(3)]
    assert [f["metrics"] for f in cv["folds"]] == metrics
    assert [f"data.fold={k}" in f["overrides"] for k, f in enumerate(cv["folds"])] == [True] * 3
    for name in metrics[0]:
        values = [m[name] for m in metrics]
        assert cv["mean"][name] == pytest.approx(statistics.fmean(values))
        assert cv["std"][name] == pytest.approx(statistics.stdev(values))
    assert len(set(json.dumps(m, sort_keys=True) for m in metrics)) == 3  # three different folds
