"""Plan before you queue: `python -m mlproject.plan [overrides]` (`make plan ARGS=...`).

For the composed train config, each candidate layout is dry-run as it would train: the model is built on the
meta device (no memory, no weights), sharded by its own configure_model on a fake process group of the job's
world size (torch's "fake" backend: collectives return at once, so 512 ranks take seconds), and given one
AdamW step so the optimizer state exists. What one rank then holds is counted the way the footprint line
counts it in a real run. The cheapest layout that fits the device memory is recommended, in the order
`candidates` tries them: the cheapest in communication first, the most frugal in memory last.
"""

from __future__ import annotations

import math
import sys
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from types import SimpleNamespace

from omegaconf import DictConfig

from mlproject.build import meta_model, meta_network
from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology

GiB = 2**30
# A layout fits when its estimate stays under this share of the device: the CUDA context, the allocator's
# caches and transient buffers (FSDP's all-gathered block, DDP's buckets in flight) need the rest.
HEADROOM = 0.9
NO_FIT = "raise trainer.accumulate_grad_batches (smaller micro-batches, same global batch) or use more GPUs"


@dataclass(frozen=True)
class Row:
    """What one rank of one layout holds, in bytes."""

    layout: str  # the strategy overrides, e.g. "strategy=fsdp"
    states: int  # parameters + gradients + optimizer state + EMA weights
    activations: int | None  # None: the batch size is unknown (a datamodule's own loaders set it); not counted
    # feature: deepspeed
    # the three below None under DeepSpeed: its estimators give the model states as one sum
    # /feature: deepspeed
    params: int | None = None
    grads: int | None = None
    optimizer: int | None = None
    ema: int = 0  # callbacks.ema: one more copy of the trainable parameters, sharded like them
    gathered: int = 0  # FSDP's largest unit all-gathered, whole, in the dtype it computes in

    @property
    def total(self) -> int:
        return self.states + self.gathered + (self.activations or 0)


@contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A process group of `world_size` ranks in which this process is `rank` and no collective moves data."""
    import torch.distributed as dist

    from mlproject.utils import compat

    compat.fake_process_group(world_size, rank)
    try:
        yield
    finally:
        dist.destroy_process_group()


# the mesh dimensions FSDP shards over (named_meshes)
SHARD_DIMS = ("shard",)
# feature: expert
SHARD_DIMS += ("expert_shard",)
# /feature: expert


def model_states(cfg: DictConfig, topology: Topology) -> tuple[int, int, int, int, int]:
    """(parameter, gradient, optimizer-state, EMA, gathered) bytes on this rank under a torch strategy (single, ddp
    or one of topology.MODEL_PARALLEL): DDP replicates, model-parallel layouts run the model's configure_model
    on the target mesh with the FSDP settings training applies (bf16-mixed: bf16 gathers). Sharded parameters,
    gradients and AdamW's moments stay in the stored dtype (fp32 under mixed precision: FSDP's master weights)."""
    # feature: pipeline
    # under pp: this rank's stages only, each sharded over its stage's ranks
    # /feature: pipeline
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from mlproject.distributed.parallel import configure_then_shard, local_bytes, named_meshes

    model, gathered = meta_model(cfg), 0
    if topology.model_parallel:
        # configure_model asks the trainer for its strategy and the strategy for its meshes, nothing more
        strategy = instantiate(cfg.strategy)
        strategy.meshes = named_meshes(topology, "cpu")
        precision = str(cfg.trainer.precision)
        if precision.endswith("-mixed"):  # what fsdp_settings reads (Lightning's plugin for this precision)
            strategy.precision_plugin = MixedPrecision(precision, "cpu")
        model.trainer = SimpleNamespace(strategy=strategy)
        configure_then_shard(model, model.configure_model if is_overridden("configure_model", model) else None)
        gathered = gathered_bytes(model, strategy.fsdp_settings)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)  # gradients are shaped and sharded like their parameters
    optimizer = torch.optim.AdamW(params)  # both models' optimizer: two moments per parameter, a step count per tensor
    optimizer.step()  # Adam creates its state at the first step
    state = (v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    ema = local_bytes(params) if ema_configured(cfg) else 0  # callbacks/ema.py clones each trainable parameter
    return local_bytes(model.parameters()), local_bytes(p.grad for p in params), local_bytes(state), ema, gathered


def gathered_bytes(model, fsdp: dict | None) -> int:
    """Bytes of the largest FSDP unit's parameters all-gathered (a unit: a module fully_shard was applied to, with
    the parameters of no unit inside it): a rank holds them whole while the unit runs, in the dtype FSDP gathers in
    (`param_dtype`, else as stored), rows padded to a multiple of the shard group as FSDP2 pads them. 0 without
    FSDP. Under TP a gather makes the TP shard whole, no more."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    if fsdp is None:
        return 0
    dtype = getattr(torch, fsdp["param_dtype"]) if fsdp.get("param_dtype") else None
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # feature: pipeline
    if (pipeline := getattr(model, "pipeline", None)) is not None:  # its stage views: FSDP units outside model
        units += [m for m in pipeline.views.values() if isinstance(m, FSDPModule)]
    # /feature: pipeline

    def whole(p) -> int:  # FSDP made p a DTensor; its shard dimensions carry named_meshes' names
        mesh = p.device_mesh
        ranks = math.prod(mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names) if name in SHARD_DIMS)
        return p.to_local().numel() * ranks * (dtype or p.dtype).itemsize  # rank 0's shard, the largest, x ranks

    largest = 0
    for unit in units:
        inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
        own = {id(p): p for p in unit.parameters() if id(p) not in inner}
        largest = max(largest, sum(whole(p) for p in own.values()))
    return largest


