"""The throughput callback: GPT FLOPs per token, and perf/* metrics in the logs of a tiny GPT run."""

from __future__ import annotations

import csv

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.throughput import measure_flops

from mlproject.callbacks.throughput import Throughput, peak_flops
from mlproject.models.components.gpt import GPT
from tests.helpers.processes import FAST, run, run_dirs


def test_gpt_flops_per_token():
    net = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    weights = 2 * (4 * 32 * 32 + 2 * 32 * 128) + 64 * 32  # per block: q k v proj, fc and proj; the head
    biases_and_norms = 2 * (4 * 32 + 128 + 32 + 2 * 2 * 32) + 2 * 32
    assert net.flops_per_token() == 6 * (weights + biases_and_norms) + 12 * 2 * 32 * 16
    # torch's FLOP counter on one batch forward and backward counts the weights' matmuls: 6 per weight and token
    # (it skips biases and norms, and CPU's fused attention kernel, which the formula's 12 x L x d x T is)
    x = torch.randint(0, 64, (3, 16))
    counted = measure_flops(net, lambda: net(x), lambda logits: F.cross_entropy(logits.flatten(0, 1), x.flatten()))
    assert counted == 6 * weights * x.numel()


def test_peak_flops():
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H100 NVL") == 835e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("cpu") is None


class SplitLater(L.LightningModule):
    """Like a later pipeline stage: configure_model drops the embedding its FLOP count reads."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 1)

    @property
    def flops_per_token(self) -> int:
        return 6 * self.head.weight.numel() + self.emb.embedding_dim

    def configure_model(self):
        self.emb = None

    def training_step(self, batch, batch_idx):
        return self.head(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def test_flops_per_token_is_read_before_configure_model(tmp_path):
    callback = Throughput(samples_per_step=2, tokens_per_sample=1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(SplitLater(), data)
    assert callback.flops_per_token == 6 * 4 + 4


@pytest.mark.slow
def test_perf_metrics_are_logged(tmp_path):
    gpt = ["experiment=gpt", "model.net.n_layer=1", "model.net.n_embd=32", "data.block_size=32", "data.batch_size=8"]
    limits = [
        "trainer.limit_train_batches=8",
        "trainer.limit_val_batches=1",
        "test=false",
        "trainer.log_every_n_steps=2",
    ]
    run("train", *FAST, *gpt, *limits, log_dir=tmp_path)
    (run_dir,) = run_dirs(tmp_path)
    (logged,) = run_dir.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(logged.open()) if r.get("perf/samples_per_sec")]
    assert {int(r["step"]) for r in rows} == {3, 5, 7, 11, 13, 15}  # every 2nd step, not the first of an epoch
    for r in rows:
        samples, tokens = float(r["perf/samples_per_sec"]), float(r["perf/tokens_per_sec"])
        assert samples > 0 and tokens == pytest.approx(samples * 32)
        assert not r.get("perf/mfu")  # CPU: no known peak
