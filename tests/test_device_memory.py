"""A GPU's memory and compute capability are read through NVML, never through torch.cuda: `make plan` and
preflight ask in the launching process, before Lightning starts the ranks, and CUDA initialised there would break
the ranks it forks and hold a context on the first GPU in every process.

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
from omegaconf import OmegaConf

from mlproject.core.constants import PROJECT_ROOT
from mlproject.plan import GiB, device_memory
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
from omegaconf import OmegaConf
from mlproject.core.resolvers import gpu_capability
from mlproject.plan import device_memory
calls.clear()
local = OmegaConf.create({"cluster": {"gpu_memory_gb": None}})
configured = OmegaConf.create({"cluster": {"gpu_memory_gb": 40}})
print(json.dumps([device_memory(local), gpu_capability(), device_memory(configured), calls]))
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


def test_memory_and_capability_come_from_nvml_with_no_call_into_torch_cuda(tmp_path):
    memory, capability, configured, calls = read_in_child(tmp_path, status=0)
    assert memory == 15 * GiB  # the smallest GPU: a layout must fit on every one
    assert capability == [7, 5]  # the lowest: 16-mixed on a T4 even beside an H100
    assert configured == 40 * GiB  # cluster.gpu_memory_gb wins over the GPUs here
    assert calls == []


def test_nvml_that_does_not_answer_leaves_memory_unknown(tmp_path):
    memory, capability, configured, calls = read_in_child(tmp_path, status=1)
    assert memory is None and capability is None  # `make plan`: "device memory unknown: set cluster.gpu_memory_gb"
    assert configured == 40 * GiB and calls == []


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="NVML is installed on this host")
def test_without_nvml_the_memory_is_unknown_and_torch_cuda_untouched(monkeypatch):
    """The CPU path: no NVML, no GPU. Here in the test process, torch.cuda's real functions wrapped to count."""
    calls = []
    for name, fn in list(vars(torch.cuda).items()):
        if inspect.isfunction(fn):
            monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, _f=fn, **k: calls.append(_n) or _f(*a, **k))
    assert device_memory(OmegaConf.create({"cluster": {"gpu_memory_gb": None}})) is None
    assert device_memory(OmegaConf.create({})) is None
    assert calls == []