def ema_configured(cfg: DictConfig) -> bool:
    return "ema" in (cfg.get("callbacks") or {})


# feature: pipeline
def stage_modules(net, pipeline: dict, rank: int, size: int, schedule: str) -> list:
    """The modules pipeline rank `rank` runs: its stages' blocks, and the `first` and `last` modules where it
    holds the first or the last stage (the views of distributed/pipeline.py, leaving `net` whole)."""
    from mlproject.distributed.pipeline import stage_view, stages_per_rank

    num_stages = size * stages_per_rank(schedule)
    views = [stage_view(net, s, num_stages, **pipeline) for s in range(rank, num_stages, size)]
    ends = (*pipeline.get("first", ()), *pipeline.get("last", ()))
    modules = []
    for view in views:
        modules += [*getattr(view, pipeline["layers"]).values(), *(getattr(view, name) for name in ends)]
    return [m for m in modules if m is not None]


# /feature: pipeline
def activation_bytes(cfg: DictConfig, topology: Topology) -> int | None:
    """Bytes autograd saves for backward in one training step of one per-device micro-batch: the model's own
    training_step runs on the meta device with TP and activation checkpointing applied as configured (FSDP
    does not change them), under a hook that sums every tensor saved for backward.

    None where the batch size is unknown: the datamodule is not the template's, and its own loaders set it."""
    import collections

    import torch
    from hydra.utils import instantiate
    from torchmetrics import Metric

    from mlproject.distributed.parallel import apply_ac, named_meshes
    from mlproject.utils import compat

    if topology.per_device_batch_size is None:
        return None
    model = meta_model(cfg)
    plan, fsdp = cfg.model.get("parallel") or {}, (cfg.strategy.get("fsdp") or {}) if topology.model_parallel else {}
    tp, pp = 1, 1
    # feature: tensor
    tp = topology.tensor_parallel_size
    # /feature: tensor
    # feature: pipeline
    pp = topology.pipeline_parallel_size
    # /feature: pipeline
    meshes = named_meshes(topology, "cpu") if tp > 1 or pp > 1 else {}
    # feature: tensor
    if tp > 1:
        from mlproject.distributed.parallel import apply_tp

        apply_tp(model, meshes["tensor_parallel"], plan.blocks, plan.colwise, plan.rowwise)
    # /feature: tensor
    if fsdp.get("activation_checkpointing"):
        apply_ac(model, plan.get("blocks", []))
    for metric in model.modules():  # metrics save nothing for backward, and bincount has no meta kernel
        if isinstance(metric, Metric):
            metric.update = lambda *args, **kwargs: None
    batch, copies, rank = topology.per_device_batch_size, 1.0, 0
    inside = collections.Counter()  # forwards under way of this rank's stage modules and of the whole network
    # feature: pipeline
    # Under pipeline parallelism a rank runs its stages only, on micro-batches of per-device batch / M, and holds
    # several at once: the whole network's training_step runs on one micro-batch, the hook counts only what is
    # saved while this rank's stage modules run (and the loss, outside the network, on the last stage), and that
    # is multiplied by the stage forwards the schedule keeps in flight at its peak (pipeline.in_flight: GPipe M,
    # 1F1B P - rank), divided by the stages per rank (interleaved: a forward runs one of its two stages, taken
    # as half of both).
    if pp > 1:
        from mlproject.distributed.pipeline import in_flight, stages_per_rank

        schedule, microbatches = cfg.strategy.pipeline.schedule, cfg.strategy.pipeline.microbatches
        rank = meshes["pipeline"].get_local_rank()
        batch //= microbatches
        copies = in_flight(schedule, pp, microbatches, rank) / stages_per_rank(schedule)
        stages = stage_modules(model.net, dict(plan.pipeline), rank, pp, schedule)
        for key, modules in (("stage", stages), ("net", [model.net])):
            for m in modules:
                m.register_forward_pre_hook(lambda *_, key=key: inside.update([key]))
                m.register_forward_hook(lambda *_, key=key: inside.subtract([key]))
    # /feature: pipeline
    data = instantiate(cfg.data)
    x, y = data.splits()[0][0]
    x, y = (torch.as_tensor(t) for t in (x, y))
    x, y = (torch.empty((batch, *t.shape), dtype=t.dtype, device="meta") for t in (x, y))
    params = {id(p) for p in model.parameters()}
    saved = collections.Counter()  # bytes of parameters (a matmul saves its weight) and of the rest

    def count(t):
        # feature: pipeline
        # under a pipeline: what this rank's stages save, and the loss (outside the network) on the last stage
        # /feature: pipeline
        if pp == 1 or inside["stage"] > 0 or (rank == pp - 1 and inside["net"] == 0):
            saved[id(compat.view_base(t)) in params] += t.numel() * t.element_size()
        return t

    # 16-bit mixed precision keeps weights in fp32 but most saved activations (matmul inputs) in 16 bits
    mixed = str(cfg.trainer.precision).endswith("-mixed")
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        model.training_step((x, y), 0)
    # the micro-batches in flight share the parameters they save
    return (int(saved[False] * copies) + saved[True]) // (2 if mixed else 1)


