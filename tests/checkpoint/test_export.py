"""`make export OUT=model.safetensors`: a safetensors file with the plain export's keys and the run's config in
its metadata, loaded with safetensors alone into the bare network, reproduces the run's test metrics."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F

from mlproject.core.constants import PROJECT_ROOT
from tests.checkpoint.helpers import run_dir, strategy, train
from tests.helpers.processes import clean_env, read_metrics


@pytest.mark.slow
def test_safetensors_export_reproduces_test_metrics(tmp_path):
    from hydra.utils import instantiate
    from safetensors import safe_open
    from safetensors.torch import load_file

    train(tmp_path, "run", *strategy("single"), "trainer.max_epochs=1", test=True)
    run = run_dir(tmp_path, "run")
    out = tmp_path / "model.safetensors"
    make = ["make", "-s", "export", f"CKPT={run / 'checkpoints' / 'last.ckpt'}", f"OUT={out}"]
    subprocess.run(make, cwd=PROJECT_ROOT, env=clean_env(), check=True, capture_output=True, text=True)
    plain = tmp_path / "model.pt"
    subprocess.run([*make[:-1], f"OUT={plain}"], cwd=PROJECT_ROOT, env=clean_env(), check=True, capture_output=True)

    with safe_open(out, "pt") as f:
        config = json.loads(f.metadata()["config"])
    state_dict = load_file(out)
    want = torch.load(plain, weights_only=True)
    assert config == want["config"]
    assert state_dict.keys() == want["state_dict"].keys()
    assert all(torch.equal(state_dict[k], v) for k, v in want["state_dict"].items())

    net = instantiate(config["model"]["net"])
    net.load_state_dict(state_dict)
    data = instantiate(config["data"])
    data.prepare_data()
    data.setup("test")
    correct = total = 0
    loss = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for x, y in data.test_dataloader():  # the plain DataLoader: every test sample once
            logits = net.eval()(x)
            loss += F.cross_entropy(logits, y, reduction="sum").double()
            correct += (logits.argmax(-1) == y).sum().item()
            total += len(y)
    metrics = read_metrics(run)
    assert total > 100
    assert correct / total == pytest.approx(metrics["test/acc"], abs=1e-6)
    assert (loss / total).item() == pytest.approx(metrics["test/loss"], rel=1e-5)
