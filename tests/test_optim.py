"""AdamW's multi-tensor (CPU) path trains exactly as the per-parameter loop."""

from __future__ import annotations

import torch

from mlproject.models.components.gpt import GPT
from mlproject.models.optim import adamw


def test_adamw_foreach_on_cpu_matches_the_loop():
    torch.manual_seed(0)
    nets = [GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    ours = adamw(nets[0], lr=0.01, weight_decay=0.1)
    assert ours.defaults["foreach"] and not ours.defaults["fused"]
    loop = adamw(nets[1], lr=0.01, weight_decay=0.1)
    loop.defaults["foreach"] = False
    for group in loop.param_groups:
        group["foreach"] = False
    x = torch.randint(0, 16, (4, 8))
    for _ in range(5):
        for net, opt in zip(nets, (ours, loop), strict=True):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
