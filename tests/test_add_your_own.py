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
