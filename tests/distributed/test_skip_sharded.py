"""divergence.skip under sharded gradients: a NaN in one rank's shard only must make every rank skip the step."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from mlproject.cluster.requeue import Signals
from tests.helpers.processes import free_port, spawn


def worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    module = nn.Linear(4, 4, bias=False)
    fully_shard(module, mesh=init_device_mesh("cpu", (2,)))
    module(torch.ones(2, 4)).sum().backward()  # each rank's gradient is its half of the weight's rows
    if rank == 1:
        module.weight.grad.to_local().fill_(float("nan"))  # the NaN is in rank 1's shard only
    signals = Signals(every_n_steps=2, skip_nonfinite=True)
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    signals.on_train_start(trainer, module)
    signals.on_before_optimizer_step(trainer, module, None)
    torch.save((int(signals._skipped), module.weight.grad.to_local().abs().sum().item()), f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_a_nan_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    spawn(worker, free_port(), str(tmp_path), nprocs=2)
    assert [torch.load(tmp_path / f"{r}.pt") for r in range(2)] == [(1, 0.0), (1, 0.0)]
