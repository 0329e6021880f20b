"""A torch.distributed.checkpoint directory (fsdp, hsdp, ...: Lightning's ModelParallelStrategy saves
"state_dict" and "optimizer_0" keyed by parameter name, plus the rest in meta.pt) read by parameter and element
range in one process, so that a rank of another strategy reads only the stored chunks that overlap what it will
hold: DCP's own resharding (create_read_items_for_chunk_list) for the rows that cover the range.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, load
from torch.distributed.checkpoint.planner import LoadPlan


class _Reader(FileSystemReader):
    """Reads the metadata once: DCP's load reads it again on every call (most of a small read's time)."""

    def read_metadata(self):
        if not hasattr(self, "metadata"):
            self.metadata = super().read_metadata()
        return self.metadata


class _Rows(DefaultLoadPlanner):
    """Plans the reads of one stored tensor's rows into a tensor of their own (DCP reshards by global offsets)."""

    def __init__(self, fqn: str, chunk):
        super().__init__()
        self.fqn, self.chunk = fqn, chunk

    def create_local_plan(self) -> LoadPlan:
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        return LoadPlan(
            create_read_items_for_chunk_list(self.fqn, self.metadata.state_dict_metadata[self.fqn], [self.chunk])
        )

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # the rows themselves, not a shard found by offset


class DcpShards:
    def __init__(self, path: str | Path):
        from mlproject.checkpoint.convert import check_unpickles, load_file
        from mlproject.utils import compat

        check_unpickles(path)  # DCP unpickles .metadata and the small items below in full
        self.path = Path(path)
        self.reader = _Reader(self.path)
        self.metadata = self.reader.read_metadata()
        self.fqns = {tuple(keys): fqn for fqn, keys in self.metadata.planner_data.items()}  # nested path -> key
        state = [keys for keys in self.fqns if keys[:2] == ("optimizer_0", "state")]
        self.params = {keys[2] for keys in state}
        self.keys = sorted({keys[3] for keys in state} - {"step"})  # AdamW's moments
        # all but the parameters and their moments: buffers, step counts, param groups (small)
        small = {fqn for keys, fqn in self.fqns.items() if not self._sliced(keys)}
        loaded: dict = {}  # filled from the metadata by the planner (dcp.load would fill a copy)
        compat.load_whole_dcp(loaded, self.reader, keys=small)
        self.buffers = loaded.get("state_dict", {})
        saved = loaded.get("optimizer_0", {"state": {}, "param_groups": []})
        shapes = {name: self.metadata.state_dict_metadata[self.fqns["state_dict", name]].size for name in self.params}
        meta = {name: {key: torch.empty(shapes[name], device="meta") for key in self.keys} for name in self.params}
        # the param groups' hyperparameters and per parameter its step count (its moments are read by `read`)
        self.optimizer = {
            "state": {name: {**entry, **meta[name]} for name, entry in saved.get("state", {}).items()},
            "param_groups": saved["param_groups"],
        }
        self.client = load_file(self.path / "meta.pt")  # loops, callbacks, schedulers...

    def _sliced(self, keys: tuple) -> bool:
        if keys[0] == "state_dict":
            return keys[1] in self.params
        return keys[:2] == ("optimizer_0", "state") and keys[3] != "step"

    def read(self, name: str, key: str | None = None, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start + numel) of the flattened weights of `name` (`key` None) or of its optimizer
        state `key` (e.g. 'exp_avg'), as a new tensor: only the stored chunks that hold the rows covering them
        are read."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        fqn = self.fqns[("state_dict", name) if key is None else ("optimizer_0", "state", name, key)]
        stored = self.metadata.state_dict_metadata[fqn]
        shape = stored.size
        numel = math.prod(shape) - start if numel is None else numel
        row = math.prod(shape[1:])
        first, end = (start // row, -(-(start + numel) // row)) if shape else (0, 1)
        rows = torch.empty((end - first, *shape[1:]) if shape else (), dtype=stored.properties.dtype)
        offsets = (first, *[0] * (len(shape) - 1)) if shape else ()
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=rows.shape)
        load({fqn: rows}, storage_reader=self.reader, planner=_Rows(fqn, chunk), no_dist=True)
        return rows.view(-1).narrow(0, start - first * row, numel)
