"""Data made on disk before training (tokenized shards, image folders): once per node, atomically, and only
when it is missing or stale.

Lightning calls a DataModule's `prepare_data()` on local rank 0 of each node (or on global rank 0 only
where `prepare_data_per_node` is false: data on a filesystem all nodes share) while the other ranks wait
at the next barrier; `python -m mlproject.prepare` calls it alone, ahead of a job. A preparation is
written into a temporary sibling directory and renamed into place when complete, with its manifest
written last: a killed preparation leaves no manifest at `dir`, so it is never read, and the next run
redoes it (and removes what it left). A preparation whose files were damaged since (`damaged` says how) is
refused inside a run, where preparing again could outlast the other ranks' barrier, and prepared again
where `prepare_data()` is called alone (`python -m mlproject.prepare`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from mlproject.core.errors import ConfigError
from mlproject.utils.rank_logging import get_logger

log = get_logger(__name__)
MANIFEST = "manifest.json"


def read_manifest(dir: str | Path) -> dict | None:
    path = Path(dir) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def prepare(
    dir: str | Path,
    key: dict,
    build: Callable[[Path], dict],
    damaged: Callable[[Path, dict], str | None] = lambda dir, manifest: None,
    repair: bool = False,
) -> dict:
    """The manifest of `dir`, made by `build(tmp_dir)` unless `dir` already holds a manifest for `key`.

    `key` describes the inputs and settings (JSON); `build` writes the data into the directory it is given
    and returns what the manifest records about it (counts, checksums). `damaged(dir, manifest)` says what is
    wrong with an up-to-date preparation's files (None: nothing): it is refused, or with `repair` made again.
    """
    dir = Path(dir)
    manifest = read_manifest(dir)
    problem = None
    if manifest is not None and manifest["key"] == key:
        if (problem := damaged(dir, manifest)) is None:
            return manifest
        if not repair:
            raise ConfigError(
                f"{problem}: data.dir={dir} is damaged; prepare it again with `make prepare` and this run's data "
                "settings"
            )
    if manifest is None and dir.is_dir() and any(dir.iterdir()):  # never replace what a preparation did not make
        raise ConfigError(f"data.dir={dir} holds files that no preparation made; give an empty or new directory")
    _remove_abandoned(dir)
    tmp = dir.with_name(f"{dir.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    old = dir.with_name(f"{tmp.name}.old")
    if problem:  # aside at once: a damaged preparation must not pass for another job's finished one below
        os.rename(dir, old)
    why = problem or ("stale manifest" if manifest else "none there yet")
    log.info(f"preparing {dir} ({why})", all_ranks=True)
    start = time.monotonic()
    manifest = {"key": key, **build(tmp)}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    done = read_manifest(dir)
    if done is not None and done["key"] == key:  # another job prepared the same directory meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)  # (moving it aside could pull it from under a reader)
        shutil.rmtree(old, ignore_errors=True)  # the damaged one, if it was moved aside
        return done
    if dir.exists():  # stale: moved aside, then removed once the new one is in place
        os.rename(dir, old)
    try:
        os.rename(tmp, dir)
    except OSError:  # another preparer of the same (shared) directory finished first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
        return prepare(dir, key, build, damaged, repair)
    shutil.rmtree(old, ignore_errors=True)
    log.info(f"prepared {dir} in {time.monotonic() - start:.1f} s", all_ranks=True)
    return manifest


def _remove_abandoned(dir: Path) -> None:
    """Temporary directories of preparations on this host whose process is gone (killed half-way)."""
    host = socket.gethostname()
    for path in dir.parent.glob(f"{dir.name}.tmp-{host}-*"):
        pid = path.name.removeprefix(f"{dir.name}.tmp-{host}-").removesuffix(".old")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                shutil.rmtree(path)
