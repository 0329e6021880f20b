"""Storage that fails under a run ends it in one line naming the path and the cause, leaves no partial checkpoint
and keeps the previous one: a full disk and a read-only folder, each made real inside the training process after
its first checkpoint (Fault); an unreachable endpoint is test_s3_errors.py's. A URL where a run writes plain files
is refused before any folder is made."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from mlproject.checkpoint.convert import load_full
from tests.checkpoint.helpers import BASE, run_dir
from tests.helpers.processes import run, run_in_process

# one epoch of 19 steps, last.ckpt every 2: the fault comes at step 3, after step 2's checkpoint
EVERY_2 = [*BASE, "trainer.max_epochs=1", "test=false", "callbacks.last_checkpoint.every_n_train_steps=2"]


def drop_dac_override() -> None:
    """Root writes into a folder whatever its mode (CAP_DAC_OVERRIDE); without it root is held to the mode as the
    folder's owner. Dropped from this thread's effective capabilities: the training loop's, which writes a save
    made without async_save."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0].effective &= ~(1 << 1)  # CAP_DAC_OVERRIDE
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


class Fault(Callback):
    """When optimizer step `step` starts, the checkpoints' storage fails for real, the way `kind` says:
    full: this process's files are capped below the size of a checkpoint (RLIMIT_FSIZE): the kernel fails a write
      past it with EFBIG, as a full disk fails it with ENOSPC (SIGXFSZ ignored, so that the write fails instead
      of the process being killed);
    read_only: the checkpoint folder's mode is 555, and this thread lost root's right to ignore it;
    outage: the forwarder `pid` that is the run's storage endpoint is killed: connections to it are refused."""

    def __init__(self, kind: str, step: int = 3, pid: int | None = None, port: int | None = None):
        self.kind, self.step, self.pid, self.port = kind, step, pid, port

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        folder = trainer.checkpoint_callback.dirpath
        if self.kind == "full":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            size = os.path.getsize(f"{folder}/last.ckpt")
            resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        elif self.kind == "read_only":
            os.chmod(folder, 0o555)
            drop_dac_override()
        else:
            os.kill(self.pid, signal.SIGKILL)
            while socket.socket().connect_ex(("127.0.0.1", self.port)) == 0:  # until the kernel has closed it
                time.sleep(0.05)


def fault(kind: str, **args) -> list[str]:
    target = f"+callbacks.fault._target_={__name__}.Fault"
    return [target, f"+callbacks.fault.kind={kind}", *(f"+callbacks.fault.{k}={v}" for k, v in args.items())]


def one_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The run's only `error:` line, with `words` in it; no traceback."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(word in errors[0] for word in words), errors[0]
    return errors[0]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_ends_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, async_save):
    """With async_save the write fails on the writer thread: the next save reports it."""
    proc = run(
        "train",
        *EVERY_2,
        "run_id=full",
        f"callbacks.model_checkpoint.async_save={str(async_save).lower()}",
        *fault("full"),
        log_dir=tmp_path,
        check=False,
    )
    ckpts = run_dir(tmp_path, "full") / "checkpoints"
    one_line(
        proc, f"could not save checkpoint {ckpts}/last.ckpt (the previous one is kept): File too large; free space"
    )
    assert not list(ckpts.glob("*.tmp"))
    assert load_full(ckpts / "last.ckpt")["global_step"] == 2


def test_a_read_only_folder_ends_in_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    proc = run("train", *EVERY_2, "run_id=ro", *fault("read_only"), log_dir=tmp_path, check=False)
    ckpts = run_dir(tmp_path, "ro") / "checkpoints"
    one_line(proc, f"could not save checkpoint {ckpts}/last.ckpt (the previous one is kept): Permission denied; ")
    assert not list(ckpts.glob("*.tmp"))
    assert load_full(ckpts / "last.ckpt")["global_step"] == 2


@pytest.mark.parametrize("key", ["paths.log_dir", "paths.output_dir", "paths.data_dir"])
def test_a_url_where_a_run_writes_files_is_refused_before_any_folder_is_made(tmp_path, monkeypatch, key):
    """`s3://bucket/x` would be a local folder `s3:` under the working directory (for paths.log_dir: Hydra's run
    directory)."""
    monkeypatch.chdir(tmp_path)
    code, stderr = run_in_process(
        "train", "trainer=cpu", "extras.print_config=false", f"{key}=s3://bucket/x", log_dir=Path("logs")
    )
    assert code == 2
    assert stderr.strip().splitlines()[-1].startswith(f"error: {key}=s3://bucket/x is a URL")
    assert not [p for p in tmp_path.rglob("*") if "s3:" in p.name]
