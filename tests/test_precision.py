"""Precision and the distributed debug level follow the trainer's accelerator as composed, not the host.

The host here has no GPU, so a child process makes CUDA look available (a bf16 GPU: NVML says compute capability
9.0) before composing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from mlproject.core import resolvers
from mlproject.core.constants import CONFIG_DIR, PROJECT_ROOT
from tests.helpers.processes import clean_env

FAKE_BF16_GPU = (
    "import torch; torch.cuda.is_available = lambda: True\n"
    "import mlproject.core.resolvers as r; r.gpu_capability = lambda: (9, 0)\n"
)
COMPOSE = f"""
import json
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from mlproject.core.resolvers import register_resolvers
register_resolvers()
out = {{}}
with initialize_config_dir(config_dir={str(CONFIG_DIR)!r}, version_base="1.3"):
    for trainer in ("cpu", "gpu", "default"):
        cfg = compose("train", [f"trainer={{trainer}}", "debug=distributed"], return_hydra_config=True)
        # (not the whole env_set: compose leaves hydra.runtime.output_dir unset, which a run sets)
        out[trainer] = [cfg.trainer.precision, cfg.hydra.job.env_set.TORCH_DISTRIBUTED_DEBUG]
print(json.dumps(out))
"""


def child(code: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", FAKE_BF16_GPU + code, *args],
        cwd=PROJECT_ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_precision_and_debug_level_follow_the_accelerator_on_a_bf16_gpu_host():
    got = json.loads(child(COMPOSE).splitlines()[-1])
    assert got == {
        "cpu": ["32-true", "INFO"],  # the CPU, even though a GPU is visible: no DETAIL (segfaults over gloo)
        "gpu": ["bf16-mixed", "DETAIL"],
        "default": ["bf16-mixed", "DETAIL"],  # accelerator=auto picks the visible GPU
    }


def test_train_cfg_job_on_a_bf16_gpu_host_prints_fp32_for_trainer_cpu():
    code = "import runpy, sys; sys.argv[0] = 'train'; runpy.run_module('mlproject.train', run_name='__main__')"
    out = child(code, "trainer=cpu", "--cfg", "job", "--resolve")
    assert "  precision: 32-true" in out.splitlines()  # under trainer:


def test_precision_is_not_cached_across_accelerators(compose_cfg, monkeypatch):
    """A resolver's cache key is its argument's text (`${trainer.accelerator}`), the same for every value."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(resolvers, "gpu_capability", lambda: (8, 0))
    cfg = compose_cfg("trainer=cpu")
    assert cfg.trainer.precision == "32-true"
    cfg.trainer.accelerator = "gpu"
    assert cfg.trainer.precision == "bf16-mixed"


def test_a_gpu_that_only_emulates_bf16_defaults_to_fp16_mixed(monkeypatch):
    """A V100 (compute capability 7.0): torch.cuda.is_bf16_supported() says yes by default (emulation), but
    emulated bf16 is slow; 16-mixed with Lightning's loss scaling instead. Decided from NVML, with CUDA left
    uninitialised (each rank's process picks its own device later)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(resolvers, "gpu_capability", lambda: (7, 0))
    assert resolvers.default_precision("gpu") == "16-mixed"
    assert resolvers.default_precision("cpu") == "32-true"
    assert not torch.cuda.is_initialized()
    assert resolvers.precision_for((8, 0)) == resolvers.precision_for((9, 0)) == "bf16-mixed"
    assert resolvers.precision_for((7, 5)) == "16-mixed"


def test_gpu_capability_is_none_without_nvml():
    assert resolvers.gpu_capability() is None or torch.cuda.is_available()  # this host: no NVML, no GPU
