"""Pipeline parallelism with torch.distributed.pipelining, torchtitan's way, on the `pipeline` mesh dimension.

The network's blocks divide evenly into stages; the first stage also runs the modules the model's plan names
`first` (embeddings), the last the ones named `last` (final norm, head). Rank r of the pipeline group runs
stage r (gpipe, 1f1b) or stages r, r + P, ... (interleaved_1f1b: 2 per rank, the loop order torch's
interleaved schedule expects). Each stage is a view of the one network: a shallow copy that shares its
modules but keeps only the stage's, so the LightningModule's `net` (pruned to this rank's stages) still
holds every parameter of the rank once, under its original name: the optimizer, the state dict and the
checkpoints see one network, and a checkpoint's keys are the single process's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def stages_per_rank(schedule: str) -> int:
    """Interleaving needs at least 2 stages per rank: its smaller bubble comes from the extra, shorter stages."""
    return 2 if schedule == "interleaved_1f1b" else 1


def min_microbatches(schedule: str, size: int) -> int:
    """torch's 1F1B schedules want a micro-batch in flight on every stage; GPipe runs with any number."""
    return 1 if schedule == "gpipe" else size


def bubble_fraction(schedule: str, size: int, microbatches: int) -> float:
    """Share of a step a rank idles, in the schedule's ideal timing: (P - 1) / (M + P - 1) for GPipe and 1F1B
    (P - 1 forward and backward slots of warm-up and drain around M micro-batches), the stages shorter by
    the number of stages per rank V when interleaved: (P - 1) / (V M + P - 1)."""
    v = stages_per_rank(schedule)
    return (size - 1) / (v * microbatches + size - 1)


def in_flight(schedule: str, size: int, microbatches: int, rank: int) -> int:
    """Forwards of one stage on one micro-batch whose activations pipeline rank `rank` holds at its peak, in
    torch's schedules: GPipe runs every forward before the first backward (M); 1F1B runs P - rank forwards
    before its first backward (the first stage P); interleaved 1F1B warms up with (V - 1) m + 2 (P - 1 - rank)
    forwards, m = M / max(1, M // P) the micro-batches of a round, and runs one more before its first backward
    (at most all V M)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, size - rank)
    v, per_round = stages_per_rank(schedule), microbatches // max(1, microbatches // size)
    return min((v - 1) * per_round + 2 * (size - 1 - rank) + 1, v * microbatches)


def stage_view(net: nn.Module, stage: int, num_stages: int, layers: str, first=(), last=()) -> nn.Module:
    """`net` as pipeline stage `stage` sees it: its share of the `layers` blocks (a ModuleDict), the `first`
    modules on the first stage only and the `last` ones on the last stage only (None elsewhere: the network's
    forward must skip a None module, as the GPT's does). A shallow copy with its own registries of modules,
    parameters and hooks (FSDP's root hooks go on the view), and the modules themselves shared with `net`."""
    view = copy.copy(net)
    view.__dict__.update({k: copy.copy(v) for k, v in vars(net).items() if isinstance(v, (dict, set))})
    blocks = getattr(net, layers)
    per = len(blocks) // num_stages
    names = list(blocks.keys())[stage * per : (stage + 1) * per]
    setattr(view, layers, nn.ModuleDict({name: blocks[name] for name in names}))
    absent = (*(first if stage > 0 else ()), *(last if stage < num_stages - 1 else ()))
    for name in absent:
        setattr(view, name, None)
    return view


def split(net: nn.Module, rank: int, size: int, schedule: str, layers: str, first=(), last=()) -> dict:
    """This rank's stages as {stage index: view}; `net` keeps only their modules (this rank's parameters)."""
    v = stages_per_rank(schedule)
    views = {s: stage_view(net, s, size * v, layers, first, last) for s in range(rank, size * v, size)}
    setattr(net, layers, nn.ModuleDict({k: b for view in views.values() for k, b in getattr(view, layers).items()}))
    for name in (*first, *last):
        if all(getattr(view, name) is None for view in views.values()):
            setattr(net, name, None)
    return views


class Pipeline:
    """Runs this rank's stages on a schedule: `step` trains (forward and backward of every micro-batch, with the
    gradients of the mean of the micro-batches' mean losses, the single process's for equal micro-batches),
    calling it evaluates. Both take the whole per-rank batch; only the first stage reads the inputs, only the
    last the targets. `order`: the position of each parameter name of the whole LightningModule in the single
    process (checkpoints list the optimizer's parameters in it: ModelParallel.optimizer_state)."""

    def __init__(self, views: dict, mesh, schedule: str, microbatches: int, loss_fn, order: dict):
        self.views, self.mesh, self.loss_fn, self.order = views, mesh, loss_fn, order
        self.schedule_name, self.microbatches = schedule, microbatches
        self.num_stages = mesh.size() * stages_per_rank(schedule)
        self.first, self.last = 0 in views, self.num_stages - 1 in views
        self.bubble = bubble_fraction(schedule, mesh.size(), microbatches)
        # built at first use, on the device of the batch: configure_model splits and shards without one (the
        # dry run of a memory estimate runs it on a fake process group)
        self.train_schedule = self.eval_schedule = None
        self.eval_batch = 0

    def _schedule(self, loss_fn, device):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        group = self.mesh.get_group()
        stages = [PipelineStage(view, s, self.num_stages, device, group=group) for s, view in self.views.items()]
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
        single = stages_per_rank(self.schedule_name) == 1
        # scale_grads: gradients divided by the micro-batches, as the loss is their mean
        return kind[self.schedule_name](stages[0] if single else stages, self.microbatches, loss_fn=loss_fn)

    def _inputs(self, x: torch.Tensor) -> tuple:
        return (x,) if self.first else ()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Train on one batch; returns its loss on every rank of the pipeline (one scalar broadcast from the last
        stage, so that the loss is logged, reduced and monitored as under every other strategy)."""
        if self.train_schedule is None:
            self.train_schedule = self._schedule(self.loss_fn, x.device)
        losses: list[torch.Tensor] = []
        for view in self.views.values():  # the schedule adds every micro-batch's gradients to .grad
            view.zero_grad()
        self.train_schedule.step(*self._inputs(x), target=y, losses=losses, return_outputs=False)
        loss = torch.stack(losses).mean().detach() if self.last else torch.zeros((), device=x.device)
        torch.distributed.broadcast(loss, group=self.mesh.get_group(), group_src=self.mesh.size() - 1)
        return loss

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The logits of a batch on the last stage (None on the others). Evaluation has its own stages, whose
        buffers take the shape of the first evaluation batch rounded up to whole micro-batches; every later
        batch is padded to it (the pad rows' outputs are dropped), so a short last batch runs too."""
        if self.eval_schedule is None:
            self.eval_batch = -(-len(x) // self.microbatches) * self.microbatches
            self.eval_schedule = self._schedule(None, x.device)
        n = len(x)
        padded = F.pad(x, (0, 0, 0, self.eval_batch - n))
        logits = self.eval_schedule.step(*self._inputs(padded))
        return logits[:n] if self.last else None
