"""Atomic checkpoint writes (in the loop or on a writer thread), and reading any checkpoint this template writes
under any strategy."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from io import BytesIO
from pathlib import Path
from typing import Any
from weakref import proxy

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from mlproject.core.errors import CheckpointError
from mlproject.utils import compat
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


def replace_checkpoint(src: str | Path, dst: str | Path) -> None:
    """Move a checkpoint file or directory `src` to `dst`, replacing what is there.

    A file replaces a file in one atomic rename. rename(2) cannot replace a non-empty directory, so an
    existing `dst` is moved aside to `<dst>.old` first and deleted after; a crash between the two renames
    leaves `<dst>.old`, which `resolve_ckpt_path` resumes from.
    """
    src, dst = str(src), str(dst)
    # feature: object_storage
    from mlproject.checkpoint import object_storage

    if object_storage.is_remote(dst):
        object_storage.replace(src, dst)
        return
    # /feature: object_storage
    old = dst + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(dst) or (os.path.isdir(src) and os.path.exists(dst)):
        os.rename(dst, old)
    os.replace(src, dst)
    if os.path.isdir(old):
        shutil.rmtree(old)
    elif os.path.exists(old):
        os.remove(old)


def storage_error(exc: BaseException) -> BaseException | None:
    """The storage's own error behind `exc`, if that is what it is: an OSError (a full or read-only disk). DCP
    gathers every rank's failure into one exception: its first is taken."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    # feature: object_storage
    from mlproject.checkpoint import object_storage

    if object_storage.client_error(exc):
        return exc
    # /feature: object_storage
    return exc if isinstance(exc, OSError) else None


def unusable(what: str, path: str, exc: BaseException) -> CheckpointError:
    """The one line for a storage error on `path`: what failed, the storage's words for why, where to look."""
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
    look = "free space on its disk or make its folder writable"
    # feature: object_storage
    from mlproject.checkpoint import object_storage

    if object_storage.is_remote(path):
        look = "check the endpoint (AWS_ENDPOINT_URL), the credentials and the bucket"
    # /feature: object_storage
    return CheckpointError(f"{what}: {cause}; {look}, or set paths.ckpt_dir to another location")


