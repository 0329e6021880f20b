"""A token corpus larger than memory: text files tokenized once per node into memory-mapped shards.

`prepare_data` (data/preparation.py: local rank 0 of each node, atomically, skipped when the manifest
matches) tokenizes the files of `source` into `dir`: shards of token ids (`tokens-00000.bin`, ...), the
BPE tokenizer if any (`tokenizer.json`) and `manifest.json` (input files, token counts, sha256 checksums
that `sha256sum` can check). Before a run reads them, the shards are checked against the manifest (their
lengths, and their sha256 where a file changed since it last matched: `damage`). Training reads windows through
np.memmap: a rank holds only the windows of its batch, whatever the size of the corpus.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import itertools
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from mlproject.core.errors import ConfigError
from mlproject.data.preparation import prepare, read_manifest
from mlproject.training.datamodule import DataModule, fold_split

TOKENIZERS = ("bytes", "bpe")
CHUNK = 1 << 24  # bytes of text read at a time: about what preparation holds in memory
FORMAT = 1  # bump when the shard layout changes, so old preparations are redone
VERIFIED = "verified.json"  # {shard: [size, mtime_ns]} of each shard as it was when its sha256 last matched


class ShardWriter:
    """Appends token ids to files of at most `shard_tokens` ids; records each file's count and sha256."""

    def __init__(self, dir: Path, dtype: str, shard_tokens: int):
        self.dir, self.dtype, self.shard_tokens = dir, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self.file, self.hash = None, None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self.file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next()
            part, ids = np.split(ids, [self.shard_tokens - self.shards[-1]["tokens"]])
            self.file.write(memoryview(part))
            self.hash.update(memoryview(part))
            self.shards[-1]["tokens"] += len(part)

    def _next(self) -> None:
        self.close()
        self.shards.append({"file": f"tokens-{len(self.shards):05d}.bin", "tokens": 0})
        # open across many writes; close() ends it
        self.file, self.hash = open(self.dir / self.shards[-1]["file"], "wb"), hashlib.sha256()  # noqa: SIM115

    def close(self) -> list[dict]:
        if self.file is not None:
            self.file.close()
            self.shards[-1]["sha256"] = self.hash.hexdigest()
            self.file = None
        return self.shards


def stamps(dir: Path, files: list[str]) -> dict[str, list[int]]:
    return {f: [(st := (dir / f).stat()).st_size, st.st_mtime_ns] for f in files}


def write_verified(dir: Path, verified: dict[str, list[int]]) -> None:
    """Atomically, by whichever process checked (several nodes may share `dir`); a read-only `dir` keeps none."""
    tmp = dir / f"{VERIFIED}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(verified))
        os.replace(tmp, dir / VERIFIED)
    except OSError:
        tmp.unlink(missing_ok=True)


