"""The samplers the template gives a datamodule's DataLoaders, as Lightning does for `use_distributed_sampler`.

`with_template_samplers(datamodule)` wraps its four `*_dataloader` hooks: each DataLoader they return over a
map-style dataset is made anew with the same dataset, collate function and worker settings, and:
- training: a StatefulDataLoader with TrainSampler: the same global batches on any world size, the position
  saved in every checkpoint, a run stopped mid-epoch resumed exactly (random augmentation too, with
  `seed_batches`: each batch read under random streams of its own, Seeded);
- evaluation: EvalBatches: every sample counted once on any world size, and no padded slot, ever.
Loaders over an IterableDataset, and anything that is not a DataLoader, pass through unchanged. A sampler of the
user's own (not Random/SequentialSampler) is kept, split over the data-parallel ranks as Lightning splits it.
"""

from __future__ import annotations

import contextlib
import math
import os
import random

import numpy as np
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    Subset,
    TensorDataset,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from mlproject.core.errors import ConfigError
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)


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


class Seeded(Dataset):
    """The user's dataset read a batch at a time; with `streams`, inside random streams seeded by (seed, epoch,
    batch).

    The sampler gives `i` or `(i, epoch)`; a batch is named by its epoch and its first sample (a rank reads
    each sample at most once an epoch). With `streams`, random augmentation is the same whichever worker, or the
    main process, loads the batch, so a run resumed mid-epoch with workers draws what the straight run drew, and
    loading never moves the training RNG (the streams are restored after each batch); it costs ~100 us a batch.
    Without (the default: a user's augmentation draws from the process's RNGs as it would under Lightning alone),
    the batch is read as it is. A TensorDataset (or a Subset of one) draws no random numbers: it is read with one
    gather per tensor, where reading it a sample at a time costs ~3 us a sample.
    """

    def __init__(self, dataset: Dataset, seed: int = 0, streams: bool = True):
        self.dataset, self.seed, self.streams = dataset, seed, streams
        self.tensors, self.rows = tensor_rows(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | tuple[int, int]):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[int | tuple[int, int]]) -> list:
        """A batch of samples; the DataLoader calls this, where it has one, instead of __getitem__ per sample."""
        index = [key[0] if isinstance(key, tuple) else key for key in keys]
        if self.tensors is not None:
            rows = torch.tensor(index) if self.rows is None else self.rows[index]
            return list(zip(*(t[rows].unbind(0) for t in self.tensors), strict=True))
        epoch = keys[0][1] if isinstance(keys[0], tuple) else 0
        with sample_rng(self.seed, epoch, index[0]) if self.streams else contextlib.nullcontext():
            if hasattr(self.dataset, "__getitems__"):
                return self.dataset.__getitems__(index)
            return [self.dataset[i] for i in index]


def tensor_rows(dataset: Dataset) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
    """For a TensorDataset, or Subsets of one: its tensors, and the row of each sample (None: sample i is row
    i). For any other dataset: (None, None)."""
    rows = None
    while isinstance(dataset, Subset):
        indices = torch.as_tensor(dataset.indices, dtype=torch.long)
        rows = indices if rows is None else indices[rows]
        dataset = dataset.dataset
    if isinstance(dataset, TensorDataset):
        return dataset.tensors, rows
    return None, None


class EvalBatches(Sampler):
    """Rank r reads its own contiguous block of the split, every sample of it once, in batches of at most
    `batch_size`; every rank runs the same number of batches (sharded strategies gather parameters in each
    forward), and the last batches of ranks differ in size where the split does not divide: never padded.
    Blocks in rank order are the split in order (callbacks/predictions.py relies on it).

    A split smaller than the world cannot give every rank a sample: refused. With a per-device batch of 1
    and a split the world does not divide, some batches hold 2 samples, so that no rank runs out.
    """

    def __init__(self, size: int, batch_size: int, num_replicas: int, rank: int):
        if size < num_replicas:
            raise ConfigError(
                f"an evaluation split of {size} samples cannot give each of {num_replicas} data-parallel ranks a "
                f"sample: evaluate on at most {size} processes (trainer.devices), or use a larger split"
            )
        base, extra = divmod(size, num_replicas)
        self.start, self.count = rank * base + min(rank, extra), base + (rank < extra)
        self.batch_size, self.batches = batch_size, min(base, math.ceil((base + (extra > 0)) / batch_size))

    def __iter__(self):
        start, end = self.start, self.start + self.count
        for k in range(self.batches):
            left, batches_left = end - start, self.batches - k
            # full batches while they leave a sample for each batch to come; the tail is the short one
            n = max(math.ceil(left / batches_left), min(self.batch_size, left - batches_left + 1))
            yield list(range(start, start + n))
            start += n

    def __len__(self) -> int:
        return self.batches


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
            yield int(index), self.epoch  # the epoch seeds the batch's augmentation (Seeded)

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


