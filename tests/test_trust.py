"""A run never destroys what is not its own, one live run per directory, and a bug in code keeps its frame.

Each case runs in a throwaway folder that stands for a user's project (a `.git` folder and a file of theirs) and
checks that it survives the refused run.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

import pytest

from mlproject.core import rundir
from mlproject.core.rundir import LOCK
from tests.helpers.processes import FAST, PYTHON, clean_env, kill_group, run, run_dirs, run_in_process, with_path

# Two steps of whichever example is the project's default (the GPT's take ~1 s each on one thread), no test stage.
SHORT = [*FAST, "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false"]
USER_MODULE = """import lightning as L
import torch


class Broken(L.LightningModule):
    def __init__(self, layers: int = 2):
        super().__init__()
        sizes = [64, 32]
        self.fc = torch.nn.Linear(sizes[layers], 10)


class Narrow(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Images(L.LightningDataModule):  # 8x8 images, whichever examples the project keeps
    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(128, 8, 8), torch.randint(0, 10, (128,)))
        return torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
"""


@pytest.fixture
def project(tmp_path) -> Path:
    root = tmp_path / "project"
    (root / ".git").mkdir(parents=True)
    (root / "notes.txt").write_text("mine")
    return root


def survives(root: Path) -> None:
    assert (root / "notes.txt").read_text() == "mine" and (root / ".git").is_dir()


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error: ")]


def test_export_of_a_mistyped_checkpoint_keeps_the_project(project):
    """configs/export.yaml writes into `.`: the project root a user runs `make export` from."""
    proc = subprocess.run(
        [PYTHON, "-m", "mlproject.export", "ckpt_path=typo.ckpt"],
        cwd=project,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and len(error_lines(proc.stderr)) == 1 and "typo.ckpt" in proc.stderr, proc.stderr
    survives(project)
    assert sorted(p.name for p in project.iterdir()) == [".git", "notes.txt"]


def test_refused_run_keeps_a_directory_it_did_not_create(project, tmp_path):
    proc = run("train", f"hydra.run.dir={project}", "ckpt_path=typo.ckpt", *SHORT, log_dir=tmp_path, check=False)
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == ["error: ckpt_path=typo.ckpt does not exist; give the path of a .ckpt file."]
    assert f"note: kept {project}: it existed before this command" in proc.stderr
    survives(project)
    assert not (project / LOCK).exists()


def test_refused_run_removes_the_directory_it_created(tmp_path):
    rundir.trained()  # an earlier run in this process (a notebook's, another test's) trained: not this one
    code, stderr = run_in_process("train", "trainer=cpu", "ckpt_path=typo.ckpt", "run_id=mine", log_dir=tmp_path)
    assert code == 2 and not (tmp_path / "train/runs/mine").exists()


@pytest.mark.parametrize(
    ("key", "value"),
    [("run_id", "../../.."), ("run_id", "a/b"), ("task_name", "../x"), ("task_name", "x\\n--wrap=touch")],
)
def test_names_are_one_folder(key, value, project):
    """A path or a newline in a name is refused before Hydra creates or writes anything (a newline can only come
    from a config file: the command line's grammar has none)."""
    (project / "experiment").mkdir()
    (project / "experiment/names.yaml").write_text(f'# @package _global_\n{key}: "{value}"\n')
    log_dir = project / "a/b/logs"
    code, stderr = run_in_process(
        "train", "trainer=cpu", f"hydra.searchpath=[file://{project}]", "experiment=names", log_dir=log_dir
    )
    assert code == 2
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"error: {key}=") and "must be one folder name" in line
    survives(project)
    assert sorted(p.name for p in project.iterdir()) == [".git", "experiment", "notes.txt"]


def test_a_second_run_under_a_live_runs_id_is_refused(tmp_path):
    """The live run keeps its directory, its config and its lock, and ends well."""
    slow = ["+callbacks.slow._target_=tests.helpers.callbacks.SlowSteps", "+callbacks.slow.seconds=3"]
    cmd = [PYTHON, "-m", "mlproject.train", f"paths.log_dir={tmp_path}", "run_id=live", *SHORT, *slow]
    live = subprocess.Popen(cmd, env=clean_env(), text=True, start_new_session=True, **OUT)
    try:
        run_dir = tmp_path / "train/runs/live"
        deadline = time.monotonic() + 240  # the warm interpreter may still be starting
        while not (run_dir / ".hydra/overrides.yaml").exists() and live.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        code, stderr = run_in_process("train", "trainer=cpu", "run_id=live", "trainer.max_epochs=1", log_dir=tmp_path)
        (line,) = stderr.strip().splitlines()
        assert code == 2 and line.startswith(f"error: run directory {run_dir} is in use by another run (pid "), line
        assert "give this run another run_id=" in line
        out, err = live.communicate(timeout=240)
    finally:
        kill_group(live.pid)
    assert live.returncode == 0, err[-3000:]
    assert (run_dir / "checkpoints/last.ckpt").exists() and not (run_dir / LOCK).exists()
    assert "+callbacks.slow.seconds=3" in (run_dir / ".hydra/overrides.yaml").read_text()


