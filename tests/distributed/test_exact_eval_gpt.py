"""Exact evaluation under FSDP2 on the GPT example: an odd split over 2 processes, no hang, same numbers."""

from __future__ import annotations

import pytest

from mlproject.data.text import TextDataModule
from tests.distributed import sharded_eval_worker

TINY_GPT = [
    "model=gpt",
    "data=text",
    "data.block_size=32",
    "data.batch_size=4",
    "model.net.n_layer=2",
    "model.net.n_head=2",
    "model.net.n_embd=32",
]


@pytest.mark.slow
def test_fsdp_counts_each_sequence_once(tmp_path):
    """FSDP needs every rank in every forward pass (a rank that stops early hangs the others): a
    validation split of 15 sequences over 2 processes finishes and gives the direct single-process
    token-weighted loss, accuracy and sequence count."""
    got, want = sharded_eval_worker.compare(tmp_path, "fsdp", [*TINY_GPT, "data.val_fraction=0.0011"])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    sequences = len(TextDataModule(batch_size=4, block_size=32, val_fraction=0.0011).splits()[1])
    assert sequences % 2 == 1  # odd: one rank pads its last batch, and must still join every forward
    assert got["samples"] == sequences
