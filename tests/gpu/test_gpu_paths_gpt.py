"""The GPU-only proofs of issue 29 (`make test-gpu`; their CPU halves are in tests/distributed/test_gpu_paths.py,
tests/test_moe.py, tests/test_oom.py, tests/test_precision.py). SyncBN under fsdp and bf16 under every strategy
run in tests/gpu/test_gpu.py. Budget: ~2 minutes on one GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from mlproject.core.constants import PROJECT_ROOT
from tests.distributed.test_model_parallel import TINY
from tests.helpers.gpu import requires_gpu
from tests.helpers.processes import clean_env, run

pytestmark = [*requires_gpu, pytest.mark.slow]

GPUS = max(torch.cuda.device_count(), 1)
GPT = [o for o in TINY if not o.startswith("trainer.accelerator")]


@pytest.mark.timeout(600)
def test_fsdp_cpu_offload_trains_like_fsdp(tmp_path):
    """Lightning moves the module to the GPU after configure_model; with cpu_offload the shards must stay in host
    memory (FSDP2 refuses the first forward otherwise), and the run trains as the one without offload."""
    losses = {}
    for offload in (False, True):
        log_dir = tmp_path / str(offload)
        record = log_dir / "record.pt"
        overrides = ["trainer=gpu", f"trainer.devices={GPUS}", "strategy=fsdp", f"strategy.fsdp.cpu_offload={offload}"]
        run("train", *GPT, *overrides, f"+callbacks.recorder.path={record}", log_dir=log_dir, timeout=300)
        losses[offload] = torch.tensor(torch.load(record)["losses"])
    torch.testing.assert_close(losses[True], losses[False], rtol=2**-7, atol=0)


def test_precision_and_memory_read_the_gpu_without_initialising_cuda():
    code = (
        "import json, torch; from mlproject.core.resolvers import default_precision, gpu_capability, gpu_memory\n"
        "p = default_precision('gpu')\n"
        "print(json.dumps([p, gpu_capability(), gpu_memory(), torch.cuda.is_initialized()]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True
    )
    precision, capability, memory, initialised = json.loads(out.stdout.splitlines()[-1])
    assert tuple(capability) == torch.cuda.get_device_capability(0) and not initialised
    # NVML's total includes what the driver reserves, a few hundred MiB that CUDA's does not (plan's headroom)
    cuda = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    assert cuda <= memory <= 1.02 * cuda
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert precision == ("bf16-mixed" if native else "16-mixed")


def test_bf16_experts_run_as_grouped_gemms_on_the_gpu():
    from mlproject.models.components.moe import MoE

    torch.manual_seed(0)
    moe = MoE(n_embd=64, n_expert=4, top_k=2, dropout=0.0).cuda()
    x = torch.randn(4, 32, 64, device="cuda")
    reference = moe(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = torch.compile(moe, fullgraph=True)(x)
    out.float().square().sum().backward()
    assert torch.isfinite(moe.experts.fc_weight.grad).all()
    torch.testing.assert_close(out.float(), reference, rtol=2**-6, atol=2**-6)


class Allocates(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 1:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device=self.device)  # a real CUDA out-of-memory error
        return F.mse_loss(self.layer(batch[0]), torch.zeros(len(batch[0]), 1, device=self.device))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_cuda_oom_ends_in_one_line_and_writes_the_memory_snapshot(tmp_path, capsys):
    from mlproject.callbacks.memory import MemoryHistory
    from mlproject.cluster.requeue import EXIT_OOM, Signals

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, default_root_dir=tmp_path, callbacks=[MemoryHistory(at_step=100), Signals()],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exit:
        trainer.fit(Allocates(), data)
    assert exit.value.code == EXIT_OOM
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "out of memory on rank 0 at step 1" in lines[0] and "GiB reserved" in lines[0]
    assert (tmp_path / "memory_snapshot_rank0.pickle").stat().st_size > 0
