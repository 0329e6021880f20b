"""A mixture-of-experts MLP for the GPT (models/components/gpt.py): a top-k router and stacked experts.

Dropless: every token goes to its k experts however many tokens choose the same one (no capacity factor, no
token dropped), so a token's output never depends on the rest of the batch or on how it is split over ranks.
The router's auxiliary losses are returned with the output's statistics (`stats`): the Switch
Transformer's load-balancing loss, n_expert x sum_e f_e x P_e (f_e: the share of routed token slots that
expert e got, P_e: its mean router probability; 1 when balanced), and ST-MoE's router z-loss,
mean(logsumexp(logits)^2), which keeps the router's logits small.

f_e is counted over the GLOBAL batch: the counts are summed over the data-parallel ranks (`batch_group`, set
by distributed.parallel.parallelize). The loss is then linear in P_e, a mean over tokens, so the mean over
ranks of each rank's loss is the loss of the whole batch, as on one process (every rank holds as many tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: expert parallelism makes the experts' weights DTensors split by expert."""
    return t.to_local() if hasattr(t, "to_local") else t


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _tokens_per_expert(chosen: torch.Tensor, n_expert: int) -> torch.Tensor:
    if chosen.is_meta:  # a memory estimate runs without data: it assumes an even load
        base, extra = divmod(chosen.numel(), n_expert)
        return torch.tensor([base + (e < extra) for e in range(n_expert)])
    return torch.bincount(chosen.flatten(), minlength=n_expert)


class Experts(nn.Module):
    """n_expert two-layer GELU MLPs, each weight stacked over experts (dim 0)."""

    # feature: expert
    # Stacked so that expert parallelism splits them by expert (distributed/experts.py). With `ep_group`
    # set, each expert lives on one rank of the group: tokens travel to their expert's rank and back with
    # all-to-all.
    # /feature: expert
    def __init__(self, n_expert: int, n_embd: int, hidden: int):
        super().__init__()
        self.fc_weight = nn.Parameter(torch.randn(n_expert, n_embd, hidden) * 0.02)
        self.proj_weight = nn.Parameter(torch.randn(n_expert, hidden, n_embd) * 0.02)  # GPT rescales it by depth
        # feature: expert
        self.ep_group = None
        # /feature: expert

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: token rows sorted by expert; counts: rows per expert (all n_expert of them)."""
        # feature: expert
        if self.ep_group is not None:
            return self._expert_parallel(x, counts)
        # /feature: expert
        return self._run(x, counts)

    # feature: expert
    def _expert_parallel(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group = self.ep_group
        ep, local = dist.get_world_size(group), _local(self.fc_weight).shape[0]
        # received[r, e]: rows rank r sends to this rank's expert e (rank r holds experts r*local ... r*local+local-1)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send, received = counts.view(ep, local), received.view(ep, local)
        send_splits, recv_splits = send.sum(1).tolist(), received.sum(1).tolist()
        x = exchange(x, recv_splits, send_splits, group)
        # arrived grouped by source rank, then expert: regroup by expert to run each expert once
        by_rank = x.split(received.flatten().tolist())
        by_expert = torch.cat([by_rank[r * local + e] for e in range(local) for r in range(ep)])
        # An expert's gradient sums the tokens of the ep ranks; FSDP then averages over the ranks that hold the
        # same expert (data-parallel size / ep), so 1/ep here makes it the data-parallel mean a dense one is.
        # (FSDP's own set_gradient_divide_factor needs PREMUL_SUM, which gloo lacks.)
        y = self._run(by_expert, received.sum(0), 1 / ep).split(received.t().flatten().tolist())
        y = torch.cat([y[e * ep + r] for r in range(ep) for e in range(local)])  # back to (source rank, expert)
        return exchange(y, send_splits, recv_splits, group)

    # /feature: expert
    def _run(self, x: torch.Tensor, counts: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
        # every expert's weights take part, with no rows too, so every rank's gradients have the same structure
        fc, proj = (_ScaleGrad.apply(_local(w), grad_scale) for w in (self.fc_weight, self.proj_weight))
        autocast = not x.is_meta and torch.is_autocast_enabled(x.device.type)  # meta tensors: no autocast
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        if dtype == torch.bfloat16 and x.size(-1) % 8 == 0:  # grouped GEMMs take bf16 rows of 16-byte multiples
            # One grouped GEMM per layer over the experts' row blocks, delimited on the device: no host sync for
            # the counts, no loop over experts, no graph break under compile.
            offs = counts.to(x.device).cumsum(0).to(torch.int32)
            hidden = F.gelu(F.grouped_mm(x.to(dtype), fc.to(dtype), offs=offs))
            return F.grouped_mm(hidden, proj.to(dtype), offs=offs)
        rows = x.split(counts.tolist())  # fp32 (grouped_mm has no fp32 kernel on GPU): a loop over experts
        return torch.cat([F.gelu(r @ fc[e]) @ proj[e] for e, r in enumerate(rows)])


class MoE(nn.Module):
    """Routes each token to its top_k experts and sums their outputs weighted by the renormalised router
    probabilities of the chosen experts."""

    def __init__(self, n_embd: int, n_expert: int, top_k: int, dropout: float):
        super().__init__()
        if not 1 <= top_k <= n_expert:
            raise ValueError(f"top_k={top_k} must be between 1 and n_expert={n_expert}")
        self.top_k = top_k
        self.router = nn.Linear(n_embd, n_expert, bias=False)
        self.experts = Experts(n_expert, n_embd, 4 * n_embd)
        self.dropout = nn.Dropout(dropout)
        self.batch_group = None  # the data-parallel group (parallelize): expert loads count the global batch
        self.stats: dict[str, torch.Tensor] = {}  # of the last forward: balance, router_z (losses), load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.top_k
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()  # routing decisions in fp32 even under bf16
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # (token, slot) pairs sorted by expert: each expert runs once on a contiguous block of rows
        order = chosen.flatten().argsort(stable=True)
        counts = _tokens_per_expert(chosen, probs.size(-1))
        y = self.experts(x[order // k], counts)
        y = torch.empty_like(y).index_copy_(0, order, y).view(-1, k, shape[-1])  # back to (token, slot) order
        out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)
        if self.training:  # a collective: evaluation and generation (maybe on one rank only) skip it
            self.stats = self._router_stats(logits, probs, counts)
        return self.dropout(out.view(shape))

    def _router_stats(self, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor) -> dict:
        load = counts.to(probs.device, torch.float32)
        if self.batch_group is not None:
            dist.all_reduce(load, group=self.batch_group)  # counts only: no gradient flows through f_e
        load = load / load.sum()
        return {
            "balance": probs.size(-1) * (load * probs.mean(0)).sum(),
            "router_z": logits.logsumexp(-1).square().mean(),
            "load": load,
        }


# feature: expert
def exchange(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """All-to-all of `x`'s rows (send_splits[r] of them to rank r), differentiable: backward sends back."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    return all_to_all_single(out, x, recv_splits, send_splits, group=group)


# /feature: expert
