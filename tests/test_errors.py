"""Bad input ends with one clear line naming the fix, a non-zero exit, and no traceback."""

from __future__ import annotations

import os
import sys
import traceback
from unittest import mock

import pytest
from omegaconf import OmegaConf

from mlproject.core.constants import CONFIG_DIR
from mlproject.core.errors import ConfigError
from tests.helpers.processes import clean_env, run_dirs, run_in_process

# The cases hold for any set of examples a project keeps: they name the defaults by reading train.yaml.
TRAIN_DEFAULTS = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "train.yaml").defaults)
DEFAULTS = {k: v for d in TRAIN_DEFAULTS if isinstance(d, dict) for k, v in d.items()}
MODEL, DATA = DEFAULTS["model"], DEFAULTS["data"]
CASES = {
    "unknown option": (["model=resnet"], "Available options in 'model':"),
    "misspelled option": ([f"model={MODEL[:-1]}"], f"Did you mean model={MODEL}?"),
    "misspelled group": (
        [f"modle={MODEL}"],
        f"'modle' is neither a config group nor a key; did you mean model={MODEL}?",
    ),
    "misspelled group and option": (
        [f"modle={MODEL[:-1]}"],
        f"did you mean the group model? It has no option '{MODEL[:-1]}'; the closest: {MODEL}",
    ),
    "misspelled group, no such option": (  # `model=no_such` would only be the next error
        ["modle=no_such"],
        "'modle' is neither a config group nor a key; did you mean the group model? It has no option 'no_such'; "
        "its options: ",
    ),
    "unknown top-level key": (["xyzzy=1"], "'xyzzy' is neither a config group nor a key; its keys: "),
    "unknown key": (["trainer.max_epoch=3"], "'trainer' has no key 'max_epoch'; did you mean trainer.max_epochs=3?"),
    "misspelled data key": (["data.batchsize=32"], "did you mean data.batch_size=32?"),
    "misspelled _target_": (
        ["callbacks.model_checkpoint._target_=lightning.pytorch.callbacks.ModelCheckpont"],
        "callbacks.model_checkpoint._target_=lightning.pytorch.callbacks.ModelCheckpont (the command line) cannot be "
        "imported; did you mean lightning.pytorch.callbacks.ModelCheckpoint?",
    ),
    "misspelled constructor key": (
        ["+callbacks.model_checkpoint.every_n_epoch=1"],
        "callbacks.model_checkpoint.every_n_epoch (the command line): ModelCheckpoint takes no argument "
        "'every_n_epoch'; did you mean callbacks.model_checkpoint.every_n_epochs?",
    ),
    "constructor key from an included file": (  # callbacks/default.yaml includes callbacks/model_checkpoint.yaml
        ["callbacks.model_checkpoint._target_=lightning.pytorch.callbacks.EarlyStopping"],
        "(configs/callbacks/model_checkpoint.yaml): EarlyStopping takes no argument",
    ),
    "wrong type": (["trainer.max_epochs=ten"], "trainer.max_epochs='ten' must be of type int"),
    "batch not divisible": (["strategy=ddp", "trainer.devices=3"], "use a multiple of 3"),
    "missing checkpoint": (["ckpt_path=nope.ckpt"], "ckpt_path=nope.ckpt does not exist"),
    "single with devices": (["strategy=single", "trainer.devices=2"], "use strategy=ddp"),
    "group set to null": (["logger=null"], "use ~<group>, e.g. ~logger"),
    "batch size zero": (["data.batch_size=0"], "data.batch_size=0 is out of range: it must be >= 1"),
    "no devices": (["trainer.devices=0"], "trainer.devices=0 is out of range: it must be >= 1"),
    "learning rate zero": (["model.optimizer.lr=0"], "model.optimizer.lr=0 is out of range: it must be > 0"),
    "dropout above one": (["model.net.dropout=1.5"], "model.net.dropout=1.5 is out of range: it must be >= 0 and <= 1"),
    "no signal checks": (["cluster.signal_check_every_n_steps=0"], "it must be >= 1"),
    "replicas that do not divide": (
        ["strategy=hsdp", "trainer.devices=3", "strategy.replicate_size=2"],
        "strategy.replicate_size=2 must divide the data-parallel size 3",
    ),
    # feature: expert
    "expert groups that do not divide": (
        ["strategy=hsdp", "trainer.devices=4", "strategy.replicate_size=2", "strategy.expert_parallel_size=4"],
        "strategy.expert_parallel_size=4 must divide the shard size 2",
    ),
    # /feature: expert
}
# feature: tensor
if "parallel" not in OmegaConf.load(CONFIG_DIR / f"model/{MODEL}.yaml"):
    CASES["tp without a plan"] = (["strategy=tp", "trainer.devices=2"], "has none; use strategy=fsdp")
# /feature: tensor
# the digits experiment sets model.net.channels over the model file's: the error names the experiment
if (DIGITS := CONFIG_DIR / "experiment/digits.yaml").exists():
    CASES["constructor key from an experiment"] = (
        [f"experiment={DIGITS.stem}", "model.net._target_=torch.nn.Conv2d"],
        f"model.net.channels (configs/experiment/{DIGITS.name}): Conv2d takes no argument 'channels'",
    )
