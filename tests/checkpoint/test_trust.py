"""A checkpoint never runs code, and one of another model or size ends in one line.

Every pickle of a checkpoint (a file, a sharded folder's .metadata, meta.pt and non-tensor items, a DeepSpeed
folder's files) loads with weights_only=True: one that holds anything else is refused in one line naming the file,
the type and the opt-in for a trusted file (MLPROJECT_TRUST_CHECKPOINT=1), before anything in it runs. The
malicious checkpoints here are real ones of the template with a Canary added, which would create a file if
unpickled; each case asserts the exit code, the line, that no canary appeared, and that the checkpoint and a file
beside it survive. A checkpoint that does not fit the model is refused naming the first tensor whose shape
differs (both shapes), or the names one has and the other lacks. What the template saves needs no opt-in:
hyperparameters reach checkpoints as plain data.
"""

from __future__ import annotations

import datetime
import functools
import io
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from mlproject.checkpoint.state import plain_hyperparameters
from mlproject.models.classifier import Classifier
from mlproject.train import train as train_in_process
from tests.helpers.gpt import TINY_GPT
from tests.helpers.processes import FAST, PYTHON, clean_env, run, together

ONE_BATCH = ["trainer=cpu", "trainer.max_epochs=1", "~logger", "extras.print_config=false", "test=false"]
ONE_BATCH += [f"trainer.limit_{split}_batches=1" for split in ("train", "val")]
TRUST = "MLPROJECT_TRUST_CHECKPOINT"


class Canary:
    """What a malicious checkpoint holds: unpickled in full, it creates the file `path`."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').close()",)


class KeepsOmegaConf(Classifier):
    """A user's module that takes its settings as one container, keeps them as a DictConfig and saves that as its
    hyperparameters (Lightning would put the DictConfig, class and all, into every checkpoint)."""

    def __init__(self, cfg: dict):
        cfg = OmegaConf.create(cfg)
        super().__init__(**cfg)
        self.save_hyperparameters(cfg)


def refusal(name: Path | str, what: str) -> str:
    return (
        f"error: {name} holds {what}: checkpoints load with weights_only=True, as unpickling anything else can run "
        f"code; if you trust this file, run again with {TRUST}=1."
    )


def export(folder: Path, ckpt: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m mlproject.export ckpt_path=<ckpt> out=model.pt` run in `folder`, as from a project's root."""
    cmd = [PYTHON, "-m", "mlproject.export", f"ckpt_path={ckpt}", "out=model.pt"]
    return subprocess.run(cmd, cwd=folder, env=env or untrusted(), capture_output=True, text=True, timeout=240)


def untrusted() -> dict:
    env = clean_env()
    env.pop(TRUST, None)  # a developer's own opt-in must not make the refusals pass
    return env


def assert_one_line(proc: subprocess.CompletedProcess, line: str) -> None:
    """Exit 2 with `line` as the last line and no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in proc.stderr


def assert_refused(proc: subprocess.CompletedProcess, line: str, ckpt: Path, canary: Path) -> None:
    """One line; nothing in the checkpoint ran, nothing of the user's is gone."""
    assert_one_line(proc, line)
    assert not canary.exists()
    assert ckpt.exists() and (ckpt.parent / "notes.txt").read_text() == "mine"


@pytest.fixture
def folder(tmp_path) -> Path:
    """Where the user keeps checkpoints, with a file of theirs."""
    path = tmp_path / "ckpts"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    return path


@pytest.fixture
def digits(trained_run) -> dict:
    """The checkpoint of a real training run of the template (shared, read only)."""
    return torch.load(trained_run / "checkpoints" / "last.ckpt", weights_only=True)


def test_checkpoint_that_would_run_code_is_refused_by_train_eval_and_export(digits, folder, tmp_path):
    canary = tmp_path / "canary"
    digits["callbacks"]["Canary"] = Canary(canary)
    ckpt = folder / "evil.ckpt"
    torch.save(digits, ckpt)
    args = [f"ckpt_path={ckpt}", *FAST]
    procs = together(
        lambda: run("train", *args, log_dir=tmp_path / "logs", check=False, env=untrusted()),
        lambda: run("eval", *args, log_dir=tmp_path / "logs", check=False, env=untrusted()),
        lambda: export(folder, "evil.ckpt"),
    )
    for proc, name in zip(procs, (ckpt, ckpt, "evil.ckpt"), strict=True):
        assert_refused(proc, refusal(name, "exec"), ckpt, canary)
    assert sorted(p.name for p in folder.iterdir()) == ["evil.ckpt", "notes.txt"]  # export wrote nothing


