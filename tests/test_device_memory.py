"""A GPU's compute capability (the default precision) and memory (the planner's) are read through NVML, never
through torch.cuda: they are asked in the launching process, before Lightning starts the ranks, and CUDA initialised
there would break the ranks it forks and hold a context on the first GPU in every process.

This host has no GPU: a child process loads a stand-in libnvidia-ml.so.1 (compiled here from the few NVML calls
the reader makes) and counts every call into torch.cuda's functions, wrapped around the real ones.
"""

from __future__ import annotations

import ctypes.util
import inspect
import json
import shutil
import subprocess
import sys

import pytest
import torch

from mlproject.core.constants import PROJECT_ROOT
from mlproject.core.resolvers import gpu_capability
from tests.helpers.processes import clean_env

# Two GPUs: an H100 of 80 GiB and a T4 of 15 GiB. `status` is what every call returns (nonzero: an NVML error).
FAKE_NVML = r"""
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
static const int major[] = {9, 7}, minor[] = {0, 5};
static const unsigned long long total[] = {80ULL << 30, 15ULL << 30};
int nvmlInit_v2(void) { return STATUS; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *count) { *count = 2; return STATUS; }
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **handle) { *handle = (void *)(index + 1UL); return STATUS; }
int nvmlDeviceGetCudaComputeCapability(void *handle, int *ma, int *mi) {
    *ma = major[(unsigned long)handle - 1]; *mi = minor[(unsigned long)handle - 1]; return STATUS;
}
int nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *memory) {
    memory->total = total[(unsigned long)handle - 1]; memory->free = memory->total; memory->used = 0; return STATUS;
}
"""

COUNT_CUDA_CALLS = """
import functools, inspect, torch
calls = []

def counted(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapper

# every function of torch.cuda's namespace, private ones too (_lazy_init: what get_device_properties calls)
for name, fn in list(vars(torch.cuda).items()):
    if inspect.isfunction(fn):
        setattr(torch.cuda, name, counted(name, fn))
"""

READ = """
import json
from mlproject.core.resolvers import gpu_capability
# feature: planner
from omegaconf import OmegaConf
from mlproject.plan import device_memory
# /feature: planner
calls.clear()
read = {"capability": gpu_capability()}
# feature: planner
read["memory"] = device_memory(OmegaConf.create({"cluster": {"gpu_memory_gb": None}}))
read["configured"] = device_memory(OmegaConf.create({"cluster": {"gpu_memory_gb": 40}}))
# /feature: planner
print(json.dumps({**read, "calls": calls}))
"""


def read_in_child(tmp_path, status: int):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the stand-in NVML library")
    lib = tmp_path / str(status)
    lib.mkdir()
    (lib / "nvml.c").write_text(FAKE_NVML)
    cc = ["cc", "-shared", "-fPIC", f"-DSTATUS={status}", "-o", lib / "libnvidia-ml.so.1", lib / "nvml.c"]
    subprocess.run(cc, check=True)
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_CUDA_CALLS + READ],
        cwd=PROJECT_ROOT,
        env=clean_env(LD_LIBRARY_PATH=str(lib)),  # found before the system's (a GPU host has the real one)
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_gpus_are_read_through_nvml_with_no_call_into_torch_cuda(tmp_path):
    read = read_in_child(tmp_path, status=0)
    assert read["capability"] == [7, 5]  # the lowest: 16-mixed on a T4 even beside an H100
    # feature: planner
    from mlproject.plan import GiB

    assert read["memory"] == 15 * GiB  # the smallest GPU: a layout must fit on every one
    assert read["configured"] == 40 * GiB  # cluster.gpu_memory_gb wins over the GPUs here
    # /feature: planner
    assert read["calls"] == []


def test_nvml_that_does_not_answer_leaves_the_gpus_unknown(tmp_path):
    read = read_in_child(tmp_path, status=1)
    assert read["capability"] is None and read["calls"] == []
    # feature: planner
    from mlproject.plan import GiB

    assert read["memory"] is None  # `make plan`: "device memory unknown: set cluster.gpu_memory_gb"
    assert read["configured"] == 40 * GiB
    # /feature: planner


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="NVML is installed on this host")
def test_without_nvml_the_memory_is_unknown_and_torch_cuda_untouched(monkeypatch):
    """The CPU path: no NVML, no GPU. Here in the test process, torch.cuda's real functions wrapped to count."""
    calls = []
    for name, fn in list(vars(torch.cuda).items()):
        if inspect.isfunction(fn):
            monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, _f=fn, **k: calls.append(_n) or _f(*a, **k))
    assert gpu_capability() is None
    # feature: planner
    from omegaconf import OmegaConf

    from mlproject.plan import device_memory

    assert device_memory(OmegaConf.create({"cluster": {"gpu_memory_gb": None}})) is None
    assert device_memory(OmegaConf.create({})) is None
    # /feature: planner
    assert calls == []
