"""Test-only callbacks, named by `+callbacks.<key>._target_=tests.helpers.callbacks.<Class>` overrides."""

from __future__ import annotations

import os
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor


class RecordSteps(Callback):
    """The global training loss of every step and the full final state (of every rank, merged: pipeline stages
    hold different parameters), saved by rank 0 to `path`
    (default: `steps.pt` in the run directory) as {"losses", "state"}; with `checkpoint`, every rank also
    takes part in saving the final checkpoint as `last.ckpt` in the run directory."""

    def __init__(self, path: str | None = None, checkpoint: bool = False) -> None:
        self.path, self.checkpoint, self.losses = path, checkpoint, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The mean over ranks of each rank's mean loss = the loss of the whole global batch.
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    def on_train_end(self, trainer, pl_module) -> None:
        run_dir = Path(trainer.default_root_dir)
        if self.checkpoint:
            trainer.save_checkpoint(run_dir / "last.ckpt")
        gather = nullcontext()
        # feature: deepspeed
        params = list(pl_module.parameters())
        if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 holds a shard per rank: gather the full tensors
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(params)
        # /feature: deepspeed
        with gather:  # fsdp/tp hold DTensors: full_tensor() gathers them (a collective on every rank)
            state = {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
                for k, v in pl_module.state_dict().items()
            }
        if torch.distributed.is_initialized():  # pipeline stages hold different parameters: merge every rank's
            states = [None] * trainer.world_size
            torch.distributed.all_gather_object(states, state)
            state = {k: v for rank_state in states for k, v in rank_state.items()}
        if trainer.is_global_zero:
            torch.save({"losses": self.losses, "state": state}, self.path or run_dir / "steps.pt")


class KillAt(Callback):
    """SIGKILL this process (a real, uncatchable kill, no cleanup) when optimizer step `step` is about to
    run, on `rank` only or on every rank, after writing the wall time to `stamp` (if given), so a test can
    time what happens after the kill. Under torchrun, only in its first attempt (not after a restart)."""

    def __init__(self, step: int, rank: int | None = None, stamp: str | None = None):
        self.step, self.rank, self.stamp = step, rank, stamp

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank) and first_attempt:
            if self.stamp:
                Path(self.stamp).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


class SlowSteps(Callback):
    """Sleep after every training batch without changing what it computes, so a signal sent during
    training arrives while it still runs (12 tiny steps can otherwise finish before it is delivered)."""

    def __init__(self, seconds: float = 0.5):
        self.seconds = seconds

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.seconds)


class UntilSignalled(Callback):
    """Hold a fresh run after its first training step until a signal reaches this rank (at most `timeout` s), so
    that a signal sent once training runs arrives while it still runs however slowly the machine polls; a resumed
    run (requeued after that signal) is not held."""

    def __init__(self, timeout: float = 120):
        self.timeout = timeout

    def on_train_batch_end(self, trainer, *args) -> None:
        from mlproject.cluster.requeue import Signals

        if trainer.ckpt_path is not None or trainer.global_step != 1:
            return
        (signals,) = (c for c in trainer.callbacks if isinstance(c, Signals))
        deadline = time.monotonic() + self.timeout
        while not any(signals.received.values()) and time.monotonic() < deadline:
            time.sleep(0.05)


class KillMidSave(Callback):
    """SIGKILL this process half-way through writing the checkpoint of optimizer step `step`.

    Lightning writes a file checkpoint to a temporary file and then moves it to the path it was given;
    where the two lie on different filesystems (/tmp on local disk, checkpoints on a cluster filesystem)
    the move is a copy. The real move is cut here after half the bytes, as a kill during that copy cuts it.
    """

    def __init__(self, step: int):
        self.step = step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step != self.step:
            return
        from fsspec.implementations.local import LocalFileOpener

        def commit(opener) -> None:
            opener.f.close()
            data = Path(opener.temp).read_bytes()
            with open(opener.path, "wb") as f:
                f.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

        LocalFileOpener.commit = commit


