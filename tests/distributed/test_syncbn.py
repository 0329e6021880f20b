"""SyncBatchNorm on CPU over gloo: 2 processes x batch B must equal 1 process x batch 2B with plain BatchNorm."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mlproject.distributed.syncbn import CPUSyncBatchNorm, convert_sync_batchnorm
from tests.helpers.processes import free_port, spawn

B, C, STEPS, TOL = 4, 3, 3, 1e-5


def data(world: int):
    """STEPS batches of 2B samples and a fixed weighting of the outputs (the 'loss')."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2 * B, C, 5, 5, generator=g) * 3 + 1 for _ in range(STEPS)]
    return xs, torch.randn(2 * B, C, 5, 5, generator=g)


def run_bn(bn: nn.Module, rank: int, world: int) -> dict[str, torch.Tensor]:
    """STEPS training steps on this rank's slice of each batch; returns what must match one process."""
    xs, w = data(world)
    bn.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    bn.bias.data.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(2))
    out, grads = [], []
    for x in xs:
        x = x.chunk(world)[rank].clone().requires_grad_()
        y = bn(x)
        (y * w.chunk(world)[rank]).sum().backward()
        out.append(y.detach())
        grads.append(x.grad)
    param_grads = torch.cat([bn.weight.grad, bn.bias.grad])
    if world > 1:
        dist.all_reduce(param_grads)  # what DDP does with the parameter gradients (sum of the ranks' losses)
    return {
        "out": torch.stack(out),
        "input_grad": torch.stack(grads),
        "param_grad": param_grads,
        "running_mean": bn.running_mean.clone(),
        "running_var": bn.running_var.clone(),
        "eval_out": bn.eval()(xs[0].chunk(world)[rank]).detach(),
    }


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    synced, converted = convert_sync_batchnorm(nn.BatchNorm2d(C), cpu=True)
    assert converted == 1 and isinstance(synced, CPUSyncBatchNorm)
    torch.save((run_bn(synced, rank, world), run_bn(nn.BatchNorm2d(C), rank, world)), f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_syncbn_two_processes_equal_one_process_with_twice_the_batch(tmp_path):
    reference = run_bn(nn.BatchNorm2d(C), 0, 1)
    spawn(worker, 2, free_port(), str(tmp_path), nprocs=2)
    results = {r: torch.load(tmp_path / f"{r}.pt") for r in range(2)}

    def gathered(which: int, key: str) -> torch.Tensor:
        parts = [results[r][which][key] for r in range(2)]
        if key in ("out", "input_grad"):
            return torch.cat(parts, dim=1)  # steps x (rank 0's B, rank 1's B)
        if key == "eval_out":
            return torch.cat(parts)
        assert torch.equal(parts[0], parts[1])  # every rank holds the same statistics and gradients
        return parts[0]

    for key, ref in reference.items():
        torch.testing.assert_close(gathered(0, key), ref, rtol=TOL, atol=TOL, msg=lambda m, k=key: f"{k}: {m}")
    # Without synchronisation each rank normalises with its own half-batch statistics: visibly different.
    assert (gathered(1, "out") - reference["out"]).abs().max() > 1e-2


def small_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 8), nn.BatchNorm1d(8))


def test_convert_counts_batchnorm_layers_and_is_plain_batchnorm_without_a_process_group():
    model, converted = convert_sync_batchnorm(small_net(), cpu=True)
    assert converted == 2
    x = torch.randn(6, 1, 8, 8)
    plain = small_net()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), plain(x))
