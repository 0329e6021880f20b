"""The make targets pass every override through exactly as given, in both forms and mixed."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.processes import PROJECT_ROOT, make_command, make_env

# make command line (as a shell would read it) -> the overrides the Python command must receive
THREE = ["trainer.max_epochs=1", "seed=3", "data.batch_size=32"]
CASES = {
    'train ARGS="trainer.max_epochs=1 seed=3 data.batch_size=32"': THREE,
    "train trainer.max_epochs=1 seed=3 data.batch_size=32": THREE,
    "train tags='[a, b]' \"model.name=it's\"": ["tags=[a, b]", "model.name=it's"],
    "train +trainer.x=a=b,c ARGS='~logger \"paths.log_dir=my logs\"'": [
        "+trainer.x=a=b,c", "~logger", "paths.log_dir=my logs",
    ],
    # every form Hydra accepts, bare and in the order given; ARGS comes last
    "train '~logger' ++trainer.max_epochs=2 +trainer.x=1 'callbacks=[]' seed=3 '~callbacks.lr' ARGS=--cfg=job": [
        "~logger", "++trainer.max_epochs=2", "+trainer.x=1", "callbacks=[]", "seed=3", "~callbacks.lr",
        "--cfg=job",
    ],
    "sweep model.optimizer.lr=0.005,0.01 seed=1": ["--multirun", "model.optimizer.lr=0.005,0.01", "seed=1"],
    # feature: slurm, kubernetes
    'submit-dryrun ARGS="trainer=gpu cluster.nodes=4 cluster.gpus_per_node=8"': [
        "--dry-run", "trainer=gpu", "cluster.nodes=4", "cluster.gpus_per_node=8",
    ],
    # /feature: slurm, kubernetes
    "eval CKPT=a.ckpt data.batch_size=7": ["ckpt_path=a.ckpt", "data.batch_size=7"],
    "export CKPT=a.ckpt OUT=m.pt": ["ckpt_path=a.ckpt", "out=m.pt"],
    "eval \"CKPT=my runs/it's.ckpt\" data.batch_size=7": ["ckpt_path=my runs/it's.ckpt", "data.batch_size=7"],
    "export 'CKPT=a \"b\".ckpt' 'OUT=out dir/m.pt'": ['ckpt_path=a "b".ckpt', "out=out dir/m.pt"],
}  # fmt: skip


@pytest.mark.parametrize("make_line", CASES)
def test_make_passes_overrides_through(make_line):
    assert make_command(make_line) == CASES[make_line]


def test_outer_make_variables_do_not_leak(monkeypatch):
    """`make test ARGS=-q` runs these tests with the outer ARGS in MAKEFLAGS: the nested make must not see it."""
    monkeypatch.setenv("MAKEFLAGS", " -- ARGS=-q\\ -x seed=4")
    monkeypatch.setenv("MAKELEVEL", "1")
    monkeypatch.setenv("ARGS", "-q -x")
    monkeypatch.setenv("seed", "4")
    assert make_command("train seed=3") == ["seed=3"]


def test_make_train_dash_m_stops_with_the_sweep_target():
    """make takes `-m` as its own (ignored) flag: `make train -m` must not train once with the sweep lost."""
    make = ["make", "-n", "train", "-m", "seed=1,2"]
    out = subprocess.run(make, cwd=PROJECT_ROOT, env=make_env(), capture_output=True, text=True)
    assert "error: make takes -m as its own flag: sweep with make sweep <overrides>" in out.stdout


def test_make_help_documents_sweep():
    out = subprocess.run(["make", "help"], cwd=PROJECT_ROOT, env=make_env(), capture_output=True, text=True, check=True)
    assert "make sweep model.optimizer.lr=0.005,0.01" in out.stdout
