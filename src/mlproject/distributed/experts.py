"""Expert parallelism: each mixture-of-experts layer's experts split over the inner ranks of a shard group.

`strategy.expert_parallel_size` ranks (Topology: `expert_parallel`, inside `shard`) each hold their share of every
expert module the plan names (`model.parallel.experts`), and the module sends each token to its expert's rank
and back by all-to-all itself (`ep_group`: models/components/moe.py). FSDP then shards the experts over the rest of
the shard group (`expert_shard`), the dense parameters over all of it (distributed/parallel.py).
"""

from __future__ import annotations

from torch import nn


def apply_ep(modules: list[nn.Module], mesh) -> None:
    """Split each expert module's parameters (stacked experts first: shape (experts, ...)) over the
    expert-parallel mesh, and give the module its process group for the all-to-all."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for module in modules:
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
        module.ep_group = mesh.get_group()
