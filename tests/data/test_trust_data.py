"""Data that cannot train ends in one line naming the key or the file, before training where it can be seen then:
labels beyond the model's num_classes, damaged token shards (length and sha256 against the manifest), an image file
Pillow cannot decode (found where it is read, in a dataloader worker)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from mlproject.data.images import ImageFiles, ImagesDataModule, UnreadableImage
from mlproject.data.tokens import VERIFIED, damage
from tests.data.test_images import write_folder
from tests.data.test_tokens import TINY_GPT, datamodule
from tests.helpers.processes import FAST, run

DAMAGED = "data.dir={dir} is damaged; prepare it again with `make prepare` and this run's data settings."


def refused(tmp_path: Path, *overrides: str) -> str:
    """`train` in a throwaway directory that also holds a file of the user's: it exits 2, its last line on stderr
    (returned) the only error and no traceback, before any checkpoint or metrics were written; the directory and
    the file survive. (Lightning's own lines about the devices come before: the refusal is inside `fit`.)"""
    (tmp_path / "notes.txt").write_text("mine")
    proc = run("train", *FAST, "trainer.max_epochs=1", *overrides, log_dir=tmp_path / "logs", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and sum("error" in ln.lower() for ln in lines) == 1, proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not [*tmp_path.rglob("*.ckpt"), *tmp_path.rglob("metrics.json")]
    return lines[-1]


@pytest.mark.parametrize("key", ["model.num_classes", "model.net.num_classes"])
def test_digits_labels_beyond_num_classes_are_refused_before_training(tmp_path, key):
    """The module's class count, or the network's set apart from it: either would fail in cross-entropy."""
    line = refused(tmp_path, "data=digits", "model=digits", f"{key}=5")
    assert line == f"error: {key}=5 is too few: the digits' labels go up to 9; set {key}=10."


def test_image_folder_labels_beyond_num_classes_are_refused_before_training(tmp_path):
    folder = write_folder(tmp_path / "img", classes=3, per_class=4)
    line = refused(tmp_path, "data=images", f"data.dir={folder}", "data.source=null", "model.num_classes=2")
    assert line == (
        f"error: model.num_classes=2 is too few: the labels of the class folders in data.dir={folder} go up to 2; "
        "set model.num_classes=3."
    )


def prepared(tmp_path: Path, tokenizer: str = "bytes") -> tuple[list[str], Path, dict]:
    """2 KiB of text prepared into tmp_path/tok: the data overrides that read it, its first shard, its manifest."""
    corpus, out = tmp_path / "corpus", tmp_path / "tok"
    corpus.mkdir()
    (corpus / "a.txt").write_text(" ".join(f"w{i % 37}{'xyz'[i % 3]}" for i in range(512))[:2048])
    vocab = 300 if tokenizer == "bpe" else 256  # bpe: more than 256 ids, so 2-byte (uint16) tokens
    datamodule(corpus, out, tokenizer=tokenizer, vocab_size=vocab).prepare_data()
    manifest = json.loads((out / "manifest.json").read_text())
    data = ["data=tokens", f"data.source={corpus}/*.txt", f"data.dir={out}", "data.block_size=16"]
    data += [f"data.tokenizer={tokenizer}", f"data.vocab_size={vocab}"]
    return data, out / manifest["shards"][0]["file"], manifest


def test_shortened_shard_is_refused_at_setup_not_at_the_test_stage(tmp_path):
    """The last windows, the test split's, are the ones a cut shard lacks: refused before training."""
    overrides, shard, manifest = prepared(tmp_path)
    size = shard.stat().st_size
    os.truncate(shard, size - 10)
    assert refused(tmp_path, *TINY_GPT, *overrides) == (
        f"error: {shard} has {size - 10} bytes, not the manifest's {size} ({size} uint8 tokens): "
        + DAMAGED.format(dir=shard.parent)
    )


def test_shard_of_odd_length_is_refused(tmp_path):
    """2-byte tokens (BPE) and a byte more: np.memmap's traceback before, the file and both lengths now."""
    overrides, shard, manifest = prepared(tmp_path, "bpe")
    tokens = manifest["shards"][0]["tokens"]
    with open(shard, "ab") as f:
        f.write(b"\0")
    assert refused(tmp_path, *TINY_GPT, *overrides) == (
        f"error: {shard} has {2 * tokens + 1} bytes, not the manifest's {2 * tokens} ({tokens} uint16 tokens): "
        + DAMAGED.format(dir=shard.parent)
    )


def test_shard_of_the_right_length_and_other_content_fails_its_sha256(tmp_path):
    overrides, shard, manifest = prepared(tmp_path)
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(data)
    found, want = hashlib.sha256(data).hexdigest(), manifest["shards"][0]["sha256"]
    assert refused(tmp_path, *TINY_GPT, *overrides) == (
        f"error: {shard} has sha256 {found[:16]}..., not the manifest's {want[:16]}...: "
        + DAMAGED.format(dir=shard.parent)
    )


def test_make_prepare_redoes_a_damaged_preparation(tmp_path):
    """What the refusal says to do works: `mlproject.prepare` (make prepare) prepares the damaged data again."""
    overrides, shard, manifest = prepared(tmp_path)
    intact = shard.read_bytes()
    os.truncate(shard, 100)
    run("prepare", *overrides, log_dir=tmp_path / "logs")
    assert shard.read_bytes() == intact
    assert damage(shard.parent, manifest) is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tok")] == ["tok"]  # the damaged copy is gone


def test_sha256_is_hashed_again_only_for_a_shard_whose_size_or_mtime_changed(tmp_path):
    """The preparation stamps each shard's (size, mtime) as hashed while written: a check reads no shard until one
    changes. So a shard rewritten with its size and mtime kept passes (the stamp is trusted: `sha256sum -c` checks
    such a copy); once its mtime moves it is hashed again and refused."""
    _, shard, manifest = prepared(tmp_path)
    stamp = json.loads((shard.parent / VERIFIED).read_text())[shard.name]
    assert stamp == [shard.stat().st_size, shard.stat().st_mtime_ns]
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(data)
    os.utime(shard, ns=(stamp[1], stamp[1]))
    assert damage(shard.parent, manifest) is None
    os.utime(shard, ns=(stamp[1] + 1, stamp[1] + 1))
    assert damage(shard.parent, manifest).startswith(f"{shard} has sha256 {hashlib.sha256(data).hexdigest()[:16]}")


def test_hashing_the_default_corpus_costs_milliseconds(tmp_path):
    """data=tokens's default, Python's documentation: one shard of ~0.5 MB, checked in full at every setup whose
    stamp is gone. Measured on 2 shared cores: ~2 ms (hashlib at ~0.5 GiB/s a core)."""
    from mlproject.data.tokens import TokensDataModule

    TokensDataModule(dir=str(tmp_path / "tok")).prepare_data()
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    (tmp_path / "tok" / VERIFIED).unlink()
    start = time.perf_counter()
    assert damage(tmp_path / "tok", manifest) is None
    seconds = time.perf_counter() - start
    print(f"sha256 of {manifest['tokens']} tokens in {len(manifest['shards'])} shard(s): {seconds * 1e3:.1f} ms")
    assert seconds < 0.5


def test_corrupt_image_read_in_a_worker_is_named_in_one_line(tmp_path):
    """A file of the training split that is no image: the worker's error reaches the main process as one line."""
    folder = write_folder(tmp_path / "img", classes=3, per_class=4)
    data = ["data=images", f"data.dir={folder}", "data.source=null", "data.channels=3", "model.num_classes=3"]
    train, _, _ = ImagesDataModule(dir=str(folder), source=None).splits()
    bad = Path(train.samples[0][0])
    bad.write_bytes(b"not an image")
    line = refused(tmp_path, *data, "data.num_workers=2", "data.batch_size=4")
    assert line == f"error: {bad} cannot be read as an image (no format Pillow knows); replace or remove the file."


def test_truncated_image_names_the_file_and_pillows_reason(tmp_path):
    folder = write_folder(tmp_path / "img", classes=1, per_class=1)
    path = folder / "class_0" / "0.png"
    path.write_bytes(path.read_bytes()[:60])  # the header whole, the pixels cut
    with pytest.raises(UnreadableImage) as caught:
        ImageFiles([(str(path), 0)], size=8, channels=3, crop_padding=0, hflip=False)[0]
    assert str(caught.value).startswith(f"{path} cannot be read as an image (OSError: ")


def test_a_repair_keeps_a_preparation_finished_meanwhile_and_drops_the_damaged_one(tmp_path, monkeypatch):
    """Two jobs repair one (shared) damaged directory: the one that ends second keeps the first one's result, and
    the damaged copy it moved aside at its start is gone."""
    from mlproject.data.preparation import prepare

    out, key = tmp_path / "prepared", {"source": "same"}

    def damaged(dir: Path, manifest: dict) -> str | None:
        return None if (dir / "data.txt").read_text() != "cut" else f"{dir / 'data.txt'} is cut"

    def build(by: str):
        def write(tmp: Path) -> dict:
            if by == "second":  # the other job (another pid: its own tmp) finishes while this one builds
                with monkeypatch.context() as m:
                    m.setattr(os, "getpid", lambda: 1)
                    prepare(out, key, build("first"), damaged, repair=True)
            (tmp / "data.txt").write_text(by)
            return {"by": by}

        return write

    prepare(out, key, build("first"))
    (out / "data.txt").write_text("cut")
    with pytest.raises(ValueError, match=f"^{out}/data.txt is cut: data.dir={out} is damaged; prepare it again"):
        prepare(out, key, build("second"), damaged)  # inside a run: refused
    assert prepare(out, key, build("second"), damaged, repair=True)["by"] == "first"
    assert (out / "data.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]
