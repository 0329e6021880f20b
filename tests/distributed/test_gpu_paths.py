"""The GPU paths' order of operations, checked on CPU (tests/gpu runs them on a GPU): FSDP's CPU offload keeps
the shards in host memory after Lightning's move to the device, and bf16-mixed gathers FSDP's parameters in bf16.
SyncBatchNorm's conversion before fully_shard is proved by tests/distributed/test_fsdp_any_model.py (the CPU
conversion builds new modules as torch's does on GPU)."""

from __future__ import annotations

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from mlproject.distributed.parallel import ModelParallel


def strategy(**fsdp) -> ModelParallel:
    s = ModelParallel(fsdp=fsdp)
    s.cluster_environment = LightningEnvironment()  # local rank 0
    return s


def test_cpu_offload_moves_only_buffers_to_the_device():
    """Lightning's ModelParallelStrategy.setup calls model_to_device after configure_model sharded the model; with
    offload the parameters' shards stay in host memory (the meta device stands in for the GPU here)."""
    offloaded, plain = strategy(cpu_offload=True), strategy(cpu_offload=False)
    for s in (offloaded, plain):
        s.parallel_devices = [torch.device("meta")]
        s.model = nn.BatchNorm1d(3)
        s.model_to_device()
    assert offloaded.model.weight.device.type == "cpu" and offloaded.model.running_mean.device.type == "meta"
    assert plain.model.weight.device.type == "meta"


def test_bf16_mixed_gathers_parameters_in_bf16_and_reduces_in_fp32():
    settings = {"param_dtype": None, "reduce_dtype": None, "cpu_offload": False}
    s = strategy(**settings)
    s.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert s.fsdp_settings == {**settings, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
    s = strategy(**{**settings, "param_dtype": "float32"})  # an explicit choice stays
    s.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert s.fsdp_settings["param_dtype"] == "float32" and s.fsdp_settings["reduce_dtype"] == "float32"
    s = strategy(**settings)
    s.precision_plugin = Precision()  # 32-true: as stored
    assert s.fsdp_settings == settings
