"""Character-level text for the GPT example: Python's own documentation, installed with every CPython.

`pydoc_data.topics` holds the text of `help()` on language topics (about 460k characters of English
and code). It is on every machine that runs Python, so nothing is downloaded or shipped; the exact
text follows the Python version. Tokens are the text's UTF-8 bytes: a fixed vocabulary of 256 that
needs no vocabulary file and is one token per character for this (almost all ASCII) text.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from mlproject.core.errors import ConfigError
from mlproject.training.datamodule import DataModule, fold_split

VOCAB_SIZE = 256


def corpus() -> str:
    """The topics in name order, so the text (and every split) is the same on each call."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def encode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


class Chunks(Dataset):
    """Non-overlapping windows of block_size tokens: x = tokens[i : i+T], y = tokens[i+1 : i+T+1]."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int):
        start = i * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


class TextDataModule(DataModule):
    """The corpus split by position: the first part trains, the next validates, the last tests."""

    def __init__(
        self,
        batch_size: int = 64,
        block_size: int = 128,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
        pin_memory: bool = False,
        folds: int | None = None,
        fold: int = 0,
    ):
        super().__init__(batch_size, num_workers, pin_memory, folds, fold)
        self.save_hyperparameters()

    def splits(self):
        hp = self.hparams
        tokens = encode(corpus())
        n_val, n_test = int(len(tokens) * hp.val_fraction), int(len(tokens) * hp.test_fraction)
        if min(n_val, n_test, len(tokens) - n_val - n_test) <= hp.block_size:
            raise ConfigError(
                f"data.val_fraction={hp.val_fraction} and data.test_fraction={hp.test_fraction} of "
                f"{len(tokens)} tokens leave a split shorter than one block of {hp.block_size}; change them"
            )
        n_train = len(tokens) - n_val - n_test
        return (
            Chunks(tokens[:n_train], hp.block_size),
            Chunks(tokens[n_train : n_train + n_val], hp.block_size),
            Chunks(tokens[n_train + n_val :], hp.block_size),
        )

    def split_fold(self, train: Dataset, val: Dataset) -> tuple[Dataset, Dataset]:
        """Contiguous parts of train + val, in text order: neighbouring windows continue each other's text, so
        shuffled folds would validate on windows next to those that train."""
        return fold_split(train, val, self.folds, self.fold, shuffle=False)