# the other example's data (images suit the digits model and tokens the GPT, so neither can be the mismatch)
OTHER_DATA = [d for d in ("text", "digits") if d != DATA and (CONFIG_DIR / f"data/{d}.yaml").exists()]
if OTHER_DATA:  # another example's data under the default model: caught at the first batch
    CASES["data does not fit the model"] = (
        [f"data={OTHER_DATA[0]}", "trainer.limit_train_batches=1"],
        f"with data={OTHER_DATA[0]} (configs/data/{OTHER_DATA[0]}.yaml) and model={MODEL} "
        f"(configs/model/{MODEL}.yaml): if they are not a pair, pick matching data= and model=",
    )


def options(group: str) -> str:
    return "|".join(sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")))


# lightning-hydra-template's names: the ones that exist here work (trainer=gpu, callbacks=default, debug=default)
HABITS = {
    "trainer=ddp": "here: strategy=ddp trainer.devices=<n>",
    "trainer=ddp_sim": "here: trainer=cpu strategy=ddp trainer.devices=2",
    "logger=many_loggers": "here: logger=many",
    # feature: sweeps
    "hparams_search=mnist_optuna": f"here: hparams_search=<{options('hparams_search')}>",
    "hydra/sweeper=optuna": "here: override /hydra/sweeper: study, without hydra-optuna-sweeper's _target_ line",
    # /feature: sweeps
    "experiment=example": f"here: experiment=<{options('experiment')}>",
}
CASES |= {
    f"LHT's {name}": ([name], f"error: {name} is lightning-hydra-template's name; {fix}")
    for name, fix in HABITS.items()
}


@pytest.mark.parametrize("case", CASES)
def test_bad_override_gives_one_line(case, tmp_path):
    overrides, expected = CASES[case]
    code, stderr = run_in_process("train", "trainer=cpu", *overrides, "extras.print_config=false", log_dir=tmp_path)
    assert code == 2
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0]
    if "its keys: " in expected:  # each once: the groups, then the composed config's other keys
        keys = lines[0].split("its keys: ")[1].split(" (")[0].split(", ")
        assert len(keys) == len(set(keys)) and {"model", "trainer", "seed"} <= set(keys), keys
    assert "Traceback" not in stderr
    assert not run_dirs(tmp_path)  # no run directory left behind


def test_full_error_shows_the_traceback(tmp_path, monkeypatch):
    """HYDRA_FULL_ERROR=1, as Hydra documents it: the error propagates (Python prints its traceback) with its
    cause chained, down to the library's own exception."""
    from hydra.core.global_hydra import GlobalHydra

    from mlproject.train import main

    bad = "+callbacks.model_checkpoint.every_n_epoch=1"
    monkeypatch.setattr(sys, "argv", ["mlproject.train", f"paths.log_dir={tmp_path}", "trainer=cpu", bad])
    try:
        with mock.patch.dict(os.environ, clean_env(HYDRA_FULL_ERROR="1"), clear=True), pytest.raises(ConfigError) as e:
            main()
    finally:
        GlobalHydra.instance().clear()
    trace = "".join(traceback.format_exception(e.value))
    assert trace.startswith("Traceback") and "in instantiate_at" in trace
    assert "TypeError: ModelCheckpoint.__init__() got an unexpected keyword argument 'every_n_epoch'" in trace
    assert trace.rstrip().endswith(
        "ModelCheckpoint takes no argument 'every_n_epoch'; did you mean callbacks.model_checkpoint.every_n_epochs?"
    )
    assert not run_dirs(tmp_path)


def test_gpu_asked_for_where_none_is_visible(tmp_path, monkeypatch):
    """CUDA reports no GPU (as with CUDA_VISIBLE_DEVICES=''), so the case holds on a GPU host too."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, stderr = run_in_process("train", "trainer=gpu", "extras.print_config=false", log_dir=tmp_path)
    assert code == 2 and stderr.strip() == "error: trainer.accelerator=gpu but no CUDA GPU is visible; use trainer=cpu."


def test_eval_without_checkpoint(tmp_path):
    code, stderr = run_in_process("eval", log_dir=tmp_path)
    assert code == 2 and "ckpt_path" in stderr and "Traceback" not in stderr


def test_type_check_finds_experiments_on_an_extra_search_path(tmp_path):
    """The type check composes the defaults again: with the run's hydra.searchpath, so that an experiment of the
    user's own (outside configs/) is found there too and the real mistake is the one reported."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment/mine.yaml").write_text("# @package _global_\nseed: 7  # a recipe of the user's own\n")
    search = f"hydra.searchpath=[file://{tmp_path}]"
    code, stderr = run_in_process(
        "train", "trainer=cpu", search, "experiment=mine", "trainer.devices=abc", log_dir=tmp_path
    )
    assert code == 2 and stderr.strip() == "error: trainer.devices='abc' must be of type int, like the default 1."
