"""data=tokens: preparation once per node, atomic and skipped when up to date; training reads a corpus
larger than what a rank holds in memory; evaluation is exact and a resume on another world size continues
with the next global batch."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mlproject.core.constants import PROJECT_ROOT
from mlproject.core.errors import ConfigError
from mlproject.data.tokens import TokensDataModule
from tests.checkpoint.helpers import kill_at, run_dir, train, wait_until_gone, weights
from tests.data.folds import check_folds
from tests.data.resume import assert_close_to, assert_resumed_in_place, record
from tests.helpers.processes import FAST, PYTHON, clean_env, free_port, read_metrics, run, run_dirs, together

TINY_GPT = ["model=gpt", "model.net.n_layer=1", "model.net.n_head=2", "model.net.n_embd=32"]
FEW_STEPS = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=2", "test=false"]
PEAK_RSS = 1 << 30  # bytes a rank may reach at peak while training on the >= 1 GiB corpus (measured: 538 MiB)


def write_corpus(dir: Path, size: int, files: int = 1) -> Path:
    """`files` text files of `size` bytes in all, a 1 MiB block of random words repeated (fast to write);
    under 1 MiB, the block's start."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnop"), n)) for n in rng.integers(2, 9, 500)]
    block = "\n".join(" ".join(rng.choice(words, 12)) for _ in range(20000)).encode()[: 1 << 20]
    dir.mkdir(parents=True)
    for k in range(files):
        with open(dir / f"part{k}.txt", "wb") as f:
            for start in range(0, size // files, len(block)):
                f.write(block[: size // files - start])
    return dir


def datamodule(corpus: Path, out: Path, **kwargs) -> TokensDataModule:
    return TokensDataModule(dir=str(out), source=str(corpus / "*.txt"), block_size=16, **kwargs)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_preparation_writes_shards_a_manifest_and_is_skipped_when_it_matches(tmp_path, tokenizer):
    corpus = write_corpus(tmp_path / "corpus", 2 << 20, files=2)
    vocab = 300 if tokenizer == "bpe" else 256
    dm = datamodule(corpus, tmp_path / "tok", tokenizer=tokenizer, vocab_size=vocab, shard_tokens=300_000)
    dm.prepare_data()
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2  # rolled over at shard_tokens
    for shard in manifest["shards"]:
        data = (tmp_path / "tok" / shard["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert len(data) == shard["tokens"] * np.dtype(manifest["dtype"]).itemsize
    ids = np.concatenate([np.fromfile(tmp_path / "tok" / s["file"], manifest["dtype"]) for s in manifest["shards"]])
    text = b"".join(p.read_bytes() for p in sorted(corpus.iterdir()))
    if tokenizer == "bytes":
        assert ids.tobytes() == text
    else:
        from tokenizers import Tokenizer

        assert manifest["vocab_size"] <= 300 and ids.max() < manifest["vocab_size"]
        assert len(ids) < len(text)  # merges learnt from the corpus
        bpe = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
        assert bpe.decode(ids[:5000].tolist()) == text.decode()[: len(bpe.decode(ids[:5000].tolist()))]

    dm.setup()
    x, y = dm.train_set[3]
    assert x.tolist() == ids[48:64].tolist() and y.tolist() == ids[49:65].tolist()
    assert len(dm.train_set) + len(dm.val_set) + len(dm.test_set) == sum(
        (s["tokens"] - 1) // 16 for s in manifest["shards"]
    )

    stamp = (tmp_path / "tok" / "manifest.json").stat().st_mtime_ns
    dm.prepare_data()  # up to date: nothing is redone
    assert (tmp_path / "tok" / "manifest.json").stat().st_mtime_ns == stamp
    (corpus / "part1.txt").write_text("changed")
    dm.prepare_data()
    assert json.loads((tmp_path / "tok" / "manifest.json").read_text())["key"] != manifest["key"]


@pytest.mark.slow
def test_preparation_killed_half_way_is_redone_not_used(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", 128 << 20)
    out = tmp_path / "tok"
    args = ["data=tokens", f"data.source={corpus}/*.txt", f"data.dir={out}", "data.shard_tokens=2097152"]
    # the real interpreter: the preparation's temporary directory is named by its pid, which a warm run's isn't
    cmd = [sys.executable, "-m", "mlproject.prepare", f"paths.log_dir={tmp_path}/logs", *args]
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=clean_env(), stdout=subprocess.DEVNULL)
    tmp = tmp_path / f"tok.tmp-{os.uname().nodename}-{proc.pid}"
    while not (tmp / "tokens-00002.bin").exists():  # a few shards written, far from the 64 of the corpus
        assert proc.poll() is None, "preparation ended before it could be killed"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # the half-made shards are not where training reads

    dm = TokensDataModule(dir=str(out), source=f"{corpus}/*.txt", shard_tokens=2097152)
    with pytest.raises(ConfigError, match="holds no preparation"):
        dm.setup()
    dm.prepare_data()  # what the next run (or mlproject.prepare) does
    assert json.loads((out / "manifest.json").read_text())["tokens"] == 128 << 20
    assert not tmp.exists()  # what the killed one left is removed


def test_a_preparation_finished_meanwhile_is_kept_not_replaced(tmp_path, monkeypatch):
    """Two jobs prepare one (shared) directory: the one that ends second keeps the first one's result, which a
    run may be reading already, instead of moving it aside for its own equal copy."""
    from mlproject.data.preparation import prepare

    out, key = tmp_path / "prepared", {"source": "same"}

    def build(by: str):
        def write(tmp: Path) -> dict:
            if by == "second":  # the other job (another pid: its own tmp) finishes while this one builds
                with monkeypatch.context() as m:
                    m.setattr(os, "getpid", lambda: 1)
                    prepare(out, key, build("first"))
            (tmp / "data.txt").write_text(by)
            return {"by": by}

        return write

    assert prepare(out, key, build("second"))["by"] == "first"
    assert (out / "data.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]  # the second's copy is gone


@pytest.mark.slow
def test_a_corpus_larger_than_memory_trains_within_a_memory_bound(tmp_path):
    """1 GiB of text -> 1 GiB of shards (bytes), prepared by the job itself; 2 ranks train a few steps and
    each one's peak resident memory stays under PEAK_RSS, which a copy of the corpus alone would exceed."""
    corpus = write_corpus(tmp_path / "corpus", 1 << 30)
    run(
        "train",
        *FAST,
        *TINY_GPT,
        *FEW_STEPS,
        "data=tokens",
        f"data.source={corpus}/*.txt",
        f"data.dir={tmp_path}/tok",
        "strategy=ddp",
        "trainer.devices=2",
        "data.batch_size=16",
        "+callbacks.mem._target_=tests.helpers.callbacks.PeakMemory",
        f"+callbacks.mem.dir={tmp_path}",
        log_dir=tmp_path / "logs",
        timeout=600,
    )
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    assert sum((tmp_path / "tok" / s["file"]).stat().st_size for s in manifest["shards"]) >= 1 << 30
    peaks = [int((tmp_path / f"rank{r}.rss").read_text()) for r in range(2)]
    print(f"peak resident memory per rank: {[f'{p / 2**20:.0f} MiB' for p in peaks]}")
    assert max(peaks) < PEAK_RSS, peaks


@pytest.mark.slow
def test_two_nodes_of_two_processes_prepare_once_per_node(tmp_path):
    """Each "node" has its own data.dir (node-local disk, named by NODE_RANK): its local rank 0 prepares
    while its local rank 1 waits, so 4 processes prepare twice, and every rank trains on complete data."""
    corpus = write_corpus(tmp_path / "corpus", 8 << 20)
    port, procs = str(free_port()), []
    for node in range(2):
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
        cmd = [
            PYTHON,
            "-m",
            "mlproject.train",
            f"paths.log_dir={tmp_path}/logs",
            *FAST,
            *TINY_GPT,
            *FEW_STEPS,
            "data=tokens",
            f"data.source={corpus}/*.txt",
            f"data.dir={tmp_path}/node" + "${oc.env:NODE_RANK}",
            "strategy=ddp",
            "trainer.devices=2",
            "trainer.num_nodes=2",
            "data.batch_size=16",
            "run_id=nodes",
        ]
        procs.append(subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=400)[0].decode() for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]
    lines = [ln for out in outputs for ln in out.splitlines() if "] preparing " in ln]
    assert len(lines) == 2 and "[rank 0]" in lines[0] + lines[1] and "[rank 2]" in lines[0] + lines[1], lines
    for node in range(2):
        assert json.loads((tmp_path / f"node{node}" / "manifest.json").read_text())["tokens"] == 8 << 20


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory) -> dict[str, Path]:
    """2 KiB of text in windows of 16 tokens: 90 train (5 steps of 16 per epoch, 2 epochs), 12 val, 25 test.
    A straight run on 1 process tests its best checkpoint, which `eval` then tests on 3 processes; meanwhile a
    run on 2 processes, killed at step 8 (its last checkpoint: step 6, one step into epoch 2; steps 6 and 7 are
    lost), resumes with ckpt_path=auto on 1 process. Every run records the samples of each step."""
    tmp = tmp_path_factory.mktemp("small")
    corpus = write_corpus(tmp / "corpus", 2048)
    datamodule(corpus, tmp / "tok").prepare_data()  # before the runs that read it start together
    setup = [
        *TINY_GPT,
        "model.scheduler.warmup_steps=2",
        "trainer.max_epochs=2",
        "data=tokens",
        f"data.source={corpus}/*.txt",
        f"data.dir={tmp}/tok",
        "data.block_size=16",
        "data.batch_size=16",
        "data.val_fraction=0.1",
        "data.test_fraction=0.2",
        "callbacks.last_checkpoint.every_n_train_steps=3",
    ]
    out = {name: tmp / name for name in ("straight", "eval", "killed", "seen", "before", "after")}

    def straight_then_eval():
        train(out["straight"], "straight", *setup, *record(out["seen"]), test=True)
        (best,) = run_dir(out["straight"], "straight").glob("checkpoints/epoch_*.ckpt")
        run("eval", f"ckpt_path={best}", *FAST, "strategy=ddp", "trainer.devices=3", log_dir=out["eval"])

    def killed_then_resumed():
        two = [*setup, "strategy=ddp", "trainer.devices=2", "ckpt_path=auto", *record(out["before"]), *kill_at(8)]
        assert train(out["killed"], "killed", *two, check=False).returncode != 0
        wait_until_gone(f"paths.log_dir={out['killed']}", 60)  # rank 1 kills itself too
        train(out["killed"], "killed", *setup, "ckpt_path=auto", *record(out["after"]))

    together(straight_then_eval, killed_then_resumed)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_windows_evaluate_exactly_on_3_processes(small_runs):
    """The 25 test windows do not divide by 3 (9, 8, 8 per rank, each padded to 9): 3 processes report
    what 1 process reported for the same checkpoint, every window counted once."""
    (one,), (three,) = run_dirs(small_runs["straight"]), run_dirs(small_runs["eval"], "eval")
    m1 = {k: v for k, v in read_metrics(one).items() if k.startswith("test/")}
    m3 = read_metrics(three)
    assert m1["test/samples"] == m3["test/samples"] == 25
    assert m1["test/acc"] == m3["test/acc"]
    assert m1["test/loss"] == pytest.approx(m3["test/loss"], rel=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_from_2_processes_on_1_reads_the_next_global_batch(small_runs):
    """The resumed process continues at the global data position of the 2 killed ones: from step 6 on it
    reads the straight run's batches, so each epoch's windows are read once over the two halves, and its
    final parameters are the straight run's up to reduction order (CLOSE)."""
    runs = small_runs
    assert_resumed_in_place(runs["seen"], runs["before"], runs["after"], at=(1, 6), batch=16)
    last = "checkpoints/last.ckpt"
    diff = assert_close_to(
        weights(run_dir(runs["straight"], "straight") / last), weights(run_dir(runs["killed"], "killed") / last)
    )
    print(f"max |param - straight run's| after resuming 2 -> 1 process: {diff:.1e}")


@pytest.mark.parametrize("data", ["text", "tokens"])
def test_k_folds_of_text_are_contiguous_stretches_in_text_order(data, tmp_path):
    from mlproject.data.text import TextDataModule
    from mlproject.data.tokens import TokensDataModule

    def make(folds, fold):
        if data == "text":
            return TextDataModule(folds=folds, fold=fold)
        dm = TokensDataModule(dir=str(tmp_path / "tokens"), folds=folds, fold=fold)
        dm.prepare_data()
        return dm

    def positions(d):  # a fold's windows by their place in train + val; a plain datamodule's: all of them
        if isinstance(d, torch.utils.data.Subset):
            return list(d.indices)
        return list(range(len(d.train_set) + len(d.val_set)))

    def windows(d):
        return [tuple(d[i][0].tolist()) for i in range(len(d))]

    folds = check_folds(make, positions, windows)
    plain = make(None, 0)
    plain.setup()
    text = windows(plain.train_set) + windows(plain.val_set)
    for dm in folds:
        held = dm.val_set.indices
        assert held == list(range(held[0], held[0] + len(held)))  # one stretch of text
        assert windows(dm.val_set) == text[held[0] : held[-1] + 1]
