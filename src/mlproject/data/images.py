"""Images in the ImageNet layout, `dir/<class>/<image file>`, decoded lazily: one file per sample read.

Pillow decodes and resizes, torch ops augment: torchvision would be the usual choice, but its wheels are
built against one torch build each, and PyPI's does not import beside every torch this template pins
(CPU or CUDA builds). Training samples get a random crop of the zero-padded image and, if asked, a
horizontal flip, drawn from the process's random streams; with `seed_batches=true`, from streams seeded by
(seed, epoch, batch) in whichever worker loads them (training/loaders.py), so that a run resumed mid-epoch with
workers sees the same augmented images.

`source: digits` makes `prepare_data` write scikit-learn's 1,797 digits into `dir` as 8x8 grayscale PNGs
(once per node, like data=tokens): the digits example on image files, with nothing to download.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from mlproject.core.errors import ConfigError
from mlproject.data.labels import check_labels
from mlproject.data.preparation import prepare, read_manifest
from mlproject.training.datamodule import DataModule, fold_indices

EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
SOURCES = (None, "digits")


class UnreadableImage(ConfigError):
    """An image file Pillow cannot decode. Raised in a DataLoader worker, it is raised again in the main process
    with the worker's traceback as its message (torch's ExceptionWrapper): the message keeps only its own line."""

    def __init__(self, message: str):
        super().__init__(message.rpartition(f"{__name__}.UnreadableImage: ")[2].rstrip())


class ImageFiles(Dataset):
    """(image as float channels x size x size in [0, 1], class index) for each (path, class) in `samples`."""

    def __init__(self, samples: list[tuple[str, int]], size: int, channels: int, crop_padding: int, hflip: bool):
        self.samples, self.size, self.channels = samples, size, channels
        self.crop_padding, self.hflip = crop_padding, hflip

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image, UnidentifiedImageError

        path, label = self.samples[i]
        try:
            with Image.open(path) as image:
                image = image.convert("L" if self.channels == 1 else "RGB").resize((self.size, self.size))
        except Exception as exc:  # whatever Pillow raises (OSError, SyntaxError, ValueError...), this file is the cause
            unknown = isinstance(exc, UnidentifiedImageError)  # its text only repeats the path
            why = "no format Pillow knows" if unknown else f"{type(exc).__name__}: {exc}"
            raise UnreadableImage(f"{path} cannot be read as an image ({why}); replace or remove the file") from None
        x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).view(self.size, self.size, self.channels)
        return self.augment(x.permute(2, 0, 1)), label

    def augment(self, x: torch.Tensor) -> torch.Tensor:
        if pad := self.crop_padding:
            top, left = torch.randint(0, 2 * pad + 1, (2,)).tolist()
            x = F.pad(x, (pad, pad, pad, pad))[:, top : top + self.size, left : left + self.size]
        if self.hflip and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x

    def with_samples(self, samples: list[tuple[str, int]]) -> ImageFiles:
        """The same reading and augmentation, over other samples."""
        return ImageFiles(samples, self.size, self.channels, self.crop_padding, self.hflip)


def write_digits(dir: Path) -> dict:
    """scikit-learn's digits as `dir/<digit>/<index>.png`, 8x8 grayscale (their 0..16 scaled to 0..255)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    for k, (image, label) in enumerate(zip(images, labels, strict=True)):
        (dir / str(label)).mkdir(exist_ok=True)
        pixels = np.round(image.reshape(8, 8) * 255 / 16).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(dir / str(label) / f"{k:04d}.png")
    return {"images": len(labels)}


class ImagesDataModule(DataModule):
    """The files split at random (fixed by split_seed): val_fraction validates, test_fraction tests."""

    def __init__(
        self,
        dir: str,
        source: str | None = None,
        image_size: int = 8,
        channels: int = 1,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        crop_padding: int = 1,
        hflip: bool = False,
        prepare_per_node: bool = True,
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        folds: int | None = None,
        fold: int = 0,
    ):
        super().__init__(batch_size, num_workers, pin_memory, folds, fold)
        self.save_hyperparameters()
        if source not in SOURCES:
            raise ConfigError(f"data.source={source} is not one of: null (your own folder), digits")
        if channels not in (1, 3):
            raise ConfigError(f"data.channels={channels}: images are read as 1 (grayscale) or 3 (RGB) channels")
        self.dir = Path(dir)
        self.prepare_data_per_node = prepare_per_node  # Lightning's switch: False = global rank 0 prepares

    def prepare_data(self) -> None:
        if self.hparams.source == "digits":
            if read_manifest(self.dir) is None and self.dir.is_dir() and any(self.dir.iterdir()):
                raise ConfigError(
                    f"data.dir={self.dir} holds images of your own: add data.source=null to train on them "
                    "(data.source=digits writes the digits example into an empty or new directory)"
                )
            prepare(self.dir, {"source": "digits", "format": 1}, write_digits)

    def files(self) -> list[tuple[str, int]]:
        """(path, class index) of every image, classes being the subfolders in name order."""
        classes = sorted(p for p in self.dir.iterdir() if p.is_dir()) if self.dir.is_dir() else []
        samples = [
            (str(f), label)
            for label, folder in enumerate(classes)
            for f in sorted(folder.iterdir())
            if f.suffix.lower() in EXTENSIONS
        ]
        if not samples:
            raise ConfigError(f"data.dir={self.dir} holds no images in class subfolders (<dir>/<class>/<image>)")
        return samples

    def splits(self):
        hp, samples = self.hparams, self.files()
        check_labels(self, samples[-1][1], f"the labels of the class folders in data.dir={self.dir}")  # by class
        n_val, n_test = int(len(samples) * hp.val_fraction), int(len(samples) * hp.test_fraction)
        if min(n_val, n_test, len(samples) - n_val - n_test) < 1:
            raise ConfigError(
                f"data.val_fraction={hp.val_fraction} and data.test_fraction={hp.test_fraction} of {len(samples)} "
                "images leave an empty split; change them"
            )
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(hp.split_seed)).tolist()
        pick = [samples[i] for i in order]
        test, val, train = pick[:n_test], pick[n_test : n_test + n_val], pick[n_test + n_val :]
        plain = {"size": hp.image_size, "channels": hp.channels, "crop_padding": 0, "hflip": False}
        return (
            ImageFiles(train, **{**plain, "crop_padding": hp.crop_padding, "hflip": hp.hflip}),
            ImageFiles(val, **plain),
            ImageFiles(test, **plain),
        )

    def split_fold(self, train: ImageFiles, val: ImageFiles) -> tuple[ImageFiles, ImageFiles]:
        """The fold's files, each read as its split reads: training images augmented, validation ones not."""
        pool = train.samples + val.samples
        keep, held = fold_indices(len(pool), self.folds, self.fold)
        return train.with_samples([pool[i] for i in keep]), val.with_samples([pool[i] for i in held])
