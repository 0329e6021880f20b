"""An existing lightning-hydra-template (LHT) project moves in unchanged: tests/fixtures/lht, on PYTHONPATH, its
configs found through hydra.searchpath, as a user would bring it. Its module takes a built `net` and `_partial_`
optimizer and scheduler (Hydra's own instantiation); its datamodule keeps a global batch size in `self.hparams`
and divides it by the world size itself. Every command works with it, or says in one line what to add.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from mlproject.build import instantiate_at
from mlproject.checkpoint.convert import load_full
from mlproject.core.constants import CONFIG_DIR
from tests import test_configs
from tests.checkpoint.helpers import assert_bitwise, assert_same_optimizer, kill_at, run_dir
from tests.helpers.processes import (
    FAST,
    PYTHON,
    read_metrics,
    run,
    run_dirs,
    run_in_process,
    together,
    with_path,
)

LHT = Path(__file__).parent / "fixtures/lht"
PROJECT = [f"hydra.searchpath=[file://{LHT}/configs]", "data=digits_lht", "model=mnist"]
QUIET = ["trainer=cpu", "extras.print_config=false"]


@pytest.fixture
def user_code(monkeypatch):
    """The user's package (`src`, as LHT names it) importable in this process, as PYTHONPATH makes it in a run."""
    monkeypatch.syspath_prepend(str(LHT))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """One epoch of the LHT project trained in a process of its own; its last checkpoint."""
    log_dir = tmp_path_factory.mktemp("lht")
    run("train", *FAST, *PROJECT, "trainer.max_epochs=1", "test=false", "run_id=one", log_dir=log_dir, env=env())
    return log_dir / "train/runs/one/checkpoints/last.ckpt"


def env() -> dict[str, str]:
    return with_path(LHT)


def test_a_model_config_is_built_as_hydra_builds_it_and_as_its_yaml_says(compose_cfg, user_code):
    """LHT's style: `net` arrives built and the optimizer and scheduler as partials; `_recursive_: false` in a
    yaml is honoured, as the template's own examples say it (their module builds `net` from plain dicts)."""
    from src.models.components.simple_dense_net import SimpleDenseNet

    lht = instantiate_at(compose_cfg(*PROJECT), "model")
    assert isinstance(lht.net, SimpleDenseNet) and lht.net.model[0].in_features == 64
    assert isinstance(lht.hparams.optimizer, functools.partial) and lht.hparams.optimizer.func is torch.optim.Adam
    assert lht.hparams.optimizer.keywords == {"lr": 0.001, "weight_decay": 0.0}
    assert lht.hparams.scheduler.func is torch.optim.lr_scheduler.ReduceLROnPlateau
    as_config = instantiate_at(compose_cfg(*PROJECT, "+model._recursive_=false"), "model")
    assert isinstance(as_config.net, DictConfig) and as_config.net.input_size == 64
    template = instantiate_at(compose_cfg("model=digits"), "model")
    assert type(template.hparams.net) is dict and template.hparams.net["_target_"].endswith("SmallCNN")
    assert type(template.net).__name__ == "SmallCNN" and type(template.hparams.optimizer) is dict


def test_the_config_tests_accept_the_user_files(compose_cfg, user_code, monkeypatch, tmp_path):
    """tests/test_configs.py on the user's options, and in a project made from the template (no copier.yml) on
    its configs with the user's uncommented files among them."""
    for group, option in (("data", "digits_lht"), ("model", "mnist")):
        test_configs.test_option_composes_and_instantiates(
            functools.partial(compose_cfg, PROJECT[0]), group, option, monkeypatch
        )
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    shutil.copytree(LHT / "configs", configs, dirs_exist_ok=True)
    monkeypatch.setattr(test_configs, "CONFIG_DIR", configs)
    monkeypatch.setattr(test_configs, "PROJECT_ROOT", tmp_path)
    with pytest.raises(pytest.skip.Exception, match="house style"):
        test_configs.test_every_config_key_has_a_comment()