def damage(dir: Path, manifest: dict) -> str | None:
    """What is wrong with the prepared shards (None: nothing): a shard missing, of another length than its
    count of tokens, or whose sha256 is not the manifest's. Hashing reads the whole corpus (~0.5 GiB/s a core),
    so only shards whose size or modification time changed since their hash last matched are hashed, a few
    at a time."""
    dtype, shards = manifest["dtype"], manifest["shards"]
    for shard in shards:
        path, tokens = dir / shard["file"], shard["tokens"]
        if not path.is_file():
            return f"{path} is missing, not the manifest's {tokens} tokens"
        if (size := path.stat().st_size) != (expected := tokens * np.dtype(dtype).itemsize):
            return f"{path} has {size} bytes, not the manifest's {expected} ({tokens} {dtype} tokens)"
    now = stamps(dir, [s["file"] for s in shards])
    verified = json.loads((dir / VERIFIED).read_text()) if (dir / VERIFIED).is_file() else {}
    changed = [s for s in shards if verified.get(s["file"]) != now[s["file"]]]

    def sha256(shard: dict) -> str:
        with open(dir / shard["file"], "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # hashlib hashes outside the GIL
        for shard, digest in zip(changed, pool.map(sha256, changed), strict=True):
            if digest != (want := shard["sha256"]):
                return f"{dir / shard['file']} has sha256 {digest[:16]}..., not the manifest's {want[:16]}..."
    if changed:
        write_verified(dir, now)
    return None


def text_chunks(files: list[Path]) -> Iterator[str]:
    """The corpus as text in pieces of about CHUNK bytes, cut at line ends (a word is never split)."""
    if not files:  # data.source=null: Python's documentation, as data=text
        from mlproject.data.text import corpus

        yield corpus()
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            while piece := f.read(CHUNK):
                yield piece + f.readline()


def byte_chunks(files: list[Path]) -> Iterator[np.ndarray]:
    if not files:
        yield from (np.frombuffer(text.encode("utf-8"), np.uint8) for text in text_chunks(files))
    for path in files:
        with open(path, "rb") as f:
            while piece := f.read(CHUNK):
                yield np.frombuffer(piece, np.uint8)


def train_bpe(files: list[Path], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme: any text encodes, no unknown token) trained on the corpus itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(text_chunks(files), trainer=trainer)
    return tokenizer


class Windows(Dataset):
    """Non-overlapping windows `first .. first + count` of block_size + 1 tokens, numbered across shards
    (a window never spans two): x = window[:-1], y = window[1:].

    Each read maps its shard anew, as nanoGPT does: a mapping kept open would count every page ever read
    in the process's resident memory, so a long epoch would look like the corpus in memory.
    """

    def __init__(self, dir: Path, manifest: dict, block_size: int, first: int, count: int):
        self.paths = [str(dir / s["file"]) for s in manifest["shards"]]
        self.dtype, self.block_size, self.first, self.count = manifest["dtype"], block_size, first, count
        self.ends = list(itertools.accumulate((s["tokens"] - 1) // block_size for s in manifest["shards"]))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        j = self.first + i
        shard = bisect.bisect_right(self.ends, j)
        start = (j - (self.ends[shard - 1] if shard else 0)) * self.block_size
        window = np.memmap(self.paths[shard], dtype=self.dtype, mode="r")[start : start + self.block_size + 1]
        window = torch.from_numpy(window.astype(np.int64))
        return window[:-1], window[1:]


class TokensDataModule(DataModule):
    """Windows of the prepared corpus split by position: the first part trains, the next validates, the
    last tests (as data=text)."""

    def __init__(
        self,
        dir: str,
        source: str | None = None,
        tokenizer: str = "bytes",
        vocab_size: int = 256,
        block_size: int = 128,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        shard_tokens: int = 1 << 28,
        prepare_per_node: bool = True,
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        folds: int | None = None,
        fold: int = 0,
    ):
        super().__init__(batch_size, num_workers, pin_memory, folds, fold)
        self.save_hyperparameters()
        if tokenizer not in TOKENIZERS:
            raise ConfigError(f"data.tokenizer={tokenizer} is not one of {', '.join(TOKENIZERS)}")
        if tokenizer == "bytes" and vocab_size != 256:
            raise ConfigError(
                f"data.tokenizer=bytes has 256 token ids, not data.vocab_size={vocab_size}; set it to 256"
            )
        self.dir = Path(dir)
        self.prepare_data_per_node = prepare_per_node  # Lightning's switch: False = global rank 0 prepares

    def files(self) -> list[Path]:
        """The text files of data.source in name order (the corpus's order); [] for Python's documentation."""
        if self.hparams.source is None:
            return []
        files = sorted(Path(p) for p in glob.glob(self.hparams.source, recursive=True) if Path(p).is_file())
        if not files:
            raise ConfigError(f"data.source={self.hparams.source} matches no file; give a glob of text files")
        return files

    def key(self, files: list[Path]) -> dict:
        """What the preparation depends on: a change to any input file or setting redoes it."""
        hp = self.hparams
        inputs = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
        return {
            "format": FORMAT,
            "source": inputs or f"pydoc_data of Python {sys.version.split()[0]}",
            "tokenizer": hp.tokenizer,
            "vocab_size": hp.vocab_size,
            "shard_tokens": hp.shard_tokens,
        }

    def prepare_data(self) -> None:
        """Inside a run (Lightning's call) damaged shards are refused; called alone (mlproject.prepare), they
        are prepared again."""
        files = self.files()
        prepare(self.dir, self.key(files), lambda tmp: self.build(files, tmp), damage, repair=self.trainer is None)

    def build(self, files: list[Path], tmp: Path) -> dict:
        hp = self.hparams
        if hp.tokenizer == "bytes":
            vocab, chunks = 256, byte_chunks(files)
        else:
            bpe = train_bpe(files, hp.vocab_size)
            bpe.save(str(tmp / "tokenizer.json"))
            vocab = bpe.get_vocab_size()
            # each piece's lines encoded on all cores, in order
            chunks = (
                np.concatenate([[], *(e.ids for e in bpe.encode_batch(t.splitlines(True)))]) for t in text_chunks(files)
            )
        dtype = "uint8" if vocab <= 1 << 8 else "uint16" if vocab <= 1 << 16 else "uint32"
        writer = ShardWriter(tmp, dtype, hp.shard_tokens)
        for ids in chunks:
            writer.write(ids)
        shards = writer.close()
        write_verified(tmp, stamps(tmp, [s["file"] for s in shards]))  # hashed while written
        return {
            "tokenizer": hp.tokenizer,
            "vocab_size": vocab,
            "dtype": dtype,
            "tokens": sum(s["tokens"] for s in shards),
            "shards": shards,
        }

    def splits(self):
        hp, manifest = self.hparams, read_manifest(self.dir)
        if manifest is None or manifest["key"] != self.key(self.files()):
            raise ConfigError(f"data.dir={self.dir} holds no preparation of data.source; run mlproject.prepare")
        n = sum((s["tokens"] - 1) // hp.block_size for s in manifest["shards"])
        n_val, n_test = int(n * hp.val_fraction), int(n * hp.test_fraction)
        if min(n_val, n_test, n - n_val - n_test) < 1:
            raise ConfigError(
                f"data.val_fraction={hp.val_fraction} and data.test_fraction={hp.test_fraction} of {n} windows of "
                f"{hp.block_size} tokens leave an empty split; change them or give more text"
            )
        n_train = n - n_val - n_test
        return (
            Windows(self.dir, manifest, hp.block_size, 0, n_train),
            Windows(self.dir, manifest, hp.block_size, n_train, n_val),
            Windows(self.dir, manifest, hp.block_size, n_train + n_val, n_test),
        )

    def split_fold(self, train: Dataset, val: Dataset) -> tuple[Dataset, Dataset]:
        """Contiguous parts of train + val, in text order: neighbouring windows continue each other's text, so
        shuffled folds would validate on windows next to those that train."""
        return fold_split(train, val, self.folds, self.fold, shuffle=False)