OUT = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}


def test_the_lock_of_a_dead_run_is_taken_over(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    run_dir = tmp_path / "train/runs/again"
    run_dir.mkdir(parents=True)
    lock = f'{{"host": "{__import__("socket").gethostname()}", "pid": {dead.pid}, "start": "1", "since": "earlier"}}'
    (run_dir / LOCK).write_text(lock)
    proc = run("train", "run_id=again", *SHORT, log_dir=tmp_path)
    assert f"warning: {run_dir}: took over the lock of pid {dead.pid} on " in proc.stderr
    assert (run_dir / "metrics.json").exists() and not (run_dir / LOCK).exists()


@pytest.fixture
def user_code(tmp_path) -> dict:
    (tmp_path / "user").mkdir()
    (tmp_path / "user/mymodel.py").write_text(USER_MODULE)
    return with_path(tmp_path / "user")


def test_a_bug_in_the_users_constructor_keeps_its_frame(tmp_path, user_code):
    """Not "model could not be built": the user's file, line and exception, in a few lines; train.log is kept."""
    model = ["~model", "+model={_target_: mymodel.Broken}", "run_id=bug"]
    proc = run("train", *model, *SHORT, log_dir=tmp_path, env=user_code, check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    lines = lines[lines.index(error_lines(proc.stderr)[0]) :]  # Lightning's own messages come before
    assert lines[0] == "error: IndexError: list index out of range"
    assert lines[1] == f'  File "{tmp_path}/user/mymodel.py", line 9, in __init__'
    assert lines[2].strip() == "self.fc = torch.nn.Linear(sizes[layers], 10)"
    assert lines[-1].startswith(f"(the full traceback is in {tmp_path}/train/runs/bug/train.log") and len(lines) <= 6
    assert "IndexError: list index out of range" in (tmp_path / "train/runs/bug/train.log").read_text()


def test_a_shape_error_at_the_first_batch_names_the_layer_and_both_shapes(tmp_path, user_code):
    model = ["~model", "+model={_target_: mymodel.Narrow}", "~data", "+data={_target_: mymodel.Images}"]
    proc = run("train", *model, *SHORT, log_dir=tmp_path, env=user_code, check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line.startswith(
        f"error: at the first batch, fc (Linear, weight 10x32) got input 64x64 ({tmp_path}/user/mymodel.py:18): "
        "mat1 and mat2 shapes cannot be multiplied (64x64 and 32x10)"
    ), line


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment/bad.yaml").write_text("# @package _global_\nseed: 7\nfoo: [1, 2\nbar: 3\n")
    code, stderr = run_in_process(
        "train", "trainer=cpu", f"hydra.searchpath=[file://{tmp_path}]", "experiment=bad", log_dir=tmp_path / "logs"
    )
    assert code == 2
    assert stderr.strip() == (
        f"error: {tmp_path}/experiment/bad.yaml:4:4: not valid YAML (while parsing a flow sequence expected ',' "
        "or ']', but got ':'); fix that line of the file."
    )
    assert not (tmp_path / "logs").exists()


def test_auto_resume_without_a_run_id_says_it_starts_fresh(tmp_path, monkeypatch, caplog):
    from mlproject.checkpoint.resume import resolve_ckpt_path
    from mlproject.core.resolvers import run_id

    for var in (
        "MLPROJECT_RUN_ID",
        "TORCHELASTIC_RUN_ID",
        # feature: slurm
        "SLURM_JOB_ID",
        # /feature: slurm
    ):
        monkeypatch.delenv(var, raising=False)
    new = run_id()
    with caplog.at_level(logging.WARNING):
        assert resolve_ckpt_path("auto", tmp_path / new) is None
    assert f"ckpt_path=auto starts fresh: no run_id= was given, so this run has a new id ({new})" in caplog.text
    assert not run_dirs(tmp_path)