def data_parallel(trainer) -> tuple[int, int]:
    """The strategy's data-parallel size and rank, not the world's: a tensor-parallel group reads one batch."""
    kwargs = trainer.distributed_sampler_kwargs if trainer else None
    return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)


def with_samplers(loader, train: bool, trainer, seed_batches: bool = False):
    """`loader` made anew with the template's sampler (see the module's docstring)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, (IterableDataset, Seeded)):
        return loader  # Seeded: made here already (a predict_dataloader that returns test_dataloader())
    if loader.batch_size is None:
        raise ConfigError(
            f"a DataLoader of {type(loader.dataset).__name__} has its own batch_sampler; give it batch_size= "
            "instead: the template brings the samplers that make batches exact on any world size"
        )
    world, rank = data_parallel(trainer)
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    kwargs = {
        "collate_fn": loader.collate_fn,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "pin_memory_device": loader.pin_memory_device,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "in_order": loader.in_order,
    }
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        return with_own_sampler(loader, train, world, rank, kwargs)
    dataset = Seeded(loader.dataset, seed, streams=seed_batches)
    if not train:
        return DataLoader(dataset, batch_sampler=EvalBatches(len(dataset), loader.batch_size, world, rank), **kwargs)
    if trainer is not None and trainer.overfit_batches:  # the first batches again and again, as Lightning does it
        sampler = SequentialSampler(dataset)  # (it would rebuild any other loader, which a StatefulDataLoader refuses)
        return DataLoader(dataset, loader.batch_size, sampler=sampler, drop_last=loader.drop_last, **kwargs)
    # A DistributedSampler even on one process: the same seed then gives the same global batches on any world
    # size (rank r's batch k is a slice of the single-process batch k), and dropping the sampler's incomplete
    # tail keeps every rank's number of batches the same. Its own generator keeps the creation of each epoch's
    # iterator off the global RNG, whose state checkpoint/state.py saves and restores.
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = TrainSampler(loader.dataset, world, rank, shuffle=shuffle, seed=seed, drop_last=True)
    generator = torch.Generator().manual_seed(seed + rank)
    return StatefulDataLoader(
        dataset, loader.batch_size, sampler=sampler, drop_last=loader.drop_last, generator=generator, **kwargs
    )


def with_own_sampler(loader: DataLoader, train: bool, world: int, rank: int, kwargs: dict) -> DataLoader:
    """`loader` with the user's own sampler kept (a weighted or class-balanced one draws what the user chose),
    split over `world` ranks by Lightning's DistributedSamplerWrapper, as use_distributed_sampler would split it;
    a DistributedSampler, which splits already, as it is (as Lightning keeps it)."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    split = world > 1 and not isinstance(loader.sampler, DistributedSampler)
    how = f", split over {world} data-parallel ranks by Lightning's DistributedSamplerWrapper" if split else ""
    log.warning(
        f"the {'train' if train else 'evaluation'} DataLoader's {type(loader.sampler).__name__} is kept{how}: its "
        "batches are its own, not the template's (the same on any world size, resumed exactly mid-epoch, every "
        "evaluation sample counted once); give the DataLoader shuffle= instead of a sampler to have those"
    )
    if not split:
        return loader
    sampler = DistributedSamplerWrapper(loader.sampler, num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(loader.dataset, loader.batch_size, sampler=sampler, drop_last=loader.drop_last, **kwargs)


class WithSamplers:
    """A datamodule's `*_dataloader` hook, its loaders made anew by `with_samplers`. An object, not a closure,
    so that the datamodule still pickles (ddp_spawn sends it to its processes); `__wrapped__` is the class's
    hook, where Lightning's `is_overridden` looks."""

    def __init__(self, datamodule, name: str, seed_batches: bool):
        self.datamodule, self.name, self.seed_batches = datamodule, name, seed_batches
        self.__wrapped__ = getattr(type(datamodule), name)

    def __call__(self):
        loaders = self.__wrapped__(self.datamodule)
        train = self.name == "train_dataloader"
        return apply_to_collection(
            loaders, DataLoader, with_samplers, train, self.datamodule.trainer, self.seed_batches
        )


def with_template_samplers(datamodule, seed_batches: bool = False):
    """The datamodule, its `*_dataloader` hooks wrapped by `with_samplers` (on the instance: every other hook,
    attribute and state is the user's own, and Lightning's `is_overridden` still sees the user's methods)."""
    for name in ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"):
        if not isinstance(getattr(datamodule, name), WithSamplers):
            setattr(datamodule, name, WithSamplers(datamodule, name, seed_batches))
    return datamodule