def test_trusted_checkpoint_loads_with_the_opt_in(digits, folder):
    """A user's checkpoint that holds a type of theirs (here a date) is refused, and loads with the opt-in."""
    digits["callbacks"]["Stamp"] = {"trained_on": datetime.date(2024, 5, 1)}
    torch.save(digits, folder / "mine.ckpt")
    assert_one_line(export(folder, "mine.ckpt"), refusal("mine.ckpt", "datetime.date"))
    done = export(folder, "mine.ckpt", env=clean_env(**{TRUST: "1"}))
    assert done.returncode == 0, done.stderr
    weights = torch.load(folder / "model.pt", weights_only=True)["state_dict"]
    want = {k.removeprefix("net."): v for k, v in digits["state_dict"].items() if k.startswith("net.")}
    assert weights.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in weights.items())


def sharded(digits: dict, path: Path, item=None) -> None:
    """`digits` as the sharded folder fsdp writes (DCP shards of "state_dict", the rest in meta.pt), written by
    this one process; `item`: one more non-tensor value among the shards (DCP torch.saves it by itself)."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": digits["state_dict"]} | ({"item": item} if item is not None else {})
    dcp.save(state, checkpoint_id=path, no_dist=True)
    torch.save({k: v for k, v in digits.items() if k not in ("state_dict", "optimizer_states")}, path / "meta.pt")


def test_sharded_checkpoint_that_would_run_code_is_refused(digits, folder, tmp_path):
    """A canary in each of the folder's pickles: meta.pt, DCP's .metadata (plain pickle in torch), an item."""
    canary = tmp_path / "canary"
    sharded(digits, folder / "item.ckpt", item=Canary(canary))
    sharded(digits, folder / "meta.ckpt")
    torch.save(
        {**torch.load(folder / "meta.ckpt" / "meta.pt", weights_only=True), "x": Canary(canary)},
        folder / "meta.ckpt" / "meta.pt",
    )
    sharded(digits, folder / "metadata.ckpt")
    metadata = folder / "metadata.ckpt" / ".metadata"
    saved = pickle.loads(metadata.read_bytes())
    saved.storage_meta.x = Canary(canary)
    metadata.write_bytes(pickle.dumps(saved))
    procs = together(*(lambda name=name: export(folder, name) for name in ("item.ckpt", "meta.ckpt", "metadata.ckpt")))
    assert_refused(procs[0], refusal("item.ckpt/__0_0.distcp (item)", "exec"), folder / "item.ckpt", canary)
    assert_refused(procs[1], refusal("meta.ckpt/meta.pt", "exec"), folder / "meta.ckpt", canary)
    assert_refused(procs[2], refusal("metadata.ckpt/.metadata", "builtins.exec"), folder / "metadata.ckpt", canary)


def test_checkpoint_of_another_width_or_model_is_refused_in_one_line(digits, folder, compose_cfg, tmp_path):
    """Resuming under a model of another width (single process, and fsdp, which reads the checkpoint itself) or
    another model, and evaluating a GPT checkpoint as the digits model: one line each, no traceback."""
    train_in_process(compose_cfg(*TINY_GPT, *ONE_BATCH))
    gpt = folder / "gpt.ckpt"
    shutil.copy(tmp_path / "checkpoints" / "last.ckpt", gpt)
    torch.save(digits, folder / "digits.ckpt")
    narrow = [f"ckpt_path={folder / 'digits.ckpt'}", *FAST, "model.net.channels=16"]
    logs = tmp_path / "logs"
    procs = together(
        lambda: run("train", *narrow, log_dir=logs, check=False),
        lambda: run("train", *narrow, "strategy=fsdp", log_dir=logs, check=False),
        lambda: run("train", f"ckpt_path={gpt}", *FAST, log_dir=logs, check=False),
        lambda: run("eval", f"ckpt_path={gpt}", *FAST, "model=digits", log_dir=logs, check=False),
    )
    width = (
        f"error: {folder / 'digits.ckpt'} does not fit the model: net.features.0.0.weight is 32x1x3x3 in the "
        "checkpoint, 16x1x3x3 in the model (a checkpoint of another model or size: use the model config it was "
        "trained with)."
    )
    model = (
        f"error: {gpt} does not fit the model: the model's net.features.0.0.weight (and 25 more) is missing from the "
        "checkpoint, and the checkpoint's net.tok_emb.weight (and 36 more) is not in the model (a checkpoint of "
        "another model or size: use the model config it was trained with)."
    )
    for proc, line in zip(procs, (width, width, model, model), strict=True):
        assert_one_line(proc, line)


def test_omegaconf_hyperparameters_load_weights_only(compose_cfg, tmp_path):
    """A module's DictConfig reaches the checkpoint as plain values (a weights-only load refuses OmegaConf's
    classes), and Lightning's load_from_checkpoint rebuilds the module from them."""
    cfg = compose_cfg(*ONE_BATCH)
    with open_dict(cfg):
        settings = OmegaConf.to_container(cfg.model, resolve=True)
        target = {k: settings.pop(k) for k in ("_target_", "_recursive_", "_convert_")}  # as model/digits.yaml's
        cfg.model = {**target, "_target_": f"{__name__}.KeepsOmegaConf", "cfg": settings}
    train_in_process(cfg)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["hparams_name"] == "cfg" and "hparams_type" not in saved
    assert type(saved["hyper_parameters"]) is dict and saved["hyper_parameters"]["net"]["channels"] == 32
    module = KeepsOmegaConf.load_from_checkpoint(ckpt, weights_only=True)
    assert isinstance(module.hparams, DictConfig) and module.hparams.net.channels == 32
    assert all(torch.equal(v, saved["state_dict"][k]) for k, v in module.state_dict().items())


