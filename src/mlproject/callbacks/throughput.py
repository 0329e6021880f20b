"""Training throughput in the loggers and the progress output: perf/samples_per_sec (perf/steps_per_sec where
the global batch is unknown), perf/tokens_per_sec (models of token sequences), perf/mfu (model FLOPs
utilisation, where the GPU's peak is known).

Measured over each interval of `trainer.log_every_n_steps` optimizer steps, at the steps Lightning logs at.
Lightning's ThroughputMonitor synchronizes the GPU at every step for its clock (and its peak table lists
H200's sparse bf16 figure, twice the dense one); here the only sync is at those logging steps, where
Lightning already reads the logged values to the host.
"""

from __future__ import annotations

import inspect
import time

import torch
from lightning.pytorch import Callback

# Dense bf16 tensor-core peaks per GPU (no sparsity), FLOP/s. Longest name first wins (GH200 before H200).
# H100's PCIe and NVL boards clock lower than its SXM one (the plain "H100" name of e.g. "H100 80GB HBM3").
PEAK_BF16_FLOPS = {
    "A100": 312e12,
    "H100": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
}


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])) if k in device_name), None)


class Throughput(Callback):
    """`samples_per_step`: the global batch (all data-parallel ranks and accumulation steps), or null where the
    datamodule's config has none (a plain LightningDataModule keeps its batch size to itself): steps/s only;
    `tokens_per_sample`: the sequence length, or null for data that are not token sequences. MFU needs
    the module's `flops_per_token` (training FLOPs, forward and backward; a method or a value) and a bf16 run on a
    GPU listed in PEAK_BF16_FLOPS."""

    def __init__(self, samples_per_step: int | None, tokens_per_sample: int | None = None):
        self.samples_per_step, self.tokens_per_sample = samples_per_step, tokens_per_sample
        self.peak: float | None = None
        self.flops_per_token: int | None = None
        # feature: pipeline
        self.pipeline = None  # the module's Pipeline under pipeline parallelism
        # /feature: pipeline
        self._start: tuple[int, float] | None = None  # (global step, time) where the interval began

    def setup(self, trainer, pl_module, stage: str) -> None:
        # feature: pipeline
        # read before configure_model: a pipeline stage holds only its own layers then (a later one has no embedding)
        # /feature: pipeline
        # getattr_static: a plain getattr with a default would also hide an AttributeError raised inside it
        if stage == "fit" and inspect.getattr_static(pl_module, "flops_per_token", None) is not None:
            value = pl_module.flops_per_token
            self.flops_per_token = value() if callable(value) else value

    def on_train_start(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda" and "bf16" in str(trainer.precision):
            self.peak = peak_flops(torch.cuda.get_device_name(device))
        # feature: pipeline
        self.pipeline = getattr(pl_module, "pipeline", None)
        # /feature: pipeline
        self._start = None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        step, every = trainer.global_step, trainer.log_every_n_steps
        if step % every or (self._start and self._start[0] == step):  # between logging steps: nothing at all
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # the clock must see the queued steps end
        now = time.perf_counter()
        if self._start is not None:  # the first interval starts here: it would include the start-up
            steps = (step - self._start[0]) / (now - self._start[1])
            if self.samples_per_step is None:
                metrics = {"perf/steps_per_sec": steps}
            else:
                samples = self.samples_per_step * steps
                metrics = {"perf/samples_per_sec": samples}
            if self.tokens_per_sample and self.samples_per_step is not None:
                tokens = metrics["perf/tokens_per_sec"] = samples * self.tokens_per_sample
                if self.flops_per_token and self.peak:
                    metrics["perf/mfu"] = self.flops_per_token * tokens / (self.peak * trainer.world_size)
            # feature: pipeline
            if self.pipeline is not None:  # the share of a step this rank idles in its schedule's ideal timing
                metrics["perf/pipeline_bubble"] = self.pipeline.bubble
            # /feature: pipeline
            pl_module.log_dict(metrics)  # this rank's clock: no collective
        self._start = (step, now)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._start = None  # validation time is no training time: restart the interval at the next log step
