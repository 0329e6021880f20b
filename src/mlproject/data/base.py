"""The base every datamodule uses: a global batch size, and evaluation where each sample counts once.

Subclasses only return their train, val and test datasets (of `(x, y)` pairs) from `splits()`, and
may make data on disk first in `prepare_data()` (once per node, see data/preparation.py). This class
builds the splits once and turns them into dataloaders that are correct under any world size and
with any number of workers.
"""

from __future__ import annotations

import contextlib
import math
import os
import random

import lightning as L
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler, Subset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from mlproject.core.constants import PAD
from mlproject.core.errors import ConfigError
from mlproject.core.topology import per_device_batch_size


@contextlib.contextmanager
def sample_rng(*key: int):
    """Inside: python's, numpy's and torch's CPU random streams seeded by `key` alone; outside: untouched."""
    seed = int(np.random.SeedSequence([k % 2**32 for k in key]).generate_state(1)[0])
    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.random.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed would reseed CUDA too
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.random.set_rng_state(saved[2])


class Indexed(Dataset):
    """Yields `(x, y, idx)`; the sampler gives `i` or `(i, epoch)`.

    Index PAD is a padding slot: it repeats sample 0, and losses and metrics mask it by its index (never by
    its target, which may be any value) while every rank still runs the same number of forward passes.
    Each sample is made with random streams seeded by (seed, epoch, index): random augmentation is then the
    same whichever worker, or the main process, loads the sample, so a run resumed mid-epoch with workers
    draws what the straight run drew, and loading never moves the training RNG. A dataset whose samples draw
    no random numbers (`draws_random = False`, or a TensorDataset) is read without the seeding, which costs
    ~100 us a sample (numpy's and python's states saved and restored): more than a step of a small model.
    A TensorDataset (or a Subset of one) is read a batch at a time, one gather per tensor, where reading it a
    sample at a time costs ~3 us a sample.
    """

    def __init__(self, dataset: Dataset, seed: int = 0):
        self.dataset, self.seed = dataset, seed
        self.seeded = draws_random(dataset)
        self.tensors, self.rows = tensor_rows(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | tuple[int, int]):
        i, epoch = key if isinstance(key, tuple) else (key, 0)
        with sample_rng(self.seed, epoch, i) if self.seeded else contextlib.nullcontext():
            x, y = self.dataset[0 if i == PAD else i]
        return x, y, i

    def __getitems__(self, keys: list[int | tuple[int, int]]) -> list:
        """A batch of samples; the DataLoader calls this, where it has one, instead of __getitem__ per sample."""
        if self.tensors is None:
            return [self[key] for key in keys]
        index = [key[0] if isinstance(key, tuple) else key for key in keys]
        rows = torch.tensor([0 if i == PAD else i for i in index])
        if self.rows is not None:
            rows = self.rows[rows]
        x, y = (t[rows] for t in self.tensors)
        return list(zip(x.unbind(0), y.unbind(0), index, strict=True))


def tensor_rows(dataset: Dataset) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
    """For a TensorDataset of (x, y), or Subsets of one: its tensors, and the row of each sample (None: sample
    i is row i). For any other dataset: (None, None)."""
    rows = None
    while isinstance(dataset, Subset):
        indices = torch.as_tensor(dataset.indices, dtype=torch.long)
        rows = indices if rows is None else indices[rows]
        dataset = dataset.dataset
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors, rows
    return None, None


def draws_random(dataset: Dataset) -> bool:
    """Whether reading a sample may draw random numbers: unless the dataset says otherwise, it may."""
    if isinstance(dataset, TensorDataset):
        return False
    if isinstance(dataset, Subset):
        return draws_random(dataset.dataset)
    return getattr(dataset, "draws_random", True)