# feature: deepspeed
def deepspeed_states(cfg: DictConfig, topology: Topology, stage: int, offload: bool) -> int:
    """DeepSpeed's own estimate of the model states one GPU holds (it assumes 16-bit mixed precision);
    ZeRO-1 has no estimator and holds at most what ZeRO-2 does plus the gradients it does not shard."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = meta_model(cfg)
    # deepspeed's model_to_params tells shared tensors apart by data_ptr, which is 0 for every meta tensor
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    shape = {"num_gpus_per_node": topology.devices_per_node, "num_nodes": topology.nodes}
    if stage == 3:
        return estimate_zero3_model_states_mem_needs(total, largest, cpu_offload=offload, **shape)[1]
    return estimate_zero2_model_states_mem_needs(total, cpu_offload=offload, **shape)[1] + 2 * total * (stage == 1)


# /feature: deepspeed
def estimate(cfg: DictConfig, layout: str = "", rank: int = 0) -> Row:
    """What `rank` holds when the composed config trains; `layout` labels the row."""
    topology = Topology.of(cfg).validate()
    layout = layout or f"strategy={topology.strategy}"
    with fake_world(topology.world_size, rank) if topology.model_parallel else nullcontext():
        activations = activation_bytes(cfg, topology)
        # feature: deepspeed
        if topology.strategy == "deepspeed":  # DeepSpeed's own estimators
            stage, offload = int(cfg.strategy.get("stage", 2)), bool(cfg.strategy.get("offload"))
            return Row(layout, deepspeed_states(cfg, topology, stage, offload), activations)
        # /feature: deepspeed
        params, grads, optimizer, ema, gathered = model_states(cfg, topology)
    return Row(layout, params + grads + optimizer + ema, activations, params, grads, optimizer, ema, gathered)


def largest(cfg: DictConfig, layout: str) -> Row:
    """The row of the rank that holds the most: rank 0 (FSDP gives it the largest shards)."""
    ranks = {0}
    # feature: pipeline
    # or under pp the first rank of the last stage where that holds more (the head, the loss); a middle stage holds
    # fewer modules and no more micro-batches in flight than the first
    topology = Topology.of(cfg)
    ranks.add(topology.world_size - topology.world_size // topology.pipeline_parallel_size)
    # /feature: pipeline
    return max((estimate(cfg, layout, rank) for rank in ranks), key=lambda row: row.total)


def candidates(cfg: DictConfig, topology: Topology) -> list[list[str]]:
    """Strategy overrides from the cheapest in communication to the most frugal in memory, as far as the model
    allows: on one device `single`; else DDP, FSDP for any model (HSDP across nodes), then the layouts that
    parallel_layouts adds where the model's plan allows them."""
    layouts = [["strategy=single"]] if topology.world_size == 1 else parallel_layouts(cfg, topology)
    # feature: deepspeed
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None and not ema_configured(cfg):  # EMA refuses DeepSpeed
        if topology.world_size > 1:
            layouts.insert(1, ["strategy=deepspeed_stage_2"])  # DDP's traffic, gradients and optimizer state sharded
            layouts.append(["strategy=deepspeed_stage_3"])  # DeepSpeed keeps the weights in its own partitions
        layouts.append(["strategy=deepspeed_stage_3_offload"])  # on one device, offloading is the only way down
    # /feature: deepspeed
    return layouts


