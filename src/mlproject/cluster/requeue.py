"""Signals and divergence during training, decided by all ranks together at optimizer-step boundaries.

- SIGTERM (a scheduler's preemption or stop, a container stop, `kill`): save last.ckpt, exit 143.
- A non-finite training loss: stop with one line naming the first such step, exit 3, and never write a
  checkpoint of the weights it produced; or, with `divergence.skip=true`, zero that step's gradients and go
  on, up to `divergence.max_skipped` such steps.

A signal handler only notes the signal, and the loss is checked on the device (no sync). Every
`every_n_steps` optimizer steps all ranks agree on what any of them received or saw in one small all-reduce,
and act together at that step: a rank that acted alone would leave the others waiting in their next
collective. So a signal is honoured within `every_n_steps` optimizer steps of its arrival (plus the step
under way), steps in between carry no collective of ours, and the checks fall only where an optimizer step
has just ended, never between the micro-batches of gradient accumulation. A checkpoint written between two
checks (ModelCheckpoint runs after every other callback) is preceded by a check of its own, so it can
never hold the weights of a non-finite step.

Every save here goes through `save_atomically`, like every ModelCheckpoint save, into the checkpoint
callback's directory: where `ckpt_path=auto` looks.

Lightning 2.6 instead broadcasts a SIGTERM flag from rank 0 and reads it back (`.item()`) at every training
step when world size > 1 (loops/training_epoch_loop.py: _broadcast_sigterm_tensor; upstream issue
Lightning-AI/pytorch-lightning#21487): a collective and a host-device sync per step. `Signals` takes that
broadcast off the step, and the matching one out of Lightning's SIGTERM handler, and checks here instead.
build_trainer adds `Signals` to every run where the config names no subclass of it (a cluster's may: one that
also acts on a scheduler's own signals, adding them to `received` and overriding `leave`).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.nn.utils import get_total_norm

from mlproject.checkpoint.storage import save_atomically
from mlproject.core.constants import EXIT_DIVERGED, EXIT_SIGTERM
from mlproject.utils import compat
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)

EXIT_OOM = 1  # out of memory: the one line above says where and what to run
NEVER = 2**62  # "no non-finite step yet"; the first such step is agreed as the smallest over ranks


class Signals(L.Callback):
    """Save and stop on SIGTERM, stop (or skip) on a non-finite loss; checked every `every_n_steps`
    optimizer steps on all ranks at once."""

    def __init__(
        self, every_n_steps: int = 10, skip_nonfinite: bool = False, max_skipped: int = 10, straggler_ratio: float = 1.5
    ):
        self.every_n_steps, self.skip_nonfinite, self.max_skipped = every_n_steps, skip_nonfinite, max_skipped
        self.straggler_ratio = straggler_ratio
        self._mark, self._busy, self._batches, self._warned = 0.0, 0.0, 0, False  # step times: on_before_backward
        self.received = {signal.SIGTERM: False}
        self._last_step = self._checked_step = -1
        self._skipped_seen = 0
        self._sharded = False  # whether ranks hold different parts of the gradients (on_train_start)
        self._first_nonfinite = self._skipped = self._losses = None  # on the device, from on_train_start

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before Lightning registers its handlers (as fit starts): its SIGTERM handler broadcasts from rank 0,
        # a collective no other rank would meet once the per-step broadcast below is gone; ours only notes it.
        # Lightning has no public switch for either (upstream #21487): both are set on this trainer only.
        compat.quiet_sigterm(trainer, self._on_signal)  # see the module docstring

    def _on_signal(self, signum, frame) -> None:
        self.received[signum] = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # feature: deepspeed
        from mlproject.core.errors import ConfigError

        if self.skip_nonfinite and "DeepSpeed" in type(trainer.strategy).__name__:
            raise ConfigError(
                "divergence.skip=true cannot zero DeepSpeed's gradients (it keeps them outside the parameters); "
                "use divergence.skip=false (stop on a non-finite loss)"
            )
        # /feature: deepspeed
        device = trainer.strategy.root_device
        self._first_nonfinite = torch.tensor(NEVER, device=device)
        self._skipped = torch.tensor(0, device=device)
        # the loss of each step since the last check, at (step % every_n_steps): one in-place add a micro-batch,
        # where a per-step isfinite and flag update took ~70 us of CPU a step (and as many GPU launches)
        self._losses = torch.zeros(self.every_n_steps, device=device)
        self._last_step = self._checked_step = trainer.global_step  # a resumed run starts at its checkpoint
        self._mark, self._busy, self._batches = None, 0.0, 0
        # Sharded parameters (fsdp, hsdp, ...): each rank sees only its part of the gradients, where a NaN may not
        # be, and ranks deciding alone would apply a partial step. With skip_nonfinite they agree in one small
        # all-reduce a step (DDP's gradients are whole on every rank: none there).
        distributed = dist.is_available() and dist.is_initialized()
        self._sharded = distributed and any(hasattr(p, "to_local") for p in pl_module.parameters())
        # feature: pipeline
        self._sharded |= distributed and getattr(pl_module, "pipeline", None) is not None  # a stage's own, likewise
        # /feature: pipeline

    def on_train_batch_start(self, *args) -> None:
        if self._mark is None:  # the first batch of the run or after a validation: its loading is not timed
            self._mark = -1.0

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        # A rank's own time: from the end of its last batch to its backward (loading, forward). Later, in backward's
        # gradient all-reduce, the ranks wait for the slowest, and every rank's wall-clock step is the same.
        if self._mark >= 0:
            self._busy, self._batches = self._busy + time.perf_counter() - self._mark, self._batches + 1
        # a sum over the step's micro-batches: non-finite if any of them is
        self._losses[trainer.global_step % self.every_n_steps].add_(loss.detach())

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if not self.skip_nonfinite:
            return
        # Gradients are what the step applies, and under ddp they hold every rank's loss (a NaN spreads in the
        # all-reduce), so every rank skips alike. Zeroed, not skipped: deciding to skip on the host would cost
        # a sync per step; AdamW then applies only its momentum and weight decay.
        loss = self._losses[trainer.global_step % self.every_n_steps]
        bad = ~torch.isfinite(loss)
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # DTensor: this rank's shard
        if local:
            bad |= ~torch.isfinite(get_total_norm(local))
        if self._sharded:
            flag = bad.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = flag.bool()
        for g in local:
            g.masked_fill_(bad, 0)
        self._skipped += bad
        loss.masked_fill_(bad, float("nan"))  # a step skipped for its gradients counts as non-finite too

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        step = trainer.global_step  # the same on every rank; unchanged between accumulated micro-batches
        stepped, self._last_step = step != self._last_step, step
        if stepped and step % self.every_n_steps == 0:
            agreed = self.agree(trainer)
            self.report_step_times(trainer, agreed["step_times"])
            self.act(trainer, agreed)
        self._mark = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark = None  # validation is no training step

    def report_step_times(self, trainer: L.Trainer, times: list[float]) -> None:
        """Log the slowest and fastest rank's mean step time, and warn once naming a rank slower than
        straggler_ratio x the median rank's (the lower middle one): every rank waits for it at each step."""
        if not times or min(times) <= 0:
            return
        slowest = max(range(len(times)), key=times.__getitem__)
        for logger in trainer.loggers:
            logger.log_metrics(
                {"perf/step_time_max": max(times), "perf/step_time_min": min(times)}, trainer.global_step
            )
        median = sorted(times)[(len(times) - 1) // 2]
        if not self._warned and times[slowest] > self.straggler_ratio * median:
            self._warned = True
            log.warning(
                f"rank {slowest} is a straggler: {times[slowest]:.3f} s a step (loading and forward) against the "
                f"median rank's {median:.3f} s, over {self.straggler_ratio:g}x (cluster.straggler_ratio); every rank "
                "waits for it: look at its node (another job, a slow disk, a throttled GPU)"
            )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """An out-of-memory error ends the run in one line: the rank, the step, the device's figures and what to
        change (debug=memory records where it went)."""
        if not isinstance(exception, torch.OutOfMemoryError):
            return
        device, figures = trainer.strategy.root_device, "host memory"
        if device.type == "cuda":
            gib = 2**30
            peak, reserved = torch.cuda.max_memory_allocated(device) / gib, torch.cuda.memory_reserved(device) / gib
            total = torch.cuda.get_device_properties(device).total_memory / gib
            figures = f"{peak:.2f} GiB peak allocated, {reserved:.2f} GiB reserved, of {total:.2f} GiB"
        fix = "raise trainer.accumulate_grad_batches (smaller micro-batches, same global batch) or shard: strategy=fsdp"
        # feature: planner
        from hydra.core.hydra_config import HydraConfig

        args = " ".join(HydraConfig.get().overrides.task) if HydraConfig.initialized() else ""
        fix = f'`make plan ARGS="{args}"` shows what each layout needs per rank and which fit'
        # /feature: planner
        print(
            f"error: out of memory on rank {trainer.global_rank} at step {trainer.global_step} ({figures}); {fix}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_OOM) from None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # A save (every rank is in it) at a step no check has covered: check the loss first, so that no
        # checkpoint holds the weights of a non-finite step. Signals wait for the next regular check.
        training = trainer.state.fn == "fit" and self._first_nonfinite is not None
        if training and trainer.global_step != self._checked_step:
            self.check_loss(trainer, self.agree(trainer))

    def agree(self, trainer: L.Trainer) -> dict:
        """What any rank received or saw, and every rank's mean step time since the last check (microseconds, in
        its own slot), agreed by all: one all-reduce (MAX) and one read of its result."""
        self._note_first_nonfinite()
        self._checked_step = trainer.global_step
        distributed = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
        flags = torch.tensor(list(self.received.values()), dtype=torch.int64, device=self._skipped.device)
        times = torch.zeros(world, dtype=torch.int64, device=flags.device)
        if self._batches:  # the batches timed since the last check (the first one after a validation is not)
            times[rank] = int(1e6 * self._busy / self._batches * trainer.accumulate_grad_batches)
        self._busy, self._batches = 0.0, 0
        state = torch.cat([flags, torch.stack([NEVER - self._first_nonfinite, self._skipped]), times])
        if distributed:
            dist.all_reduce(state, op=dist.ReduceOp.MAX)  # not strategy.reduce: it adds a barrier before
        values, n = state.tolist(), len(self.received)
        return {
            **dict(zip(self.received, values[:n], strict=True)),
            "first_nonfinite": NEVER - values[n],
            "skipped": values[n + 1],
            "step_times": [t / 1e6 for t in values[n + 2 :]],
        }

    def _note_first_nonfinite(self) -> None:
        """Fold the first non-finite step since the last check into _first_nonfinite, and clear the window. Checks
        are at most every_n_steps steps apart, so the steps since the last one have distinct slots."""
        n, last = self.every_n_steps, self._checked_step
        steps = last + (torch.arange(n, device=self._losses.device) - last) % n  # the step each slot holds
        first = torch.where(torch.isfinite(self._losses), NEVER, steps).min()
        self._first_nonfinite = torch.minimum(self._first_nonfinite, first)
        self._losses.zero_()

    def check_loss(self, trainer: L.Trainer, agreed: dict) -> None:
        first, skipped = agreed["first_nonfinite"], agreed["skipped"]
        if first == NEVER:
            return
        if not self.skip_nonfinite:
            self.stop(trainer, f"training diverged: non-finite loss at step {first}")
        if skipped > self.max_skipped:
            self.stop(
                trainer,
                f"training diverged: {skipped} steps with a non-finite loss skipped, more than "
                f"divergence.max_skipped={self.max_skipped}; the first at step {first}",
            )
        if skipped > self._skipped_seen:
            self._skipped_seen = skipped
            log.warning(f"skipped {skipped} step(s) with a non-finite loss so far, the first at step {first}")

    def stop(self, trainer: L.Trainer, message: str) -> None:
        if trainer.is_global_zero:
            ckpt = trainer.checkpoint_callback
            kept = f"; {ckpt.last_model_path} is the last good state" if ckpt and ckpt.last_model_path else ""
            print(f"error: {message}{kept}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_DIVERGED)  # on every rank at this step

    def act(self, trainer: L.Trainer, agreed: dict) -> None:
        self.check_loss(trainer, agreed)
        if any(agreed[signum] for signum in self.received):
            self.leave(trainer, agreed, self.save(trainer))

    def leave(self, trainer: L.Trainer, agreed: dict, saved: str) -> None:
        log.info(f"SIGTERM: saved {saved} at step {trainer.global_step}; exiting with code {EXIT_SIGTERM}")
        raise SIGTERMException(EXIT_SIGTERM)  # on every rank at this step; Lightning ends the run

    def save(self, trainer: L.Trainer) -> str:
        """Write last.ckpt where `ckpt_path=auto` looks (the checkpoint callback's directory), atomically."""
        ckpt = trainer.checkpoint_callback
        folder = ckpt.dirpath if ckpt and ckpt.dirpath else Path(trainer.default_root_dir) / "checkpoints"
        path = f"{folder}/last.ckpt"  # folder may be a URL, which Path would mangle
        save_atomically(trainer, path)
        return path