class EvalSampler(DistributedSampler):
    """Rank r reads samples r, r+W, r+2W, ... exactly once; shorter ranks are padded with PAD slots.

    torch's DistributedSampler instead repeats real samples to even out the ranks, which counts them
    twice in every metric. Subclassing it tells Lightning to keep this sampler as it is.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        self.num_samples = max(1, math.ceil(len(dataset) / num_replicas))

    def __iter__(self):
        own = list(range(self.rank, len(self.dataset), self.num_replicas))
        return iter(own + [PAD] * (self.num_samples - len(own)))

    def __len__(self) -> int:
        return self.num_samples


class TrainSampler(DistributedSampler):
    """torch's DistributedSampler that knows its place in the epoch; the StatefulDataLoader saves it.

    The place is counted in samples all ranks consumed together, so a run stopped mid-epoch resumes with
    exactly the next global batch on any world size. The epoch's order is drawn at the first batch, not
    when the iterator is made: a resumed run makes its iterator before Lightning sets the epoch.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.consumed = self.skip = 0  # this rank's samples handed out this epoch; to skip at the next start

    def __iter__(self):
        self.consumed, self.skip = self.skip, 0
        for index in self.indices()[self.consumed :]:
            self.consumed += 1
            yield int(index), self.epoch  # the epoch seeds the sample's augmentation (Indexed)

    def indices(self) -> np.ndarray:
        """This rank's share of the epoch's order, drawn as torch's DistributedSampler draws it but kept as an
        array: its list of Python ints takes ~36 bytes a sample (1.2 GB per rank for 33M windows), this 8."""
        n = len(self.dataset)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        order = order if self.shuffle else torch.arange(n)
        order = order.repeat(math.ceil(self.total_size / n))[: self.total_size]  # pads unless drop_last
        return order[self.rank : self.total_size : self.num_replicas].numpy()

    def state_dict(self) -> dict[str, int]:
        return {"consumed_all_ranks": self.consumed * self.num_replicas, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["consumed_all_ranks"] // self.num_replicas
        # with workers the resumed iterator reads ahead as soon as it is made, before Lightning sets the epoch
        self.epoch = state.get("epoch", self.epoch)


class DataModule(L.LightningDataModule):
    """Base datamodule. `batch_size` is global: each device gets batch_size / (world x accumulation)."""

    def __init__(
        self, batch_size: int, num_workers: int = 0, pin_memory: bool = False, folds: int | None = None, fold: int = 0
    ):
        super().__init__()
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        if folds is not None and not (folds >= 2 and 0 <= fold < folds):
            raise ConfigError(f"data.folds={folds} data.fold={fold}: use folds >= 2 and 0 <= fold < folds")
        self.folds, self.fold = folds, fold  # k-fold cross-validation over train + val (see `setup`)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def splits(self) -> tuple[Dataset, Dataset, Dataset]:
        """The train, val and test datasets of `(x, y)` pairs: what a subclass provides."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:  # Lightning calls setup once per stage: build the splits once
            self.train_set, self.val_set, self.test_set = self.splits()
            if self.folds:
                self.train_set, self.val_set = fold_split(self.train_set, self.val_set, self.folds, self.fold)

    def _world(self) -> tuple[int, int]:
        # The strategy's data-parallel size and rank, not the world's: a tensor-parallel group reads one batch.
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    @property
    def per_device_batch_size(self) -> int:
        """Exact while fitting; rounded up for evaluation alone, whose padded slots are masked."""
        trainer, accumulate = self.trainer, self.trainer.accumulate_grad_batches if self.trainer else 1
        fitting = trainer is None or trainer.state.fn == TrainerFn.FITTING
        return per_device_batch_size(self.batch_size, self._world()[0], accumulate, exact=fitting)

    def _loader(self, dataset: Dataset, sampler, drop_last: bool, loader=DataLoader, **kwargs) -> DataLoader:
        return loader(
            Indexed(dataset, seed=int(os.environ.get("PL_GLOBAL_SEED", 0))),
            batch_size=self.per_device_batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        # A DistributedSampler even on one process: the same seed then gives the same global batches
        # on any world size (rank r's batch k is a slice of the single-process batch k), and dropping
        # the incomplete tail keeps every rank's micro-batch the same size.
        world, rank = self._world()
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        sampler = TrainSampler(self.train_set, world, rank, shuffle=True, seed=seed, drop_last=True)
        # A StatefulDataLoader: Lightning saves its position in each checkpoint, so a run stopped mid-epoch
        # resumes with exactly the next batch. Its own generator keeps the creation of each epoch's iterator
        # off the global RNG, whose state checkpoint/state.py saves and restores.
        generator = torch.Generator().manual_seed(seed + rank)
        return self._loader(self.train_set, sampler, True, StatefulDataLoader, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, EvalSampler(self.val_set, *self._world()), drop_last=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, EvalSampler(self.test_set, *self._world()), drop_last=False)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()


def fold_split(train: Dataset, val: Dataset, folds: int, fold: int) -> tuple[Dataset, Dataset]:
    """Fold `fold` of k-fold cross-validation: train + val shuffled once (a fixed seed: the same on every rank,
    run and fold), cut into `folds` near-equal parts; part `fold` validates, the others train."""
    pool = ConcatDataset([train, val])
    parts = np.array_split(np.random.default_rng(0).permutation(len(pool)), folds)
    held = parts[fold].tolist()
    return Subset(pool, np.concatenate([p for i, p in enumerate(parts) if i != fold]).tolist()), Subset(pool, held)
