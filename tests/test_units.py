"""Small pieces with exact expected values."""

from __future__ import annotations

import math

import pytest
import torch

from mlproject.core.errors import ConfigError
from mlproject.core.topology import per_device_batch_size
from mlproject.data.base import PAD, EvalSampler, Indexed
from mlproject.models.optim import warmup_cosine


@pytest.mark.parametrize(("n", "world"), [(1, 3), (2, 3), (9, 2), (10, 2), (7, 3), (200, 3)])
def test_eval_sampler_counts_each_sample_once(n, world):
    data = list(range(n))
    shards = [list(EvalSampler(data, world, r)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of forward passes
    real = sorted(i for s in shards for i in s if i != PAD)
    assert real == data  # each sample exactly once, none repeated


def test_padding_is_masked_by_its_index_not_its_target():
    """A padded slot repeats sample 0, target included (a regression target has no value to spare for
    "ignore"): the metrics skip it because its index is PAD."""
    from mlproject.models.metrics import ClassificationMetrics, LanguageModelMetrics

    x, y, idx = Indexed([(torch.ones(2), torch.tensor(3))])[PAD]
    assert idx == PAD and y.item() == 3
    logits, target, idx = torch.randn(3, 4), torch.tensor([1, 2, 1]), torch.tensor([5, 6, PAD])
    metrics = ClassificationMetrics(num_classes=4)
    metrics.update(logits, target, idx != PAD)
    alone = ClassificationMetrics(num_classes=4)
    alone.update(logits[:2], target[:2], torch.ones(2, dtype=torch.bool))
    assert {k: m.compute() for k, m in metrics.items().items()} == {k: m.compute() for k, m in alone.items().items()}
    lm = LanguageModelMetrics(vocab_size=4)
    lm.update(torch.randn(3, 5, 4), torch.ones(3, 5, dtype=torch.long), idx != PAD)
    assert lm.samples.compute() == 2


class Noisy(torch.utils.data.Dataset):
    def __getitem__(self, i: int):
        return torch.rand(3), i


def test_augmentation_is_seeded_by_seed_epoch_and_index_only():
    """The same (seed, epoch, index) draws the same augmentation in any process, and loading a sample leaves
    the caller's random streams where they were."""
    data = Indexed(Noisy(), seed=7)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a = data[(2, 1)][0]
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(123)  # another process state: same draw
    assert torch.equal(data[(2, 1)][0], a)
    assert not torch.equal(data[(2, 0)][0], a) and not torch.equal(data[(3, 1)][0], a)


def test_datasets_that_draw_nothing_are_read_without_seeding():
    """The seeding costs ~100 us a sample: tensors and datasets that say so (data/text.py's Chunks, tokens.py's
    Windows) skip it; any other dataset is seeded."""

    class Slices(Noisy):
        draws_random = False

    tensors = torch.utils.data.TensorDataset(torch.arange(4.0), torch.arange(4))
    assert not Indexed(torch.utils.data.Subset(tensors, [1, 2])).seeded
    assert not Indexed(Slices()).seeded
    assert Indexed(Noisy()).seeded and Indexed(torch.utils.data.Subset(Noisy(), [1])).seeded


def test_a_batch_of_tensors_is_read_in_one_gather_as_sample_by_sample():
    """Indexed reads a TensorDataset, or Subsets of one, a batch at a time (__getitems__, which the DataLoader
    calls): the same samples as __getitem__, padding slots and epoch keys included; other datasets go on
    sample by sample."""
    from torch.utils.data import DataLoader, Subset, TensorDataset

    tensors = TensorDataset(torch.arange(20.0).view(10, 2), torch.arange(10) * 10)
    data = Indexed(Subset(Subset(tensors, [9, 7, 5, 3, 1, 0]), [4, 2, 0, 5]))
    keys = [3, (1, 2), PAD, 0]
    got = data.__getitems__(keys)
    want = [data[k] for k in keys]
    assert [(x.tolist(), y.item(), i) for x, y, i in got] == [(x.tolist(), y.item(), i) for x, y, i in want]
    assert [y.item() for _, y, _ in got] == [0, 50, 10, 10]  # PAD repeats the first sample
    x, y, idx = next(iter(DataLoader(data, batch_size=4)))
    assert y.tolist() == [10, 50, 90, 0] and idx.tolist() == [0, 1, 2, 3] and x.shape == (4, 2)
    assert Indexed(Noisy()).tensors is None and len(Indexed(Noisy(), seed=1).__getitems__([0, (1, 1)])) == 2


def test_per_device_batch_size():
    assert per_device_batch_size(64, 2, 2) == 16
    with pytest.raises(ConfigError, match="multiple of 6"):
        per_device_batch_size(64, 3, 2)


def test_warmup_cosine_schedule():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = warmup_cosine(opt, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(110):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[-1] > 0.1 and opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_rich_bar_reads_the_loss_when_it_draws_only(tmp_path):
    """The loss is not a prog_bar metric (Lightning would call .item() on it every step, a GPU sync); the rich
    bar reads it from callback_metrics every refresh_rate batches and shows it."""
    import io

    import lightning as L

    from mlproject.callbacks.progress import RichBar

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Counting(RichBar):
        def get_metrics(self, trainer, pl_module):
            self.drawn.append(super().get_metrics(trainer, pl_module))
            return self.drawn[-1]

    out = io.StringIO()
    bar = Counting(5, console_kwargs={"file": out, "force_terminal": True, "width": 200})
    bar.drawn = []
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(20, 2)), batch_size=1)
    trainer = L.Trainer(
        max_epochs=1,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), data)
    train_draws = [m for m in bar.drawn if "train/loss" in m]
    assert len(train_draws) == 20 // 5 + 1  # every 5th batch, and once more at the epoch end
    assert all(isinstance(m["train/loss"], float) for m in train_draws)
    assert "train/loss" not in trainer.progress_bar_metrics
    assert "train/loss" in out.getvalue()


def test_a_resumed_loader_with_workers_reads_the_right_epoch_ahead():
    """With workers, a StatefulDataLoader reads ahead as soon as its iterator is made, which Lightning does
    before it sets the epoch of a resumed run: the sampler's state carries the epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from mlproject.data.base import TrainSampler

    def loader():
        sampler = TrainSampler(range(100), 1, 0, shuffle=True, seed=3, drop_last=True)
        return sampler, StatefulDataLoader(Indexed(Noisy()), batch_size=4, sampler=sampler, num_workers=2)

    sampler, straight = loader()
    sampler.set_epoch(1)
    batches = iter(straight)
    for _ in range(8):
        next(batches)
    state = straight.state_dict()
    want = [next(batches)[2].tolist() for _ in range(3)]
    sampler, resumed = loader()
    resumed.load_state_dict(state)
    batches = iter(resumed)
    sampler.set_epoch(1)
    assert [next(batches)[2].tolist() for _ in range(3)] == want
