"""mlproject/utils/compat.py holds every use of another library's private names; each still works as relied on.

An upgrade that renames or changes one fails here, not in the middle of a run. The behaviour each entry
serves is proven end to end elsewhere (resume, resharding, strategy and MoE tests); here, its private name.
"""

from __future__ import annotations

import importlib
import inspect
import io
import pkgutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mlproject
from mlproject.utils import compat

SRC = Path(mlproject.__file__).parent.parent
# Public names that look private: Hydra's config key and the documented os._exit.
PUBLIC = {"_target_", "_exit"}
# Protected hooks of documented classes that our subclasses override (class -> hooks). A hook renamed
# upstream would silently stop being called: each must still exist on a base outside this package.
OVERRIDES = {
    "mlproject.checkpoint.storage.ModelCheckpoint": {
        "_monitor_candidates",  # NaN for the monitored metric until the first validation
        "_save_checkpoint",  # written under <name>.tmp and renamed into place
        # feature: object_storage
        "_should_remove_checkpoint",  # keeps the checkpoint a run resumed from in object storage
        # /feature: object_storage
    },
    "mlproject.distributed.syncbn.CPUSyncBatchNorm": {"_check_input_dim"},  # any input rank
    "mlproject.loggers.csv_logs._AppendingWriter": {"_check_log_dir_exists", "_record_new_keys"},  # appends
}
# Set on every class by a metaclass (ABCMeta, autograd.Function's), not overrides of ours.
METACLASS = {"_abc_impl", "_backward_cls"}


def private_uses(path: Path) -> list[str]:
    """`x._name` in code (not in strings or comments) where x is not self, cls or super(), and `_name` imported
    from a module outside the package."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline) if t.type != tokenize.COMMENT]
    found, importing_from = [], None
    for before, dot, name in zip(tokens, tokens[1:], tokens[2:], strict=False):
        if before.string == "from":
            importing_from = dot.string  # the module's first name
        elif before.type == tokenize.NEWLINE:
            importing_from = None
        private = name.type == tokenize.NAME and name.string.startswith("_") and not name.string.startswith("__")
        if not private or name.string in PUBLIC:
            continue
        if dot.string == "." and before.string not in ("self", "cls", ")"):  # ")": super()._hook (OVERRIDES)
            found.append(f"{path.relative_to(SRC)}:{name.start[0]}: .{name.string}")
        elif dot.string in ("import", ",") and importing_from not in (None, "mlproject", "hydra_plugins"):
            found.append(f"{path.relative_to(SRC)}:{name.start[0]}: import {name.string}")
    return found


def test_private_names_are_used_only_in_compat():
    files = [p for p in sorted(SRC.rglob("*.py")) if p.name != "compat.py" and "egg-info" not in str(p)]
    found = [use for path in files for use in private_uses(path)]
    assert not found, "another library's private name outside mlproject/utils/compat.py (move it there):\n" + "\n".join(
        found
    )


def test_overridden_hooks_still_exist_upstream():
    modules = [importlib.import_module(m.name) for m in pkgutil.walk_packages(mlproject.__path__, "mlproject.")]
    overrides = {}
    for module in modules:
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            foreign = [b for b in cls.__mro__[1:] if not b.__module__.startswith(("mlproject", "builtins"))]
            hooks = {
                name
                for name in vars(cls)
                if name.startswith("_")
                and not name.startswith("__")
                and name not in METACLASS
                and any(hasattr(b, name) for b in foreign)
            }
            if hooks:
                overrides[f"{cls.__module__}.{cls.__qualname__}"] = hooks
    assert overrides == OVERRIDES


def test_exit_now_runs_the_exit_hooks_and_skips_teardown():
    code = (
        "import atexit, sys; from mlproject.utils import compat\n"
        "atexit.register(lambda: print('hook ran'))\n"
        "class Loud:\n    def __del__(self): print('teardown ran')\n"
        "keep = Loud(); print('before', flush=False); compat.exit_now(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout.split("\n")) == (3, ["before", "hook ran", ""]), out.stderr


@pytest.fixture
def fake_world():
    """8 ranks whose collectives move no data: torch's fake backend, which only its testing module registers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fake_process_group_and_mesh_algebra(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    assert (dist.get_world_size(), dist.get_rank()) == (8, 1)
    root = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    flat = compat.mesh_flatten(root, "data_parallel")
    assert (flat.mesh_dim_names, flat.size()) == (("data_parallel",), 8)
    # feature: expert
    split = compat.mesh_unflatten(root, 1, (2, 2), ("expert_shard", "expert_parallel"))
    assert split.mesh_dim_names == ("replicate", "expert_shard", "expert_parallel")
    assert tuple(split.shape) == (2, 2, 2)
    # /feature: expert
    # rank 1 holds rows 3..5 of 10 split over the 4 ranks of `shard` (chunks of 3, 3, 3, 1)
    assert compat.local_shape_and_offset((10, 3), root["shard"], [Shard(0)]) == ((3, 3), (3, 0))


