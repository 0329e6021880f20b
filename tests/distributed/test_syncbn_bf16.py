"""CPU SyncBatchNorm on bf16 inputs (trainer.precision=bf16-*): fp32 statistics, output in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mlproject.distributed.syncbn import convert_sync_batchnorm
from tests.helpers.processes import free_port, spawn

# 2 ranks x 7 samples x 11 x 11 = 1694 values per channel: not a bf16 number (it rounds to 1696), so a count
# kept in bf16 would show in the mean.
B, C, HW = 7, 3, 11


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (bf16) and a fixed fp32 weighting of the outputs (the 'loss')."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2 * B, C, HW, HW, generator=g) * 3 + 1).bfloat16(), torch.randn(2 * B, C, HW, HW, generator=g)


def worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    bn, _ = convert_sync_batchnorm(nn.BatchNorm2d(C), cpu=True)  # fp32 parameters, as under bf16-mixed
    x, w = (t.chunk(2)[rank] for t in batch())
    x.requires_grad_()
    y = bn(x)
    (y.float() * w).sum().backward()
    torch.save(
        {"y": y.detach(), "x_grad": x.grad, "mean": bn.running_mean, "var": bn.running_var}, f"{out_dir}/{rank}.pt"
    )
    dist.destroy_process_group()


@pytest.mark.slow
def test_bf16_input_gives_fp32_statistics_and_bf16_output(tmp_path):
    spawn(worker, free_port(), str(tmp_path), nprocs=2)
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    # reference: one process, plain BatchNorm in fp32 on the same (bf16-valued) global batch
    (x, w), ref_bn = batch(), nn.BatchNorm2d(C)
    x = x.float().requires_grad_()
    ref = ref_bn(x)
    (ref * w).sum().backward()
    y = torch.cat([g["y"] for g in got])
    assert y.dtype == torch.bfloat16 and got[0]["mean"].dtype == torch.float32
    # Statistics from the same values in fp32: equal up to fp32 rounding (a bf16 count would be 1.2e-3 off).
    for key, want in (("mean", ref_bn.running_mean), ("var", ref_bn.running_var)):
        for g in got:
            torch.testing.assert_close(g[key], want, rtol=1e-5, atol=1e-6)
    # The output is the fp32 result rounded once to bf16: within half a bf16 step (2**-9 relative).
    torch.testing.assert_close(y.float(), ref.detach(), rtol=2**-8, atol=1e-5)
    x_grad = torch.cat([g["x_grad"] for g in got]).float()
    # Rounded twice: the output gradient arrives in bf16 (y's dtype), the input gradient leaves in bf16.
    # Gradients are ~|w|/std(x) <= ~1.5: two bf16 steps relative, and as much absolute where terms cancel.
    torch.testing.assert_close(x_grad, x.grad, rtol=2**-7, atol=2**-7)