def parallel_layouts(cfg: DictConfig, topology: Topology) -> list[list[str]]:
    """The layouts of candidates on more than one device, before those of other strategies."""
    layouts = [["strategy=ddp"]]
    # feature: expert, tensor, pipeline
    plan = cfg.model.get("parallel") or {}
    # /feature: expert, tensor, pipeline
    # shards within a node, replicas across: fewer bytes over the slower links
    sharded = [["strategy=hsdp"], ["strategy=fsdp"]] if topology.nodes > 1 else [["strategy=fsdp"]]
    for layout in sharded:
        # feature: expert
        # experts split inside a node where the model has `experts`, before the same layout without: it holds as
        # much and gathers only its own experts. EP divides the experts and a node, so every shard group (a node
        # or all ranks): its all-to-alls stay in a node
        experts = math.gcd((cfg.model.get("net") or {}).get("n_expert") or 1, topology.devices_per_node)
        if plan.get("experts") and experts > 1:
            layouts.append([*layout, f"strategy.expert_parallel_size={experts}"])
        # /feature: expert
        layouts.append(layout)
        # feature: pipeline
        # pp after HSDP and before FSDP: a stage per node holds ~1/world of the model, as FSDP does, and sends
        # only activations between nodes, point to point, where FSDP gathers every block across them; its
        # bubble leaves GPUs idle, so HSDP (gradients alone cross nodes) comes first where it fits
        if layout == ["strategy=hsdp"] and plan.get("pipeline") and (pipeline := pipeline_layout(cfg, topology)):
            layouts.append(pipeline)
        # /feature: pipeline
    # feature: tensor
    # TP inside a node where the plan splits layers
    from mlproject.distributed.strategies import net_setting

    heads = net_setting(cfg, "n_head")[1] or 0
    sizes = [t for t in (8, 4, 2) if t <= topology.devices_per_node and topology.world_size % t == 0]
    sizes = [t for t in sizes if not heads or heads % t == 0]  # TP splits heads: keep it within a node
    if plan.get("colwise") and sizes:
        layouts.append(["strategy=fsdp_tp", f"strategy.tensor_parallel_size={sizes[0]}"])
    # /feature: tensor
    return layouts


# feature: pipeline
def pipeline_layout(cfg: DictConfig, topology: Topology) -> list[str] | None:
    """strategy=pp with a stage per node, FSDP in each node, 1F1B on two micro-batches per stage (bubble
    (P - 1) / (3P - 1), under a third), if preflight accepts it (the blocks divide into the stages, the batch
    into the micro-batches, no accumulation); else None."""
    from omegaconf import OmegaConf

    from mlproject.distributed.strategies import check_pipeline

    stages, microbatches = topology.nodes, 2 * topology.nodes
    pipeline = {"schedule": "1f1b", "microbatches": microbatches}
    plain = {key: 1 for key in vars(topology) if key.endswith("_size") and key != "global_batch_size"}
    shape = replace(topology, strategy="fsdp", **(plain | {"pipeline_parallel_size": stages}))
    try:
        check_pipeline(OmegaConf.create({"model": cfg.model, "strategy": {"pipeline": pipeline}}), shape.validate())
    except ConfigError:
        return None
    return [
        "strategy=pp",
        f"strategy.pipeline_parallel_size={stages}",
        *(f"strategy.pipeline.{key}={value}" for key, value in pipeline.items()),
    ]


# /feature: pipeline
def device_memory(cfg: DictConfig) -> int | None:
    """Bytes of one target GPU: cluster.gpu_memory_gb, else the smallest GPU's here, else unknown. Read through
    NVML (gpu_memory): preflight asks in the launching process, before Lightning starts the ranks."""
    from mlproject.core.resolvers import gpu_memory

    gb = (cfg.get("cluster") or {}).get("gpu_memory_gb")
    return int(gb * GiB) if gb else gpu_memory()


@dataclass(frozen=True)
class Plan:
    topology: Topology
    configured: Row
    rows: list[Row]  # the candidates, cheapest first
    memory: int | None

    def fits(self, row: Row) -> bool | None:
        return None if self.memory is None else row.total <= HEADROOM * self.memory

    @property
    def recommended(self) -> Row | None:
        return next((row for row in self.rows if self.fits(row)), None)