@contextlib.contextmanager
def failing_save(tmp: str, path: str):
    """A storage error while saving `path` through `tmp` ends in one line naming `path` and the cause, and removes
    the part written to `tmp`; `path`, the previous checkpoint, is untouched until a save is complete."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if (cause := storage_error(exc)) is None:
            raise
        with contextlib.suppress(Exception):  # the storage that failed may refuse this too
            if os.path.isdir(tmp):
                shutil.rmtree(tmp)
            elif os.path.isfile(tmp):
                os.remove(tmp)
            # feature: object_storage
            else:  # in object storage
                from mlproject.checkpoint import object_storage

                object_storage.remove_remote(tmp)
            # /feature: object_storage
        raise unusable(f"could not save checkpoint {path} (the previous one is kept)", path, cause) from None


def save_atomically(trainer, path: str | Path, weights_only: bool = False, background: bool = False) -> None:
    """`trainer.save_checkpoint` under `<path>.tmp`, renamed into place by rank 0 once every rank has written
    (its shard); the previous checkpoint at `path` stays loadable until then. Called on every rank.

    With an AsyncCheckpointIO (callbacks.model_checkpoint.async_save) and `background`, this returns once
    the state is copied: the write and then the rename go on in a background thread. A save first waits for
    the one in flight, so at most one is. Without `background` (a SIGTERM's save) it returns once written.

    A storage error (a full or read-only disk, an unreachable endpoint) raises a CheckpointError naming `path` and
    removes `<path>.tmp`: here, or for a background save at the next save's wait or the run's end."""
    io = trainer.strategy.checkpoint_io
    writer = io if isinstance(io, AsyncCheckpointIO) else None
    if writer:
        writer.wait()  # the previous save, write and rename, is complete on this rank
    path, tmp = str(path), f"{path}.tmp"
    with failing_save(tmp, path):
        trainer.strategy.remove_checkpoint(tmp)  # the leftover of a save that was killed
        if writer:
            writer.wait()  # removed before any rank writes into it
        trainer.strategy.barrier("checkpoint_tmp_removed")
        trainer.save_checkpoint(tmp, weights_only)  # every rank; ends with a barrier
        if writer:
            # after the write, on the writer's thread, unless the write failed: rank 0 renames; every rank's job
            # turns its own write's storage error into this save's one line
            writer.then(replace_checkpoint if trainer.is_global_zero else None, tmp, path, saving=(tmp, path))
            if not background:
                writer.wait()
        elif trainer.is_global_zero:
            replace_checkpoint(tmp, path)
    trainer.strategy.barrier("checkpoint_renamed")


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint, but each checkpoint is written under `<name>.tmp` and renamed into place.

    Lightning writes straight to the final path, so a kill during a save leaves a truncated last.ckpt and
    no way back. Here the previous checkpoint stays until the new one is complete, for single files and
    for sharded directories alike. Every rank writes (its shard); rank 0 renames after all have finished.
    Retention (last + top-k) is Lightning's, which removes files and directories through the strategy.
    """

    def _monitor_candidates(self, trainer) -> dict[str, torch.Tensor]:
        # Until the first validation of a run (fresh or resumed) the monitored metric is unknown and Lightning
        # skips every step checkpoint, so a preemption loses the whole epoch. NaN ranks as the worst score:
        # last.ckpt is written, and a top-k slot only while fewer than k exist. After a validation a missing
        # metric is a typo, which Lightning reports.
        candidates = super()._monitor_candidates(trainer)
        if self.monitor and self.monitor not in candidates and not compat.validated_yet(trainer):
            candidates[self.monitor] = torch.tensor(float("nan"))
        return candidates

    def on_train_end(self, trainer, pl_module) -> None:
        # With every_n_train_steps the last save can predate the final steps; a finished run's last.ckpt
        # must hold its final state, or `ckpt_path=auto` would train the tail again.
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def __init__(self, *args, async_save: bool | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.async_save = async_save
        self.blocked_s: list[float] = []  # seconds each save of this stage held the training loop (logged at its end)

    def setup(self, trainer, pl_module, stage: str) -> None:
        try:  # Lightning lists the folder: the first touch of the storage, before any step
            super().setup(trainer, pl_module, stage)
        except Exception as exc:
            if self.dirpath is None or (cause := storage_error(exc)) is None:
                raise
            raise unusable(f"cannot use paths.ckpt_dir={self.dirpath}", self.dirpath, cause) from None
        # feature: object_storage
        from mlproject.checkpoint import object_storage

        if self.dirpath and object_storage.is_remote(self.dirpath):
            object_storage.check_strategy(self.dirpath, trainer.strategy)
        # /feature: object_storage
        if self.async_save is None:  # on where measured safe and worth it: DCP shards (fsdp, hsdp, ...)
            self.async_save = isinstance(trainer.strategy, ModelParallelStrategy)
        if self.async_save and not isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
            # feature: deepspeed
            from lightning.pytorch.strategies import DeepSpeedStrategy

            if isinstance(trainer.strategy, DeepSpeedStrategy):
                raise CheckpointError(
                    "callbacks.model_checkpoint.async_save=true is not supported under deepspeed "
                    "(DeepSpeed writes its own checkpoints); set it to false"
                )
            # /feature: deepspeed
            # through Strategy.checkpoint_io's public setter: this trainer's strategy only, no Lightning code replaced
            trainer.strategy.checkpoint_io = AsyncCheckpointIO(trainer.strategy.checkpoint_io)

    # feature: object_storage
    def _should_remove_checkpoint(self, trainer, previous: str, current: str) -> bool:
        from mlproject.checkpoint import object_storage

        # Lightning keeps the checkpoint a run resumed from on a local disk only; in object storage it
        # deletes it (Lightning issue 21813): a resumed run's retention must leave its source in place.
        if object_storage.is_remote(previous):
            return previous != current and previous != trainer.ckpt_path and previous.startswith(f"{self.dirpath}/")
        return super()._should_remove_checkpoint(trainer, previous, current)

    # /feature: object_storage
    def teardown(self, trainer, pl_module, stage: str) -> None:
        # Lightning's ModelParallelStrategy.teardown never calls its CheckpointIO's: flush here, on every rank
        if isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
            trainer.strategy.checkpoint_io.wait()
        super().teardown(trainer, pl_module, stage)
        if self.blocked_s:
            blocked = sorted(self.blocked_s)
            log.info(
                f"{len(blocked)} checkpoint save(s) ({'async' if self.async_save else 'sync'}) held training "
                f"{blocked[len(blocked) // 2] * 1000:.0f} ms each (median), {sum(blocked):.2f} s in all"
            )
            self.blocked_s = []

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        start = time.perf_counter()
        save_atomically(trainer, filepath, self.save_weights_only, background=self.async_save)
        self.blocked_s.append(time.perf_counter() - start)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))