class ExitProbe(Callback):
    """Writes `<dir>/rank<r>.txt`: "atexit" when the exit hooks run, "teardown" when interpreter teardown
    collects this callback. A distributed job that ended well runs the first and skips the second."""

    def __init__(self, dir: str):
        self.dir, self.path = Path(dir), None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.path is None:  # once: fit and test both set up
            self.path = self.dir / f"rank{trainer.global_rank}.txt"
            import atexit

            atexit.register(self._write, "atexit")

    def _write(self, what: str) -> None:
        with open(self.path, "a") as f:
            f.write(what + "\n")

    def __del__(self) -> None:
        if self.path is not None:
            self._write("teardown")


class CountGradientAllReduces(Callback):
    """Count the gradient all-reduces DDP issues in each micro-batch, and save them (rank 0) to `path` as a list
    of (batch_idx, calls). DDP's reducer calls its communication hook once per gradient bucket; the hook here is
    torch's default one (`allreduce_hook`, which calls torch.distributed.all_reduce), with
    torch.distributed.all_reduce wrapped to count: the real collectives run."""

    def __init__(self, path: str) -> None:
        self.path, self.calls, self.counts = path, 0, []

    def on_train_start(self, trainer, pl_module) -> None:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        real = dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        dist.all_reduce = counted  # allreduce_hook looks it up in torch.distributed at each call
        trainer.strategy.model.register_comm_hook(None, allreduce_hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.calls = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts.append((batch_idx, self.calls))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            torch.save(self.counts, self.path)


class PoisonLoss(Callback):
    """Multiply the training loss by NaN at the optimizer steps `steps` (0-based, as the loggers count), on
    `rank` only or on every rank: a model that diverges at known steps, its weights NaN after the step."""

    def __init__(self, steps: list[int], rank: int | None = None):
        self.steps, self.rank = list(steps), rank

    def setup(self, trainer, pl_module, stage: str) -> None:
        training_step = pl_module.training_step

        def poisoned(*args, **kwargs):
            loss = training_step(*args, **kwargs)
            hit = trainer.global_step in self.steps and self.rank in (None, trainer.global_rank)
            return loss * float("nan") if hit else loss

        if stage == "fit":
            pl_module.training_step = poisoned


class RecordWeights(Callback):
    """The full trainable parameters at the start of training and after every optimizer step (not micro-batch),
    saved by rank 0 to `path` as a list of {name: tensor}: what a hand-computed EMA is made from."""

    def __init__(self, path: str) -> None:
        self.path, self.weights, self.step = path, [], None

    def _record(self, trainer, pl_module) -> None:
        self.step = trainer.global_step
        full = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for n, p in pl_module.named_parameters()
            if p.requires_grad
        }
        self.weights.append(full)

    def on_train_start(self, trainer, pl_module) -> None:
        self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step != self.step:
            self._record(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            torch.save(self.weights, self.path)


def peak_rss() -> int:
    """This process's peak resident memory in bytes, as the kernel measured it (VmHWM). Not ru_maxrss, which a
    process keeps across exec from the one that forked it: a rank started by pytest would report pytest's own
    peak (measured: 1.2 GiB late in the suite)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


class PeakMemory(Callback):
    """Writes this process's peak resident memory (peak_rss, in bytes) to `<dir>/rank<r>.rss` when training
    ends: measured by the kernel, whatever the process allocated or mapped on the way."""

    def __init__(self, dir: str):
        self.dir = Path(dir)

    def on_train_end(self, trainer, pl_module) -> None:
        (self.dir / f"rank{trainer.global_rank}.rss").write_text(str(peak_rss()))


class HostMemory(Callback):
    """Each rank's peak resident host memory (peak_rss) when training starts, after Lightning restored any
    checkpoint and before the first step, saved as `<path>/rank<r>.json` (bytes); with `checkpoint`, then
    the state as restored, saved as `<path>/start.ckpt` (every rank takes part), to compare with the
    checkpoint resumed."""

    def __init__(self, path: str, checkpoint: bool = False) -> None:
        self.path, self.checkpoint = Path(path), checkpoint

    def on_train_start(self, trainer, pl_module) -> None:
        import json

        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(peak_rss()))
        if self.checkpoint:
            trainer.save_checkpoint(self.path / "start.ckpt")
