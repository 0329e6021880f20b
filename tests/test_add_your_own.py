"""README's "Add your own model and data", followed step by step on scikit-learn's wine data (no download).

The new files go to a temporary directory: the package's `data` and `models.components` folders are extended
with it (Python reads a package's modules from every folder in its `__path__`), and a copy of configs/ gets
the new YAML files. Then the recipe trains for one epoch in this process, and eval finds data and model in
the checkpoint.
"""

from __future__ import annotations

import re
import shutil

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import mlproject.data
import mlproject.models.components
from mlproject.core.constants import CONFIG_DIR
from mlproject.eval import evaluate, with_checkpoint_config
from mlproject.train import train
from tests import test_configs

MLP = '''"""A small MLP for tabular features."""

from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int = 32, num_classes: int = 3):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.layers(x)
'''
DATA_YAML = """# scikit-learn's 178 wines, 13 features, 3 cultivars.
_target_: mlproject.data.wine.WineDataModule
batch_size: 16        # GLOBAL batch size per optimizer step
val_size: 30          # samples held out for validation
test_size: 40         # samples held out for test
"""
MODEL_YAML = """# An MLP classifier for the wine data.
_target_: mlproject.models.classifier.Classifier
_recursive_: false           # as configs/model/digits.yaml: the Classifier builds net from its config
_convert_: all               # plain dicts, not OmegaConf containers
num_classes: 3               # cultivars
net:
  _target_: mlproject.models.components.mlp.MLP
  in_features: 13            # wine features
  num_classes: ${..num_classes}  # same as the module's num_classes
optimizer:                   # torch.optim.AdamW
  lr: 0.01                   # peak learning rate
  weight_decay: 0.0          # no decay for a model this small
  betas: [0.9, 0.999]        # Adam moment coefficients
scheduler:                   # linear warmup, then cosine decay
  warmup_steps: 2            # optimizer steps of warmup
  min_lr_ratio: 0.1          # final lr as a fraction of the peak
"""


@pytest.fixture
def wine_project(tmp_path, monkeypatch):
    """Steps 1-5 of the README, written into tmp_path; returns the configs folder."""
    # 1. Data: copy data/digits.py, return the wine splits from splits()
    src = (CONFIG_DIR.parent / "src/mlproject/data/digits.py").read_text()
    src = src.replace("DigitsDataModule", "WineDataModule").replace("load_digits", "load_wine")
    standardized = "x = torch.tensor(images, dtype=torch.float32)\n        x = (x - x.mean(0)) / x.std(0)\n"
    src = re.sub(r"x = torch.tensor\(images.*\n", standardized, src)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/wine.py").write_text(src)
    # 2. Network: a plain nn.Module in models/components/
    (tmp_path / "components").mkdir()
    (tmp_path / "components/mlp.py").write_text(MLP)
    monkeypatch.setattr(mlproject.data, "__path__", [*mlproject.data.__path__, str(tmp_path / "data")])
    components = [*mlproject.models.components.__path__, str(tmp_path / "components")]
    monkeypatch.setattr(mlproject.models.components, "__path__", components)
    # 3. and 4. Reuse the Classifier, point net._target_ at the MLP; every key commented
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    (configs / "data/wine.yaml").write_text(DATA_YAML)
    (configs / "model/wine.yaml").write_text(MODEL_YAML)
    # 5. Recipe: copy experiment/digits.yaml
    recipe = (configs / "experiment/digits.yaml").read_text().replace("digits", "wine")
    (configs / "experiment/wine.yaml").write_text(recipe.replace("channels: 48      # a wider network", "hidden: 64"))
    monkeypatch.setattr("tests.test_configs.CONFIG_DIR", configs)
    return configs