def snapshot(obj: Any, storages: dict | None = None) -> Any:
    """A copy of a checkpoint on the CPU that training can no longer change: each tensor's storage copied
    once, so tensors that shared memory (tied weights) still share it, as `torch.save` records them."""
    storages = {} if storages is None else storages
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        if key not in storages:
            storages[key] = storage.clone() if storage.device.type == "cpu" else storage.cpu()
        return torch.empty(0, dtype=obj.dtype).set_(storages[key], obj.storage_offset(), obj.size(), obj.stride())
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v, storages)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(snapshot(v, storages) for v in obj)
    return copy.deepcopy(obj)


class AsyncCheckpointIO(CheckpointIO):
    """Writes checkpoints on one background thread: `save_checkpoint` copies the state (`snapshot`; DCP's
    `async_save` stages its shards itself) and returns; the write, and whatever `then` queues after it (the
    rename into place, retention's removals), run in order on the thread. `wait` blocks until all of it is
    done and raises the first error; Lightning's Strategy.teardown calls `teardown`, which waits, so the run
    never exits (or is requeued) with a save in flight. Lightning's own AsyncCheckpointIO keeps no order
    between a write and a removal and cannot take a DCP save."""

    def __init__(self, io: CheckpointIO):
        super().__init__()
        self.io = io
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._last: Future | None = None
        self._group = None  # a gloo group of its own for DCP's collectives on the writer thread

    def then(self, fn, *args, saving: tuple[str, str] | None = None) -> None:
        """Run `fn(*args)` (None: nothing) on the writer thread after what is queued, unless that failed; with
        `saving` (the `tmp` and `path` of a save), a storage error of either ends as that save's (failing_save)."""
        before = self._last

        def job():
            with failing_save(*saving) if saving else contextlib.nullcontext():
                if before is not None:
                    before.result()
                if fn is not None:
                    fn(*args)

        self._last = self._pool.submit(job)

    def wait(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.then(self.io.save_checkpoint, snapshot(checkpoint), path, storage_options)

    def save_sharded(self, state: dict[str, Any], path: Path, timeout=None) -> None:
        """torch.distributed.checkpoint.async_save of `state` into directory `path` (every rank): it copies
        this rank's shards to the CPU and returns; the writer thread waits for the write."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if self._group is None:  # every rank saves, so every rank creates it, in the same order
            # the strategy's timeout: a peer that died mid-save fails the write then, not after gloo's 30 min
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        result = dcp.async_save(state, checkpoint_id=path, process_group=self._group)
        done = getattr(result, "upload_completion", result)  # newer torch answers an AsyncSaveResponse
        self.then(done.result)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        self.wait()
        return self.io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        self.then(self.io.remove_checkpoint, path)  # never before the save queued ahead of it is in place

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            self.io.teardown()


class PortableCheckpointIO(TorchCheckpointIO):
    """Loads checkpoint directories (sharded: fsdp, tp; any format of convert.py) as well as single files, so a
    single-process or ddp run resumes from a checkpoint of any strategy and world size. It reads the
    checkpoint in full (convert.load_full): a rank of single or ddp holds the whole state anyway. A checkpoint
    that does not fit the LightningModule `module` is refused in one line (convert.check_fits)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        """Lightning's write (a folder's file through a temporary file moved into place, an object in one put)
        without its `except PermissionError`, which takes a refused write (a read-only folder, a bucket that
        denies it) for a saved checkpoint; save_atomically then fails on a `.tmp` that does not exist."""
        if storage_options is not None:  # Lightning's refusal of them
            return super().save_checkpoint(checkpoint, path, storage_options)
        from fsspec.core import url_to_fs

        buffer = BytesIO()
        torch.save(checkpoint, buffer)
        fs, url = url_to_fs(str(path))
        fs.makedirs(os.path.dirname(url), exist_ok=True)
        with fs.transaction:
            fs.pipe(url, buffer.getvalue())

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        from mlproject.checkpoint.convert import check_fits, load_full

        checkpoint = load_full(path)  # weights-only unless MLPROJECT_TRUST_CHECKPOINT=1, whatever Lightning passes
        if "state_dict" in checkpoint:  # ddp_spawn hands its trained weights back as a bare state dict
            check_fits(checkpoint["state_dict"], self.module, path)
        return checkpoint