# feature: planner
def test_the_plan_counts_the_model_states_and_says_the_batch_is_unknown(user_code, capsys):
    """The datamodule's own loaders set its batch size: the plan says so and still counts parameters,
    gradients and Adam's state, from the real model."""
    from hydra import initialize_config_dir
    from src.models.components.simple_dense_net import SimpleDenseNet

    from mlproject import plan as planner

    params = list(SimpleDenseNet(64, 64, 128, 64, 10).parameters())
    n = sum(p.numel() for p in params)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        result = planner.plan([*PROJECT, "trainer.accelerator=cpu", "strategy=ddp", "trainer.devices=2"])
    ddp = result.configured
    assert ddp.activations is None and ddp.params == ddp.grads == 4 * n
    assert ddp.optimizer == 8 * n + 4 * len(params)  # two fp32 moments, a step count per tensor
    assert ddp.total == ddp.params + ddp.grads + ddp.optimizer
    assert planner.main([*PROJECT, "trainer.accelerator=cpu"]) == 0
    assert "activations: ? (not counted): the datamodule sets its batch size" in capsys.readouterr().out


# /feature: planner
# feature: slurm
def test_submit_renders_the_job(user_code, capsys, no_sbatch):
    from mlproject import submit

    gpus = [
        "trainer=gpu",
        "cluster.nodes=1",
        "cluster.gpus_per_node=2",
        # feature: planner
        "cluster.gpu_memory_gb=80",  # the memory plan of the job fits
        # /feature: planner
    ]
    assert submit.main(["--dry-run", *PROJECT, *gpus]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --gpus-per-node=2" in script and "data=digits_lht model=mnist" in script


# /feature: slurm
def test_k_fold_of_a_plain_datamodule_is_refused_in_one_line(tmp_path):
    code, err = run_in_process("train", *QUIET, *PROJECT, "data.folds=2", log_dir=tmp_path)
    assert code == 2 and err == (
        "error: 'data' has no key 'folds': this datamodule cannot fold; k-fold needs a subclass of "
        "mlproject.training.datamodule.DataModule given folds and fold (as configs/data/digits.yaml).\n"
    )


def test_eval_checks_overrides_against_the_checkpoint_and_names_what_predict_needs(checkpoint, user_code, tmp_path):
    """eval's own default data (the template's digits) has no train_val_test_split: the checkpoint's has, so a
    misspelled key is refused naming it; predict=true names the two hooks Lightning's predict loop calls."""
    args = [f"ckpt_path={checkpoint}", *QUIET]
    code, err = run_in_process("eval", *args, "data.train_val_test_splt=[1297,100,400]", log_dir=tmp_path)
    assert code == 2 and "did you mean data.train_val_test_split=[1297,100,400]?" in err
    code, err = run_in_process("eval", *args, "predict=true", log_dir=tmp_path)
    assert code == 2 and err.splitlines()[-1] == (
        "error: predict=true needs MNISTLitModule.predict_step and DigitsDataModule.predict_dataloader: "
        "predictions.csv holds what predict_step returns for each batch, {'target': labels, 'pred': predictions} "
        "(as models/classifier.py's), over predict_dataloader's samples (the template's DataModule: the test "
        "split); add them, or drop predict=true."
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eval_on_1_and_2_processes_and_export_agree_on_a_split_only_the_datamodule_has(checkpoint, user_code, tmp_path):
    """`data.train_val_test_split` is a key of the user's datamodule alone: eval takes it against the checkpoint's
    config, on 1 and 2 processes with the same accuracy (LHT's test/loss is a mean of batch means: it moves with
    the batches, 128 samples on one process, 64 on each of two, as its setup divides); the exported network,
    rebuilt from the exported config alone, scores that accuracy on that test split."""
    import hydra
    from src.data.digits_datamodule import DigitsDataModule

    split = [1297, 100, 400]
    args = [f"ckpt_path={checkpoint}", *QUIET, f"data.train_val_test_split=[{','.join(map(str, split))}]"]
    logs = {world: tmp_path / f"eval{world}" for world in (1, 2)}
    export = [PYTHON, "-m", "mlproject.export", f"ckpt_path={checkpoint}", f"out={tmp_path / 'model.pt'}"]
    together(
        *(lambda w=w: run("eval", *args, f"trainer.devices={w}", log_dir=logs[w], env=env()) for w in logs),
        lambda: subprocess.run(export, cwd=tmp_path, env=env(), check=True, capture_output=True, timeout=240),
    )
    one, two = (read_metrics(run_dirs(logs[w], "eval")[0]) for w in logs)
    assert one["test/acc"] == two["test/acc"] and one["test/loss"] == pytest.approx(two["test/loss"], rel=0.01)

    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    net = hydra.utils.instantiate(exported["config"]["model"]["net"]).eval()
    net.load_state_dict(exported["state_dict"])
    data = DigitsDataModule(train_val_test_split=split)
    data.setup()
    x, y = (torch.stack(t) for t in zip(*data.data_test, strict=True))
    with torch.no_grad():
        assert (net(x).argmax(1) == y).float().mean().item() == pytest.approx(one["test/acc"], abs=1e-6)


def assert_trains_and_tests(log_dir: Path, layouts: dict[str, list[str]], *also) -> None:
    """Each layout fits, then tests the best checkpoint, as the project is written (beside `also`, run together)."""
    base = [*FAST, *PROJECT, "logger=csv"]
    train = [lambda n=n: run("train", *base, *layouts[n], f"run_id={n}", log_dir=log_dir, env=env()) for n in layouts]
    together(*train, *also)
    for name in layouts:
        metrics = read_metrics(log_dir / "train/runs" / name)
        assert metrics["test/acc"] >= 0.8 and metrics["val/acc_best"] >= metrics["val/acc"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_it_trains_under_single_ddp_and_fsdp_and_resumes_a_killed_run_bitwise(tmp_path):
    """Under fsdp the datamodule's hyperparameters (a list) are in the sharded checkpoint, read back with
    weights_only=True. A run SIGKILLed 3 steps into its second epoch (11 steps each; its last checkpoint: step
    12) and resumed with ckpt_path=auto ends with the uninterrupted run's weights and optimizer state, bitwise:
    the user's DataLoader (shuffle=True) reads the same batches from the middle of the epoch."""
    setup = [*FAST, *PROJECT, "test=false", "callbacks.last_checkpoint.every_n_train_steps=3", "ckpt_path=auto"]
    resumes = tmp_path / "resumes"

    def straight():
        run("train", *setup, "run_id=straight", log_dir=resumes, env=env())

    def killed_and_resumed():
        killed = run("train", *setup, "run_id=killed", *kill_at(14), log_dir=resumes, env=env(), check=False)
        assert killed.returncode != 0 and (resumes / "train/runs/killed/checkpoints/last.ckpt").exists()
        run("train", *setup, "run_id=killed", log_dir=resumes, env=env())

    layouts = {"single": ["strategy=single"], "ddp": ["strategy=ddp", "trainer.devices=2"]}
    layouts["fsdp"] = ["strategy=fsdp", "trainer.devices=2"]
    assert_trains_and_tests(tmp_path, layouts, straight, killed_and_resumed)
    ends = [load_full(run_dir(resumes, r) / "checkpoints/last.ckpt") for r in ("straight", "killed")]
    assert ends[0]["global_step"] == ends[1]["global_step"] == 22
    assert_bitwise(ends[0]["state_dict"], ends[1]["state_dict"])
    assert_same_optimizer(ends[0]["optimizer_states"][0], ends[1]["optimizer_states"][0], tol=0)


# feature: deepspeed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_it_trains_under_deepspeed_stage_2(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra (pip install -e '.[deepspeed]')")
    assert_trains_and_tests(tmp_path, {"zero2": ["strategy=deepspeed_stage_2", "trainer.devices=2"]})


# /feature: deepspeed
def test_a_sampler_of_the_users_own_is_kept_and_split_over_the_ranks(caplog):
    """A weighted sampler draws what its user chose: kept as it is on one process, and on two each rank takes
    every other of its draws (Lightning's DistributedSamplerWrapper), never replaced by the template's; a user's
    DistributedSampler is kept as it is."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, WeightedRandomSampler

    from mlproject.training.loaders import with_samplers

    def loader() -> DataLoader:  # the first 5 of 20 samples drawn, 8 times, from a seeded generator
        weights = [1.0] * 5 + [0.0] * 15
        sampler = WeightedRandomSampler(weights, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(torch.arange(20)), batch_size=2, sampler=sampler)

    single = loader()
    assert with_samplers(single, True, None) is single
    draws = list(loader().sampler)
    assert max(draws) < 5
    ranks = [SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": r}) for r in (0, 1)]
    assert [list(with_samplers(loader(), True, t).sampler) for t in ranks] == [draws[0::2], draws[1::2]]
    assert "train DataLoader's WeightedRandomSampler is kept, split over 2 data-parallel ranks" in caplog.text
    own = DataLoader(TensorDataset(torch.arange(20)), sampler=DistributedSampler(range(20), num_replicas=2, rank=1))
    assert with_samplers(own, True, ranks[1]) is own  # one that splits over the ranks already, as it is
