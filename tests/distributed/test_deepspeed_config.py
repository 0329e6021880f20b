"""The DeepSpeed config each deepspeed_* strategy hands to deepspeed.initialize, checked without a GPU."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate

pytest.importorskip("deepspeed", reason="DeepSpeed is the optional extra: pip install .[deepspeed]")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_without_offload(compose_cfg, stage):
    config = instantiate(compose_cfg(f"strategy=deepspeed_stage_{stage}").strategy).config
    assert config["zero_optimization"]["stage"] == stage
    assert "offload_optimizer" not in config["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in config


def test_stage_3_offload_keeps_the_models_torch_optimizer(compose_cfg):
    """Optimizer state and parameters in CPU memory, and the model's AdamW allowed there: DeepSpeed
    otherwise stops with 'ZeRO-Offload with a client provided optimizer' on the first GPU run."""
    config = instantiate(compose_cfg("strategy=deepspeed_stage_3_offload").strategy).config
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert config["zero_force_ds_cpu_optimizer"] is False
