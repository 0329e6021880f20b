"""A DeepSpeed ZeRO checkpoint read by parameter and element range, so that reading a slice touches only it.

Each rank of a ZeRO run saves flat fp32 partitions and the torch optimizer's state (AdamW's moments) over
them, in the same layout. Stage 1/2 lay a param group's parameters end to end and cut the result into one
partition per rank; each rank lists which slice of which parameter it holds (`param_slice_mappings`). Stage 3
cuts every parameter into one equal piece per rank (the last one padded) and lays a rank's pieces end to end
over its flat sub-groups, in the order of `param_shapes`. The partition files are loaded onto the meta device,
which gives each tensor's offset in its file, and slices are read from there (not memory-mapped: the kernel
maps whole page-cache folios around each read, up to 3 times the slice here). So a rank that resumes on
another layout (distributed/zero.py) or under fsdp (distributed/parallel.py) reads only the slices it will hold,
and a full conversion (convert.load_full) holds no more than the result; DeepSpeed's zero_to_fp32 concatenates
whole partitions. `read_into` reads any torch.save file that way (a single process's checkpoint under fsdp).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import NamedTuple

import torch

from mlproject.checkpoint.safe_load import allow_deepspeed_types, load_file
from mlproject.utils import compat

PREFIX = "_forward_module."  # Lightning's wrapper around the LightningModule, in DeepSpeed's parameter names


class Piece(NamedTuple):
    """Elements [start, start + numel) of a flattened parameter, at `offset` in `rank`'s flat `group`."""

    rank: int
    group: int
    offset: int
    start: int
    numel: int


def load_meta(file: str | Path) -> dict:
    """A torch.save file with its tensors on the meta device, each knowing its offset in the file."""
    return load_file(file, map_location="meta")


def read_into(out: torch.Tensor, file: str | Path, saved: torch.Tensor, start: int) -> None:
    """Elements [start, start + out.numel()) of the flattened meta tensor `saved` (load_meta) from `file`."""
    buffer = out if saved.dtype == out.dtype else torch.empty(out.numel(), dtype=saved.dtype)
    offset = compat.file_offset(saved) + (saved.storage_offset() + start) * saved.element_size()
    view, done = buffer.numpy().view("uint8"), 0
    with open(file, "rb") as f:
        while done < view.size:  # one read returns at most ~2 GiB
            done += os.preadv(f.fileno(), [view[done:]], offset + done)
    if buffer is not out:
        out.copy_(buffer)


class ZeroShards:
    def __init__(self, path: str | Path):
        from deepspeed.utils.zero_to_fp32 import get_model_state_files, get_optim_files

        allow_deepspeed_types()
        ds_dir = Path(path) / (Path(path) / "latest").read_text().strip()
        self.files = get_optim_files(ds_dir)  # one per rank, in rank order
        self.ranks = [load_meta(file)["optimizer_state_dict"] for file in self.files]
        # Lightning keeps the client state (loops, callbacks, hyperparameters) in the first model-states file;
        # stage 1/2 also keep the full weights there, of which only the buffers are read (memory-mapped)
        self.client = load_file(get_model_state_files(ds_dir)[0], map_location="cpu", mmap=True)
        self.zero3 = self.ranks[0]["zero_stage"] == 3
        self.fp32_key, self.optim_key = (
            ("fp32_flat_groups", "optimizer_state_dict")
            if self.zero3
            else ("single_partition_of_fp32_groups", "base_optimizer_state")
        )
        # one dict (name -> shape) per flat group of the torch optimizer, in the writer's order
        self.groups = [{k.removeprefix(PREFIX): v for k, v in g.items()} for g in self.client["param_shapes"]]
        self.shapes = {name: shape for group in self.groups for name, shape in group.items()}
        shared = self.client["shared_params"].items()  # tied weights, saved once under the name they alias
        self.aliases = {alias.removeprefix(PREFIX): name.removeprefix(PREFIX) for alias, name in shared}
        self.pieces: dict[str, list[Piece]] = {name: [] for name in self.shapes}
        (self._zero3_pieces if self.zero3 else self._zero12_pieces)()

    def _zero12_pieces(self) -> None:
        for rank, saved in enumerate(self.ranks):  # in rank order, so each parameter's slices in order
            for group, slices in enumerate(saved["param_slice_mappings"]):
                for name, address in slices.items():
                    pieces = self.pieces[name.removeprefix(PREFIX)]
                    start = pieces[-1].start + pieces[-1].numel if pieces else 0
                    pieces.append(Piece(rank, group, address.start, start, address.numel))

    def _zero3_pieces(self) -> None:
        world = len(self.ranks)
        bounds = [0]  # where each flat sub-group starts in a rank's pieces laid end to end (equal on every rank)
        for flat in self.ranks[0][self.fp32_key]:
            bounds.append(bounds[-1] + flat.numel())
        offset = 0
        for name, shape in self.shapes.items():
            numel = math.prod(shape)
            size = math.ceil(numel / world)
            for rank in range(world):
                start, end = rank * size, min((rank + 1) * size, numel)
                at = offset
                while start < end:  # a piece may run over the end of a sub-group into the next one
                    group = next(g for g in range(len(bounds) - 1) if bounds[g] <= at < bounds[g + 1])
                    take = min(end - start, bounds[group + 1] - at)
                    self.pieces[name].append(Piece(rank, group, at - bounds[group], start, take))
                    start, at = start + take, at + take
            offset += size

    def _flat(self, rank: int, group: int, key: str | None) -> torch.Tensor:
        saved = self.ranks[rank]
        return saved[self.fp32_key][group] if key is None else saved[self.optim_key]["state"][group][key]

    def read(self, name: str, key: str | None = None, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start + numel) of the flattened fp32 weights of `name` (`key` None) or of its
        optimizer state `key` (e.g. 'exp_avg'), as a new tensor."""
        name = self.aliases.get(name, name)
        numel = math.prod(self.shapes[name]) - start if numel is None else numel
        out = torch.empty(numel, dtype=torch.float32)
        for piece in self.pieces[name]:
            lo, hi = max(start, piece.start), min(start + numel, piece.start + piece.numel)
            if lo < hi:
                flat = self._flat(piece.rank, piece.group, key)
                read_into(out[lo - start : hi - start], self.files[piece.rank], flat, piece.offset + lo - piece.start)
        return out

    def full(self, name: str, key: str | None = None) -> torch.Tensor:
        return self.read(name, key).view(self.shapes[name])

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers (in fp32 where floating point, as zero_to_fp32 gives them)."""
        names, module = set(self.client["buffer_names"]), self.client["module"]
        return {
            k.removeprefix(PREFIX): v.float() if v.is_floating_point() else v for k, v in module.items() if k in names
        }

    @property
    def optimizer(self) -> dict:
        """The torch optimizer's param groups (hyperparameters; `params` are its flat groups) and state (per flat
        group: the step count, read, and the moments over the partition, on the meta device) as rank 0 saved
        them."""
        saved = self.ranks[0][self.optim_key]
        state = {}
        for group, entry in saved["state"].items():
            step = torch.empty(entry["step"].shape, dtype=entry["step"].dtype)
            read_into(step.view(-1), self.files[0], entry["step"], 0)
            state[group] = {**entry, "step": step}
        return {**saved, "state": state}
