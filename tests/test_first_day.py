"""What a Lightning + Hydra user types on the first day works as typed: Trainer flags without `+`, the debug
configs, and a metrics.json that holds the final validation too."""

from __future__ import annotations

import csv
import warnings

import tomllib
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from mlproject.core.constants import PROJECT_ROOT
from mlproject.utils.report import apply_extras
from tests.helpers.processes import FAST, read_metrics, run, run_dirs

SMALL = "data.batch_size=16"  # short steps for the default model, the GPT of a GPT-only project too


def test_trainer_flags_need_no_plus_and_metrics_json_holds_val_without_test(tmp_path):
    """trainer.max_steps / val_check_interval / limit_*_batches set bare; with test=false metrics.json holds
    the final validation's metrics (not `{}`)."""
    flags = ["trainer.max_steps=3", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", SMALL]
    run("train", *FAST, *flags, "trainer.check_val_every_n_epoch=null", "test=false", log_dir=tmp_path)
    (run_dir,) = run_dirs(tmp_path)
    with open(run_dir / "csv" / "metrics.csv") as f:
        assert len([r for r in csv.DictReader(f) if r.get("val/acc")]) == 1  # at batch 2 only: not at the end
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 3
    metrics = read_metrics(run_dir)
    assert {"val/acc", "val/loss", "val/samples"} <= set(metrics) and not any(k.startswith("test/") for k in metrics)
    assert metrics["val/samples"] == 16  # the one validation batch, counted exactly


def test_debug_overfit_runs(tmp_path):
    """debug=overfit: Lightning rebuilds the training loader with a batch sampler (its batch_size is None)."""
    proc = run("train", *FAST, "debug=overfit", SMALL, log_dir=tmp_path)
    (run_dir,) = run_dirs(tmp_path, "debug")
    assert "effective batch 16 (16 per device x 1 data-parallel rank(s) x 1 accumulation)" in proc.stdout
    data = instantiate(OmegaConf.load(run_dir / ".hydra" / "config.yaml").data)
    data.prepare_data()
    data.setup("test")
    assert read_metrics(run_dir)["test/samples"] == len(data.test_set)  # the whole test split, not 3 batches


def test_runs_show_warnings_except_the_named_known_ones():
    """A deprecation of an API the template uses must be seen: only understood third-party warnings are filtered."""
    extras = OmegaConf.load(PROJECT_ROOT / "configs" / "extras" / "default.yaml")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply_extras(OmegaConf.create({"extras": {**extras, "print_config": False}}))
        warnings.warn("some_api is deprecated", DeprecationWarning, stacklevel=1)
        warnings.warn("'set_vital' is deprecated, please do not call", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["some_api is deprecated"]


def test_pytest_filters_only_named_warnings():
    filters = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    for entry in filters.get("filterwarnings", []):
        action, message = entry.split(":")[:2]
        assert action != "ignore" or message, f"{entry} ignores a whole category"
