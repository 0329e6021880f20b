"""The mixture-of-experts layer (models/components/moe.py) in one process: dropless top-k routing computes
what a per-token loop over the chosen experts computes, and the router losses have their textbook values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlproject.models.components.moe import MoE


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_dropless_routing_equals_a_loop_over_tokens(top_k):
    torch.manual_seed(0)
    moe = MoE(n_embd=8, n_expert=4, top_k=top_k, dropout=0.0)
    x = torch.randn(3, 5, 8)
    out = moe(x)
    w1, w2 = moe.experts.fc_weight, moe.experts.proj_weight
    expected = []
    for token in x.reshape(-1, 8):
        probs = moe.router(token).softmax(-1)
        weights, chosen = probs.topk(top_k)
        weights = weights / weights.sum()
        expected.append(sum(w * (F.gelu(token @ w1[e]) @ w2[e]) for w, e in zip(weights, chosen, strict=True)))
    torch.testing.assert_close(out, torch.stack(expected).view_as(x), rtol=1e-5, atol=1e-6)
    # every token reached all its k experts, however unbalanced: no capacity, nothing dropped
    assert moe.stats["load"].sum().item() == pytest.approx(1.0)


def test_router_losses():
    moe = MoE(n_embd=4, n_expert=4, top_k=1, dropout=0.0)
    torch.nn.init.zeros_(moe.router.weight)  # uniform probabilities: a tie, which topk breaks the same way
    moe(torch.randn(2, 6, 4))
    # all tokens on one expert whose mean probability is 1/4: n_expert x 1 x 1/4 = 1 (a balanced load too is 1)
    assert moe.stats["balance"].item() == pytest.approx(1.0)
    assert sorted(moe.stats["load"].tolist()) == [0.0, 0.0, 0.0, 1.0]
    assert moe.stats["router_z"].item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)
    moe.eval()
    moe.stats = {}
    moe(torch.randn(1, 2, 4))
    assert moe.stats == {}  # evaluation issues no collective and keeps no statistics


def test_bf16_experts_run_as_grouped_gemms_without_a_graph_break():
    """Under bf16 autocast (bf16-mixed) the experts run as grouped GEMMs delimited on the device: the layer compiles
    as one graph (a `.tolist()` of the counts would sync the host and break it), forward and backward, and computes
    what the fp32 loop over experts computes, within bf16's rounding."""
    torch.manual_seed(0)
    moe = MoE(n_embd=16, n_expert=4, top_k=2, dropout=0.0)
    x = torch.randn(2, 6, 16)
    reference = moe(x)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    out.float().square().sum().backward()
    assert moe.experts.fc_weight.grad is not None and torch.isfinite(moe.experts.fc_weight.grad).all()
    torch.testing.assert_close(out.float(), reference, rtol=2**-6, atol=2**-6)
