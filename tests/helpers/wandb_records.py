"""Read an offline W&B run's `.wandb` file: W&B's own protobuf records, in the LevelDB log framing its
(since removed) Python reader `wandb.sdk.internal.datastore` read."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768  # records never cross a block's header; a block's tail shorter than a header is padding
HEADER = 7  # checksum (4 bytes), length (2), type (1); the file starts with a header of its own, b":W&B" ...
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