# feature: deepspeed
def test_deepspeed_checkpoint_that_would_run_code_is_refused(folder, tmp_path):
    """A canary in the client state of a ZeRO-2 folder: refused by export (which reads the shards itself) and
    by a resume under deepspeed, whose engine would unpickle the folder's files in full."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra (pip install -e '.[deepspeed]')")
    zero2 = [*FAST, "strategy=deepspeed_stage_2", "trainer.max_epochs=1", "trainer.limit_train_batches=2"]
    run("train", *zero2, "run_id=ds", log_dir=tmp_path)
    ckpt = folder / "ds.ckpt"
    shutil.copytree(tmp_path / "train" / "runs" / "ds" / "checkpoints" / "last.ckpt", ckpt)
    states = ckpt / "checkpoint" / "mp_rank_00_model_states.pt"
    client = torch.load(states, weights_only=False)
    canary = tmp_path / "canary"
    torch.save({**client, "x": Canary(canary)}, states)
    resumed, exported = together(
        lambda: run("train", *zero2, f"ckpt_path={ckpt}", log_dir=tmp_path, check=False, env=untrusted()),
        lambda: export(folder, "ds.ckpt"),
    )
    assert_refused(resumed, refusal(states, "exec"), ckpt, canary)
    assert_refused(exported, refusal("ds.ckpt/checkpoint/mp_rank_00_model_states.pt", "exec"), ckpt, canary)


# /feature: deepspeed
def test_hyperparameters_are_saved_as_plain_data():
    """What RunState leaves of a module's hyperparameters: OmegaConf as plain dicts and lists, no OmegaConf class,
    objects (a lightning-hydra-template module's net and optimizer partial) left out and named."""
    checkpoint = {
        "hyper_parameters": {
            "cfg": OmegaConf.create({"lr": 0.1, "sizes": [8, 4]}),
            "net": torch.nn.Linear(2, 2),
            "optimizer": functools.partial(torch.optim.Adam, lr=0.1),
            "scale": torch.tensor(2.0),
        },
        "hparams_type": DictConfig,
        "datamodule_hyper_parameters": {"batch_size": 8, "split": (0.8, 0.2)},
    }
    assert plain_hyperparameters(checkpoint) == ["net", "optimizer"]
    assert checkpoint == {
        "hyper_parameters": {"cfg": {"lr": 0.1, "sizes": [8, 4]}, "scale": torch.tensor(2.0)},
        "datamodule_hyper_parameters": {"batch_size": 8, "split": (0.8, 0.2)},
    }
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["hyper_parameters"]["cfg"]["sizes"] == [8, 4]
