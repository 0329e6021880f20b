"""A DeepSpeed ZeRO checkpoint read by parameter and element range, so that reading a slice touches only it.

Each rank of a ZeRO run saves flat fp32 partitions and the torch optimizer's state (AdamW's moments) over
them, in the same layout. Stage 1/2 lay a param group's parameters end to end and cut the result into one
partition per rank; each rank lists which slice of which parameter it holds (`param_slice_mappings`). Stage 3
cuts every parameter into one equal piece per rank (the last one padded) and lays a rank's pieces end to end
over its flat sub-groups, in the order of `param_shapes`. The partition files are loaded onto the meta device,
which gives each tensor's offset in its file, and slices are read from there (safe_load.read_into). So a rank
that resumes on another layout (distributed/zero.py) or under fsdp (distributed/parallel.py) reads only the
slices it will hold, and a full conversion (convert.load_full) holds no more than the result; DeepSpeed's
zero_to_fp32 concatenates whole partitions.

Everything that reads a DeepSpeed directory is here, so a project without DeepSpeed leaves this file out
(checkpoint/convert.py and distributed/parallel.py call it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import torch

from mlproject.checkpoint.safe_load import load_file, load_meta, read_into

PREFIX = "_forward_module."  # Lightning's wrapper around the LightningModule, in DeepSpeed's parameter names


class Piece(NamedTuple):
    """Elements [start, start + numel) of a flattened parameter, at `offset` in `rank`'s flat `group`."""

    rank: int
    group: int
    offset: int
    start: int
    numel: int


def allow_deepspeed_types() -> None:
    """DeepSpeed's optimizer-state files pickle four of its own types (ZeRO 1-3; DynamicLossScaler under fp16):
    plain records of numbers, allowed in weights-only loads (load_file)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    torch.serialization.add_safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address])


def check_unpickles(path: str | Path) -> None:
    """Refuse the DeepSpeed directory at `path` if a file its engine unpickles in full holds more than a
    weights-only load allows (for convert.check_unpickles). Tensor data is not read."""
    allow_deepspeed_types()
    tag = Path(path) / (Path(path) / "latest").read_text().strip()
    for file in sorted(tag.glob("*.pt")):
        load_file(file, map_location="meta")


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


def deepspeed_checkpoint(shards: ZeroShards, full: bool = True) -> dict[str, Any]:
    """A Lightning checkpoint from ZeRO shards: weights and optimizer state from the shards, the rest from
    Lightning's client state. The torch optimizer DeepSpeed wrapped has one param group per flat group: its
    positions run over the parameters of each flat group in order, the order of the writer's param groups. With
    `full` False the weights and moments are placeholders on the meta device, for the caller to read by slice
    (`shards.read`); the buffers and step counts are read."""

    def tensor(name: str, key: str | None = None) -> torch.Tensor:
        return shards.full(name, key) if full else torch.empty(shards.shapes[name], device="meta")

    optim = shards.optimizer
    keys = [key for key in next(iter(optim["state"].values()), {}) if key != "step"]
    state, groups, position = {}, [], 0
    for group in optim["param_groups"]:
        params = []
        for i in group["params"]:  # a flat group
            for name in shards.groups[i]:
                if i in optim["state"]:
                    step = optim["state"][i]["step"].clone()  # one tensor per parameter: AdamW increments each
                    state[position] = {"step": step, **{key: tensor(name, key) for key in keys}}
                params.append(position)
                position += 1
        groups.append({**group, "params": params})

    checkpoint = {k: v for k, v in shards.client.items() if k not in ("module", "optimizer", "lr_scheduler")}
    state_dict = {**shards.buffers, **{name: tensor(name) for name in shards.shapes}}
    for alias, name in shards.aliases.items():  # tied weights are saved once
        state_dict[alias] = state_dict[name]
    checkpoint["state_dict"] = state_dict
    checkpoint["optimizer_states"] = [{"state": state, "param_groups": groups}]
    return checkpoint
