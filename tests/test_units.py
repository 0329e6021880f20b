"""Small pieces with exact expected values."""

from __future__ import annotations

import math

import pytest
import torch

from mlproject.core.errors import ConfigError
from mlproject.core.topology import per_device_batch_size
from mlproject.training.loaders import EvalBatches, Seeded
from mlproject.training.optim import warmup_cosine


@pytest.mark.parametrize(("n", "world", "batch"), [(3, 3, 4), (4, 3, 1), (9, 2, 2), (10, 2, 4), (7, 3, 2), (359, 3, 8)])
def test_eval_batches_count_each_sample_once_without_padding(n, world, batch):
    """Every rank runs the same number of batches, none empty and none padded: in rank order they are the split
    in order. Batch sizes stay within the per-device batch, but for a batch of 1 where the world does not
    divide the split (then 2)."""
    ranks = [list(EvalBatches(n, batch, world, r)) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1  # the same number of forward passes on every rank
    assert all(0 < len(b) <= max(batch, 2 if n % world else 1) for r in ranks for b in r)
    assert [i for r in ranks for b in r for i in b] == list(range(n))  # each sample once, in order


def test_an_eval_split_smaller_than_the_world_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="at most 2 processes"):
        EvalBatches(2, 4, 3, 0)


class Noisy(torch.utils.data.Dataset):
    def __getitem__(self, i: int):
        return torch.rand(3), i


def test_augmentation_is_seeded_by_seed_epoch_and_batch_only():
    """The same (seed, epoch, batch) draws the same augmentation in any process, and loading a batch leaves the
    caller's random streams where they were; a batch draws one stream, whatever the dataset."""
    data = Seeded(Noisy(), seed=7)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a = data.__getitems__([(2, 1), (5, 1)])
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(123)  # another process state: same draw
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(data.__getitems__([(2, 1), (5, 1)]), a, strict=True))
    assert not torch.equal(data.__getitems__([(2, 0), (5, 0)])[0][0], a[0][0])
    assert not torch.equal(data.__getitems__([(3, 1)])[0][0], a[0][0])
    assert not torch.equal(a[0][0], a[1][0])  # samples of a batch draw on from one stream


def test_without_seed_batches_augmentation_draws_from_the_callers_streams():
    """seed_batches=false (the default): a batch is read as the dataset reads it, under the process's RNGs."""
    data = Seeded(Noisy(), seed=7, streams=False)
    torch.manual_seed(0)
    got = data.__getitems__([(2, 1), (5, 1)])
    torch.manual_seed(0)
    assert all(torch.equal(x, Noisy()[i][0]) for (x, _), i in zip(got, (2, 5), strict=True))


def test_a_batch_of_tensors_is_read_in_one_gather_as_sample_by_sample():
    """Seeded reads a TensorDataset, or Subsets of one, a batch at a time (__getitems__, which the DataLoader
    calls): the same samples as the dataset's own __getitem__, epoch keys included."""
    from torch.utils.data import DataLoader, Subset, TensorDataset

    tensors = TensorDataset(torch.arange(20.0).view(10, 2), torch.arange(10) * 10)
    subset = Subset(Subset(tensors, [9, 7, 5, 3, 1, 0]), [4, 2, 0, 5])
    data = Seeded(subset)
    got = data.__getitems__([3, (1, 2), 0])
    want = [(subset[i][0].tolist(), subset[i][1].item()) for i in (3, 1, 0)]
    assert [(x.tolist(), y.item()) for x, y in got] == want
    x, y = next(iter(DataLoader(data, batch_size=4)))
    assert y.tolist() == [10, 50, 90, 0] and x.shape == (4, 2)
    assert Seeded(Noisy()).tensors is None


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

    from mlproject.training.loaders import TrainSampler

    def loader():
        sampler = TrainSampler(range(100), 1, 0, shuffle=True, seed=3, drop_last=True)
        return sampler, StatefulDataLoader(Seeded(Noisy()), batch_size=4, sampler=sampler, num_workers=2)

    sampler, straight = loader()
    sampler.set_epoch(1)
    batches = iter(straight)
    for _ in range(8):
        next(batches)
    state = straight.state_dict()
    want = [next(batches)[1].tolist() for _ in range(3)]
    sampler, resumed = loader()
    resumed.load_state_dict(state)
    batches = iter(resumed)
    sampler.set_epoch(1)
    assert [next(batches)[1].tolist() for _ in range(3)] == want