def plan(overrides: list[str], others: bool = True) -> Plan:
    """Estimate the composed config as given and, with `others`, each candidate layout (the same overrides,
    another strategy)."""
    from hydra import compose

    from mlproject.distributed.strategies import check_model_parallel, check_plan

    cfg = compose("train", overrides)
    topology = Topology.of(cfg).validate()
    check_model_parallel(cfg, topology)
    check_plan(cfg, topology, meta_network(cfg))  # e.g. heads that do not divide by the TP size
    given = [o for o in overrides if o.startswith("strategy")]
    configured = largest(cfg, " ".join(given) or f"strategy={topology.strategy}")
    rest = [o for o in overrides if o not in given]  # a candidate's strategy replaces the configured one whole
    rows = []
    for layout in candidates(cfg, topology) if others else ():
        if layout == given:  # the configured layout, estimated above (a copy: the table marks the configured row)
            rows.append(replace(configured))
        else:
            rows.append(largest(compose("train", [*rest, *layout]), " ".join(layout)))
    return Plan(topology, configured, rows, device_memory(cfg))


def size(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.2f} MiB"


def print_plan(result: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    memory = (
        f"{size(result.memory)} per device" if result.memory else "device memory unknown: set cluster.gpu_memory_gb"
    )
    table = Table(title=f"per rank of {result.topology.world_size}; {memory}", title_justify="left")
    rows = [result.configured, *result.rows]
    ema, gathered = any(row.ema for row in rows), any(row.gathered for row in rows)
    extra = [*(["ema"] if ema else []), *(["gathered"] if gathered else [])]
    for column in ("layout", "params", "grads", "optimizer", *extra, "activations", "total", "fits"):
        table.add_column(column, justify="left" if column == "layout" else "right", no_wrap=True)
    best = result.recommended
    for row in rows:
        label = row.layout.replace("strategy=", "")
        # feature: tensor
        label = label.replace("strategy.tensor_parallel_size=", "tp=")
        # /feature: tensor
        # feature: pipeline
        label = label.replace("strategy.pipeline_parallel_size=", "pp=").replace("strategy.pipeline.", "")
        # /feature: pipeline
        mark = " (configured)" if row is result.configured else " <- use" if row is best else ""
        fits = {None: "?", True: "yes", False: "no"}[result.fits(row)]
        cells = [size(c) if c is not None else "-" for c in (row.params, row.grads, row.optimizer)]
        cells += [size(row.ema)] if ema else []
        cells += [size(row.gathered) if row.gathered else "-"] if gathered else []
        table.add_row(label + mark, *cells, size(row.activations), size(row.total), fits)
    Console(width=max(Console().width, 112)).print(table)
    print(
        "params/grads/optimizer: the real sharding on a fake process group"
        # feature: deepspeed
        " (DeepSpeed: its estimator, the three in one, with its largest layer gathered)"
        # /feature: deepspeed
        "; gathered: FSDP's largest unit all-gathered, in the dtype it computes in; activations: saved for backward "
        "by one micro-batch's training step"
        # feature: pipeline
        ", under pp by the micro-batches its schedule keeps in flight (docs/planning.md); pp: the first or the last "
        "stage, whichever holds more"
        # /feature: pipeline
    )
    if result.configured.activations is None:
        print(
            "activations: ? (not counted): the datamodule sets its batch size in its own DataLoaders, unknown before "
            "they run (the template's DataModule takes a global data.batch_size); total and fits are without them"
        )
    if best is None and result.memory:
        print(f"no layout fits in {size(result.memory)}: {NO_FIT}")


# feature: slurm, kubernetes
def check_fits(overrides: list[str]) -> None:
    """Refuse, in one line naming the fix, a job whose configured layout would not fit its GPUs (for submit)."""
    # the other layouts only to name one that fits: a job that fits skips their estimates (and their imports)
    result = plan(overrides, others=False)
    if result.memory is None or result.fits(result.configured):
        return
    result = plan(overrides)
    needed = f"{result.configured.layout} needs {size(result.configured.total)} per GPU of {size(result.memory)}"
    best = result.recommended
    fix = f"use {best.layout} ({size(best.total)})" if best else NO_FIT
    raise ConfigError(f"{needed} (`make plan` shows the table); {fix}, or skip this check with --no-plan")


# /feature: slurm, kubernetes
def main(argv: list[str] | None = None) -> int:
    from hydra import initialize_config_dir

    from mlproject.cli import ERRORS, one_line
    from mlproject.core.constants import CONFIG_DIR
    from mlproject.core.resolvers import register_resolvers

    overrides = sys.argv[1:] if argv is None else argv
    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            result = plan(overrides)
    except ERRORS as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    print_plan(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