def compose_in(configs, name, *overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        return compose(name, list(overrides))


def test_readme_walkthrough_trains_a_new_model_on_new_data(wine_project, tmp_path):
    with pytest.raises(AssertionError, match="experiment/wine.yaml:.*hidden: 64"):
        test_configs.test_every_config_key_has_a_comment()  # `make test` would say which key needs its comment
    recipe = wine_project / "experiment/wine.yaml"
    recipe.write_text(recipe.read_text().replace("hidden: 64", "hidden: 64           # a wider MLP"))
    test_configs.test_every_config_key_has_a_comment()

    paths = [f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}", "trainer=cpu", "extras.print_config=false"]
    cfg = compose_in(wine_project, "train", "experiment=wine", "trainer.max_epochs=1", "~logger", *paths)
    metrics = train(cfg)
    assert metrics["test/samples"] == 40  # every test wine once
    ckpt = tmp_path / "checkpoints/last.ckpt"
    cfg = compose_in(wine_project, "eval", f"ckpt_path={ckpt}", *paths)  # no data=, no model=
    assert evaluate(with_checkpoint_config(cfg))["test/samples"] == 40
    GlobalHydra.instance().clear()


# A module and a datamodule written for plain Lightning, as a user brings them: no import of this package.
PLAIN = '''"""The digits with a small CNN, in plain Lightning."""

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchmetrics import SumMetric
from torchmetrics.classification import MulticlassAccuracy


class Digits(L.LightningDataModule):
    def __init__(self, batch_size: int = 32, val_size: int = 200, test_size: int = 359, num_workers: int = 0):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage=None):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        data = TensorDataset(torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16, torch.tensor(y))
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
        test, held = self.hparams.test_size, self.hparams.test_size + self.hparams.val_size
        self.train_set, self.val_set = Subset(data, order[held:]), Subset(data, order[test:held])
        self.test_set = Subset(data, order[:test])

    def loader(self, data, shuffle=False):
        workers = self.hparams.num_workers
        kwargs = {"num_workers": workers, "persistent_workers": workers > 0}
        return DataLoader(data, self.hparams.batch_size, shuffle=shuffle, **kwargs)

    def train_dataloader(self):
        return self.loader(self.train_set, shuffle=True)

    def val_dataloader(self):
        return self.loader(self.val_set)

    def test_dataloader(self):
        return self.loader(self.test_set)


class CNN(L.LightningModule):
    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 64, 10)
        )
        self.val_acc = MulticlassAccuracy(10, average="micro")
        self.test_acc, self.test_samples = MulticlassAccuracy(10, average="micro"), SumMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc.update(self.net(x), y)
        self.log("val/acc", self.val_acc, on_epoch=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc.update(self.net(x), y)
        self.test_samples.update(len(y))
        self.log("test/acc", self.test_acc, on_epoch=True)
        self.log("test/samples", self.test_samples, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
'''
PLAIN_DATA_YAML = """# The digits, from a plain LightningDataModule.
_target_: plain_digits.Digits
batch_size: 32        # per device, as in Lightning
val_size: 200         # samples held out for validation
test_size: 359        # samples held out for test: no world size of 2 or 3 divides it
num_workers: 0        # loader worker processes
"""
PLAIN_MODEL_YAML = """# A small CNN, as a plain LightningModule.
_target_: plain_digits.CNN
lr: 0.01              # Adam's learning rate
"""
STRATEGIES = {  # 2 processes each but single
    "single": ["strategy=single"],
    "ddp_syncbn": ["strategy=ddp", "trainer.devices=2", "trainer.sync_batchnorm=true"],
    "fsdp": ["strategy=fsdp", "trainer.devices=2"],
    # feature: deepspeed
    "deepspeed_stage_2": ["strategy=deepspeed_stage_2", "trainer.devices=2"],
    # /feature: deepspeed
}
EVERY_7 = "callbacks.last_checkpoint.every_n_train_steps=7"


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """The README's steps with a plain module and datamodule in a folder of their own (on PYTHONPATH) and its
    configs found through hydra.searchpath; a run under each strategy, and a single-process run SIGKILLed at
    step 47 (last checkpoint: step 42, mid-epoch) and resumed with ckpt_path=auto. Returns (root, run dirs)."""

    from tests.checkpoint.helpers import kill_at
    from tests.helpers.processes import FAST, run, together, with_path

    root = tmp_path_factory.mktemp("plain")
    (root / "plain_digits.py").write_text(PLAIN)
    (root / "configs/data").mkdir(parents=True)
    (root / "configs/model").mkdir()
    (root / "configs/data/plain_digits.yaml").write_text(PLAIN_DATA_YAML)
    (root / "configs/model/plain_digits.yaml").write_text(PLAIN_MODEL_YAML)
    env = with_path(root)
    base = [*FAST, "trainer.max_epochs=4", f"hydra.searchpath=[file://{root}/configs]", "data=plain_digits"]
    base += ["model=plain_digits", "logger=csv", EVERY_7]

    def train(name: str, *overrides: str, check: bool = True):
        return run("train", *base, f"run_id={name}", *overrides, log_dir=root / name, env=env, check=check, timeout=900)

    def killed_then_resumed():
        assert train("killed", "data.num_workers=2", "test=false", *kill_at(47), check=False).returncode != 0
        train("killed", "data.num_workers=2", "test=false", "ckpt_path=auto")

    together(
        lambda: train("straight", "data.num_workers=2", "test=false"),
        killed_then_resumed,
        *(lambda name=name: train(name, *STRATEGIES[name]) for name in ("single", "ddp_syncbn")),
    )
    sharded = [name for name in STRATEGIES if name not in ("single", "ddp_syncbn")]
    together(*(lambda name=name: train(name, *STRATEGIES[name]) for name in sharded))
    return root, env, {name: root / name / "train/runs" / name for name in [*STRATEGIES, "straight", "killed"]}


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 9 training processes, 3 at a time, on a loaded machine
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_plain_module_and_datamodule_train_under_every_strategy(plain_runs, strategy):
    """The digits example's accuracy (>= 0.95 after 4 epochs), every test sample counted once (359: no world
    size divides it)."""
    from tests.helpers.processes import read_metrics

    metrics = read_metrics(plain_runs[2][strategy])
    assert metrics["test/acc"] >= 0.95 and metrics["test/samples"] == 359


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_plain_checkpoint_evaluates_the_same_on_1_and_3_processes(plain_runs):
    from tests.helpers.processes import read_metrics, run, run_dirs, together

    root, env, runs = plain_runs
    ckpt = runs["single"] / "checkpoints/last.ckpt"
    base = [
        "extras.print_config=false",
        "trainer=cpu",
        f"hydra.searchpath=[file://{root}/configs]",
        f"ckpt_path={ckpt}",
    ]
    logs = {world: root / f"eval{world}" for world in (1, 3)}
    together(*(lambda w=w: run("eval", *base, f"trainer.devices={w}", log_dir=logs[w], env=env) for w in logs))
    one, three = (read_metrics(run_dirs(logs[w], "eval")[0]) for w in (1, 3))
    assert one == three and one["test/samples"] == 359


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_plain_run_killed_mid_epoch_resumes_bitwise(plain_runs):
    """With 2 loader workers: SIGKILL at step 47, resume from step 42's checkpoint, the final weights bitwise
    the straight run's."""
    from tests.checkpoint.helpers import assert_bitwise, weights

    runs = plain_runs[2]
    assert_bitwise(
        weights(runs["straight"] / "checkpoints/last.ckpt"), weights(runs["killed"] / "checkpoints/last.ckpt")
    )
