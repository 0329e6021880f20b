"""training/optim.py: AdamW fused on CUDA and foreach on CPU, each equal to the loop; the learning rate follows
the effective batch, and the schedule counts optimizer steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mlproject.core.errors import ConfigError
from mlproject.training.optim import adamw, effective_batch, scaled_lr
from tests.helpers.gpu import requires_gpu


def trainer_of(micro: int, ranks: int, accumulate: int):
    """What effective_batch reads of a Trainer: the micro-batch, the data-parallel ranks, the accumulation."""
    return SimpleNamespace(
        train_dataloader=SimpleNamespace(batch_size=micro),
        distributed_sampler_kwargs={"num_replicas": ranks, "rank": 0} if ranks > 1 else None,
        accumulate_grad_batches=accumulate,
    )


@pytest.mark.parametrize(
    ("micro", "ranks", "accumulate", "rule", "expected"),
    [
        (32, 1, 1, "none", 0.001),
        (32, 1, 1, "linear", 0.001),  # the base batch: the LR as tuned
        (32, 1, 4, "linear", 0.004),  # accumulation multiplies the batch ...
        (32, 8, 1, "linear", 0.008),  # ... and so do ranks
        (32, 8, 4, "linear", 0.032),
        (32, 4, 4, "sqrt", 0.004),  # sqrt(16)
        (8, 4, 1, "sqrt", 0.001),  # 8 per device on 4 ranks is the base batch again
        (32, 64, 1, "none", 0.001),
    ],
)
def test_world_size_and_accumulation_scale_the_lr_as_the_rule_says(micro, ranks, accumulate, rule, expected):
    batch, how = effective_batch(trainer_of(micro, ranks, accumulate))
    assert (
        batch == micro * ranks * accumulate
        and how == f"{micro} per device x {ranks} data-parallel rank(s) x {accumulate}"
    )
    assert scaled_lr(0.001, batch, rule, base_batch_size=32) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("rule", "base"), [("linear", None), ("cubic", 32)])
def test_a_rule_without_its_base_is_refused(rule, base):
    with pytest.raises(ConfigError, match="base_batch_size"):
        scaled_lr(0.001, 64, rule, base)


@pytest.mark.parametrize(
    ("device", "kernel", "rtol", "atol"),
    [
        ("cpu", "foreach", 1e-6, 1e-7),
        # the fused kernel does AdamW's arithmetic in its own order: a few fp32 ulps apart after 5 steps
        pytest.param("cuda", "fused", 1e-5, 1e-6, marks=requires_gpu),
    ],
)
def test_adamw_picks_its_kernel_by_device_and_matches_the_loop(device, kernel, rtol, atol):
    """Fused on CUDA parameters, foreach elsewhere (torch's default is foreach on CUDA, the loop on CPU)."""
    torch.manual_seed(0)
    nets = [
        torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16)).to(device)
        for _ in range(2)
    ]
    nets[1].load_state_dict(nets[0].state_dict())
    ours = adamw(nets[0], lr=0.01, weight_decay=0.1)
    assert (bool(ours.defaults["foreach"]), bool(ours.defaults["fused"])) == (kernel == "foreach", kernel == "fused")
    loop = adamw(nets[1], lr=0.01, weight_decay=0.1)
    for group in loop.param_groups:  # what step() reads: the per-parameter loop
        group.update(foreach=False, fused=False)
    x = torch.randint(0, 16, (4, 8), device=device)
    for _ in range(5):
        for net, opt in zip(nets, (ours, loop), strict=True):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    ("precision", "clip", "refused"), [("bf16-mixed", 1.0, True), ("bf16-mixed", None, False), ("32-true", 1.0, False)]
)
def test_fused_adamw_is_not_given_to_a_trainer_that_would_refuse_to_clip_it(precision, clip, refused):
    """Lightning's mixed-precision plugin raises at the first step for a fused optimizer with gradient clipping
    (seen on an H200 with trainer=gpu): adamw keeps the foreach kernel there."""
    import lightning as L

    from mlproject.training.optim import clips_mixed_precision

    module = L.LightningModule()
    module.trainer = L.Trainer(accelerator="cpu", precision=precision, gradient_clip_val=clip, logger=False)
    assert clips_mixed_precision(module) is refused
