"""What the gpt example's tests share (dropped with the example: scripts/rename_project.py)."""

from __future__ import annotations

import pytest
import torch

# The GPT of the strategy proofs: 2 blocks of width 32 on windows of 32 bytes, a small eval split.
TINY_GPT = [
    "model=gpt",
    "data=text",
    "model.net.n_layer=2",
    "model.net.n_head=4",
    "model.net.n_embd=32",
    "data.block_size=32",
    "data.batch_size=8",
    "data.val_fraction=0.005",
    "data.test_fraction=0.005",
]

# The attention key bias cannot change attention (softmax ignores a shift shared by all keys): its gradient is
# zero up to rounding, which Adam scales up to steps of ~1e-5, different on every strategy. It must stay ~0.
ZERO_GRADIENT = "attn.k.bias"

# Adam divides each step by the root of the squared gradient's running mean: an element whose gradient is
# ~0 up to rounding (an expert weight that its few tokens barely touch, the embedding of a rare byte) takes
# steps that differ between runs by more than rounding, as the attention key bias does, and by how much
# depends on the CPU's vector width. Such elements are rare: with `rare=RARE`, at most 1e-3 of a tensor may
# miss the tolerance and none may miss 1e-4 (measured: MoE, at most 5 of 91,904 elements over 5e-6, the
# largest 2.4e-5; pipeline 1F1B, 1 of 4,096 at 7e-6 here and over 1e-5 on another CPU).
RARE = (1e-3, 1e-4)


def assert_trains_like(got: dict, ref: dict, loss_rtol: float, param_atol: float, rare=None) -> None:
    """A run (RecordSteps' losses and state, plus metrics.json) against the single process: each step's loss
    within loss_rtol, every final parameter within param_atol (with `rare=(share, atol)`, a tensor may have at
    most that share of elements beyond param_atol, none beyond atol), and the test metrics."""
    assert len(got["losses"]) == len(ref["losses"]) == 6
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=loss_rtol, atol=0)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # it learns: the comparison is not between constants
    assert got["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        if key.endswith(ZERO_GRADIENT):
            assert got["state"][key].abs().max() < 1e-4 and value.abs().max() < 1e-4, key
        elif rare:
            diff = (got["state"][key] - value).abs()
            assert (diff > param_atol).float().mean() <= rare[0] and diff.max() < rare[1], (key, diff.max())
        else:
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=param_atol, msg=key)
    assert got["metrics"]["test/loss"] == pytest.approx(ref["metrics"]["test/loss"], rel=loss_rtol)
    # near-tied logits may flip the argmax of a token or two among the ~2,300 test tokens
    assert got["metrics"]["test/acc"] == pytest.approx(ref["metrics"]["test/acc"], abs=1e-3)
    assert got["metrics"]["test/samples"] == ref["metrics"]["test/samples"]  # each sequence counted once