# feature: planner
def test_fake_process_group():
    compat.fake_process_group(world_size=8, rank=1)
    try:
        assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("fake", 8, 1)
    finally:
        dist.destroy_process_group()


def test_view_base():
    t = torch.empty(4, 4, device="meta")
    assert compat.view_base(t[1:]) is t and compat.view_base(t) is t and compat.view_base(t.t()) is t


# /feature: planner
def test_activation_checkpoint_keeps_names_and_gradients():
    torch.manual_seed(0)
    plain, recomputed = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    recomputed.load_state_dict(plain.state_dict())
    compat.activation_checkpoint(recomputed[0])
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    recomputed(x).sum().backward()
    assert torch.equal(plain[0].weight.grad, recomputed[0].weight.grad)


def test_file_offset_points_at_the_tensor_bytes(tmp_path):
    data = torch.arange(10, dtype=torch.float32)
    torch.save({"a": torch.zeros(3), "b": data}, tmp_path / "f.pt")
    saved = torch.load(tmp_path / "f.pt", map_location="meta", weights_only=True)["b"]
    with open(tmp_path / "f.pt", "rb") as f:
        f.seek(compat.file_offset(saved) + 4 * 4)
        assert torch.frombuffer(bytearray(f.read(4 * 6)), dtype=torch.float32).tolist() == data[4:].tolist()


def test_ddp_ignore_reaches_ddp():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        module = nn.Linear(2, 2)
        module.register_buffer("avg", torch.zeros(2))
        compat.ddp_ignore(module, ["avg"])
        compat.ddp_ignore(module, ["bias"])
        ddp = nn.parallel.DistributedDataParallel(module)
        assert set(ddp.parameters_to_ignore) == {"avg", "bias"}
    finally:
        dist.destroy_process_group()


def test_cuda_memory_recorder_signatures():
    assert {"enabled", "max_entries"} <= set(inspect.signature(torch.cuda.memory._record_memory_history).parameters)
    assert "filename" in inspect.signature(torch.cuda.memory._dump_snapshot).parameters


def test_set_update_count_restores_a_metric():
    from torchmetrics import MeanMetric

    saved = MeanMetric()
    saved.update(torch.tensor([1.0, 2.0]))
    saved.update(torch.tensor([6.0]))
    restored = MeanMetric()
    restored.update(torch.tensor([100.0]))
    restored.compute()  # cached: the restore must drop it
    for name, value in saved.metric_state.items():
        setattr(restored, name, value.clone())
    compat.set_update_count(restored, saved.update_count)
    assert restored.update_count == 2 and restored.compute().item() == 3.0


def test_lightning_loop_and_signal_internals():
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert compat.validated_yet(trainer) is False
    assert compat.reload_loader_position(trainer) is False  # nothing saved to load
    assert callable(trainer.fit_loop._load_combined_loader_states) and hasattr(trainer.fit_loop, "_data_fetcher")
    notes = []
    assert callable(trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor)
    assert hasattr(trainer._signal_connector, "_sigterm_notifier_fn")
    compat.quiet_sigterm(trainer, lambda *a: notes.append(a))
    trainer._signal_connector._sigterm_notifier_fn(15, None)
    assert notes == [(15, None)] and trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None


# feature: deepspeed
def test_deepspeed_internals():
    pytest.importorskip("deepspeed", reason="strategy=deepspeed_* needs DeepSpeed (the deepspeed extra)")
    code = (
        "import importlib; t = importlib.import_module('deepspeed.comm.torch')  # deepspeed.comm.torch is torch\n"
        "from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z\n"
        "from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z3\n"
        "from deepspeed.utils.tensor_fragment import tensor_fragment as F\n"
        "from mlproject.utils import compat\n"
        "with compat.no_shm_allreduce():\n    assert t.build_shm_op() is None\n"
        "assert t.build_shm_op.__name__ == 'build_shm_op'\n"  # restored after the block
        "assert callable(Z._lazy_init_hp_params_optimizer_state)\n"
        "assert 'optim_state_key' in __import__('inspect').signature(Z3._get_fp32_opt_state_partition).parameters\n"
        "assert callable(Z3._get_param_partition_rank) and callable(Z3._reassign_or_swap_out_partitioned_parameters)\n"
        "assert callable(F.get_hp_fragment) and 'lp_fragment_address' in F.__dataclass_fields__\n"
    )
    # its own process: importing DeepSpeed probes the accelerator, which other tests' forks should not inherit
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


# /feature: deepspeed
