"""Strategy factories named by configs/strategy/*.yaml. Timeouts are plain seconds in config."""

from __future__ import annotations

from datetime import timedelta

from omegaconf import DictConfig, open_dict

from mlproject.core.errors import ConfigError
from mlproject.core.topology import SHARDED, Topology, auto_strategy


def single(timeout: float | None = None):
    """One process: Lightning's 'auto' resolves to SingleDeviceStrategy when devices=1 (preflight checks).
    `timeout` is accepted so that every strategy takes it (debug=distributed sets it); one process has no group."""
    return "auto"


def auto(devices, num_nodes: int = 1, accelerator: str = "auto", timeout: float = 1800, **ddp_kwargs):
    """single on one device, else ddp with `ddp_kwargs` (Lightning's own choice for "auto")."""
    if auto_strategy(devices, num_nodes, accelerator) == "single":
        return single(timeout)
    return ddp(timeout, **ddp_kwargs)


def ddp(timeout: float = 1800, **kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(timeout=timedelta(seconds=timeout), **kwargs)


def ddp_spawn(timeout: float = 1800, start_method: str = "spawn", **kwargs):
    """DDP that starts its processes inside trainer.fit (multiprocessing): for notebooks and interactive use."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(start_method=start_method, timeout=timedelta(seconds=timeout), **kwargs)


# feature: deepspeed
def deepspeed(stage: int = 2, offload: bool = False, timeout: float = 1800, **kwargs):
    """DeepSpeed ZeRO: stage 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    from mlproject.distributed.zero import ZeroStrategy, use_extensions_cache

    use_extensions_cache()
    strategy = ZeroStrategy(
        stage=stage,
        offload_optimizer=offload,
        offload_parameters=offload and stage == 3,
        timeout=timedelta(seconds=timeout),
        **kwargs,
    )
    if offload:
        # With offload DeepSpeed refuses a torch optimizer unless told so. Its own CPU Adam would step faster,
        # but it is a C++ op compiled at first use, and the model's AdamW keeps the optimizer state the same
        # as under every other strategy (checkpoints resume anywhere).
        strategy.config["zero_force_ds_cpu_optimizer"] = False
    return strategy


# /feature: deepspeed
def model_parallel(timeout: float = 1800, **degrees):
    """FSDP2 (HSDP with replicate_size > 1) and the other parallelisms of the model's plan, applied after the
    module's configure_model (distributed/parallel.py). `degrees`: ModelParallel's arguments."""
    # feature: pipeline
    # and pipeline parallelism: the blocks split into stages over groups of ranks (distributed/pipeline.py)
    # /feature: pipeline
    from mlproject.distributed.parallel import ModelParallel

    return ModelParallel(timeout=timedelta(seconds=timeout), **degrees)


def net_setting(cfg: DictConfig, key: str) -> tuple[str, object]:
    """(path, value) of a network setting (vocab_size, n_head, n_layer, n_expert) wherever the model config
    holds it: model.net.<key> (the template's examples), model.net.config.<key> (nanoGPT's GPTConfig nested under
    net), model.config.<key> (a module that builds its network); the shallowest wins, the plan is skipped.
    (None, None) when the config has none."""
    level = [("model", cfg.get("model") or {})]
    while level:
        for path, node in level:
            if key in node:
                return f"{path}.{key}", node.get(key)
        level = [
            (f"{path}.{name}", child)
            for path, node in level
            for name, child in node.items()
            if isinstance(child, DictConfig) and name != "parallel"
        ]
    return None, None


def check_model_parallel(cfg: DictConfig, topology: Topology) -> None:
    """Preflight for the strategies of topology.MODEL_PARALLEL: what the model and the machine must allow (the
    topology's own shape was validated already)."""
    if not topology.model_parallel:
        return
    strategy = cfg.strategy
    if topology.strategy in SHARDED and strategy.get("fsdp") is None:
        raise ConfigError(
            f"strategy.fsdp=null leaves strategy={topology.strategy} unsharded, but it runs on FSDP; drop the override"
        )
    plan = cfg.model.get("parallel") or {}
    # feature: expert
    ep = topology.expert_parallel_size
    experts_at, experts = net_setting(cfg, "n_expert")
    if ep > 1 and not plan.get("experts"):
        raise ConfigError(f"strategy.expert_parallel_size={ep} needs a mixture-of-experts model (e.g. model=gpt_moe)")
    if ep > 1 and (experts or 0) % ep:
        raise ConfigError(
            f"{experts_at or 'model.net.n_expert'}={experts} must divide by strategy.expert_parallel_size={ep}"
        )
    # /feature: expert
    # feature: tensor
    if topology.tensor_parallel_size > 1 and not plan.get("colwise"):
        model = str(cfg.model.get("_target_", "the model")).rsplit(".", 1)[-1]
        raise ConfigError(
            f"strategy={topology.strategy} splits layers named by a `parallel` plan in the model config (e.g. "
            f"model=gpt); {model} has none; use strategy=fsdp"
        )
    # /feature: tensor
    # feature: pipeline
    if topology.pipeline_parallel_size > 1:
        check_pipeline(cfg, topology)
    # /feature: pipeline
    import torch

    if (strategy.get("fsdp") or {}).get("cpu_offload") and (
        cfg.trainer.accelerator == "cpu" or not torch.cuda.is_available()
    ):
        raise ConfigError("strategy.fsdp.cpu_offload=true moves GPU memory to the CPU; without a GPU set it to false")


# feature: pipeline
def check_pipeline(cfg: DictConfig, topology: Topology) -> None:
    """Preflight for strategy.pipeline_parallel_size > 1: stages, micro-batches and batch must divide."""
    from mlproject.distributed.pipeline import SCHEDULES, min_microbatches, stages_per_rank

    pp, settings = topology.pipeline_parallel_size, cfg.strategy.get("pipeline") or {}
    schedule, m = settings.get("schedule"), int(settings.get("microbatches") or 0)
    plan, (layers_at, layers) = cfg.model.get("parallel") or {}, net_setting(cfg, "n_layer")
    model = str(cfg.model.get("_target_", "the model")).rsplit(".", 1)[-1]
    if not plan.get("pipeline"):
        raise ConfigError(f"pipeline parallelism splits the blocks named by model.parallel.pipeline; {model} has none")
    if plan.get("experts"):
        raise ConfigError("pipeline parallelism of a mixture-of-experts model is not supported yet; use fsdp with EP")
    if schedule not in SCHEDULES:
        raise ConfigError(f"strategy.pipeline.schedule={schedule} must be one of {', '.join(SCHEDULES)}")
    stages = pp * stages_per_rank(schedule)
    if layers is not None and (layers < stages or layers % stages):
        raise ConfigError(
            f"{layers_at}={layers} does not divide into {stages} pipeline stages ({schedule} on "
            f"pipeline_parallel_size={pp}); use a multiple of {stages} blocks"
        )
    if m < min_microbatches(schedule, pp):
        raise ConfigError(
            f"strategy.pipeline.microbatches={m}: {schedule} needs at least {min_microbatches(schedule, pp)} "
            f"(one per stage; more make the bubble smaller)"
        )
    if schedule == "interleaved_1f1b" and m % max(1, m // pp):
        raise ConfigError(f"strategy.pipeline.microbatches={m} must be a multiple of {m // pp} for interleaved_1f1b")
    if topology.accumulate > 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches must be 1 under pipeline parallelism: its micro-batches accumulate "
            "already; raise strategy.pipeline.microbatches instead"
        )
    if not cfg.strategy.get("save_distributed_checkpoint", True):
        raise ConfigError("strategy.save_distributed_checkpoint=false: a pipeline's stages save their own shards")
    if topology.training and topology.global_batch_size is not None and topology.per_device_batch_size % m:
        raise ConfigError(
            f"data.batch_size={topology.global_batch_size} gives {topology.per_device_batch_size} samples per "
            f"data-parallel rank, which do not divide into strategy.pipeline.microbatches={m}"
        )


# /feature: pipeline
def check_plan(cfg: DictConfig, topology: Topology, network) -> None:
    """Every entry of model.parallel names what it should, before any process starts: `blocks` and `experts` are
    importable module classes, the blocks found in the model. `network`: the model as built on the meta device
    (build.meta_network), None where it does not build there."""
    from hydra.utils import get_class

    plan = cfg.model.get("parallel") or {}
    if not topology.model_parallel or not plan:
        return
    for key in ("blocks", "experts"):
        for name in plan.get(key) or ():
            try:
                get_class(name)
            except Exception as exc:  # noqa: BLE001 (an import error of any kind: the one line says which)
                raise ConfigError(f"model.parallel.{key}: {name} is not an importable class ({exc})") from None
    if network is None:
        return
    classes = tuple(get_class(name) for name in plan.get("blocks") or ())
    blocks = {type(m): m for m in network.modules() if classes and isinstance(m, classes)}
    if classes and not blocks:
        repeated = sorted(
            {f"{type(m).__module__}.{type(m).__qualname__}" for m in network.modules() if repeats(network, m)}
        )
        raise ConfigError(
            f"model.parallel.blocks: no module of {', '.join(plan.blocks)} in {type(network).__name__}; its "
            f"repeated module classes: {', '.join(repeated) or 'none'}"
        )
    # feature: tensor
    check_tp_plan(cfg, topology, plan, blocks)
    # /feature: tensor


# feature: tensor
def check_tp_plan(cfg: DictConfig, topology: Topology, plan, blocks: dict) -> None:
    """`colwise` and `rowwise` are Linear or Embedding layers of a block. Under tensor parallelism each split layer
    divides evenly, and so do the heads of an attention layer it splits; no colwise layer is a fused q/k/v
    projection, which a column split cuts into uneven q, k and v pieces (the model's own split then fails inside
    its forward on every rank)."""
    from torch import nn

    tp = topology.tensor_parallel_size
    for kind in ("colwise", "rowwise"):
        for name in plan.get(kind) or ():
            for block in blocks.values():
                where = f"model.parallel.{kind}: {name} of {type(block).__name__}"
                layer = block.get_submodule(name) if has_submodule(block, name) else None
                if not isinstance(layer, nn.Linear | nn.Embedding):
                    layers = [n for n, m in block.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]
                    is_what = "is no layer" if layer is None else f"is a {type(layer).__name__}"
                    raise ConfigError(f"{where} {is_what}; its Linear and Embedding layers: {', '.join(layers)}")
                if tp > 1:
                    check_split(cfg, where, block, name, layer, kind, tp)


def check_split(cfg: DictConfig, where: str, block, name: str, layer, kind: str, tp: int) -> None:
    """One layer of a tensor-parallel plan, as built: its split dimension and the heads of the attention around it
    divide by the TP size, and it is no fused q/k/v projection."""
    from torch import nn

    if kind == "colwise" and isinstance(layer, nn.Linear) and fused(name, layer):
        raise ConfigError(
            f"{where} is a fused q/k/v projection (Linear {layer.in_features} -> {layer.out_features}), "
            "which tensor parallelism cannot split by columns; split it into three Linear layers named "
            "in colwise (as model=gpt's attn.q, attn.k, attn.v), or drop it and its rowwise output "
            "projection from the plan (then TP splits the MLP only), or use strategy=fsdp"
        )
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):  # the nearest module around the layer that counts heads
        attention = block.get_submodule(".".join(parts[:depth]))
        heads = next((v for a in HEADS if isinstance(v := getattr(attention, a, None), int)), None)
        if heads is None:
            continue
        if heads % tp:
            at, value = net_setting(cfg, "n_head")
            if value == heads:  # the config's setting built it: name that
                raise ConfigError(f"{at}={heads} must divide by strategy.tensor_parallel_size={tp}")
            raise ConfigError(
                f"{where} splits {type(attention).__name__}'s {heads} heads, which do not divide by "
                f"strategy.tensor_parallel_size={tp}"
            )
        break
    # a weight is out x in for a Linear, ids x width for an Embedding: colwise splits a Linear's outputs and an
    # Embedding's width, rowwise the other dimension
    linear = isinstance(layer, nn.Linear)
    dim = 0 if (kind == "colwise") == linear else 1
    size, what = layer.weight.shape[dim], (("output features", "input features") if linear else ("ids", "width"))[dim]
    if size % tp:
        raise ConfigError(f"{where} has {size} {what}, which do not divide by strategy.tensor_parallel_size={tp}")


# names that fuse q, k and v in one Linear (nanoGPT and GPT-2's c_attn, GPT-NeoX's query_key_value, Phi-3's
# qkv_proj, MPT's Wqkv, Baichuan's W_pack, torch's in_proj)
FUSED = ("qkv", "c_attn", "query_key_value", "w_pack", "in_proj")


# attributes that count an attention layer's heads: nanoGPT's and the template's n_head, torch's MultiheadAttention
# and Hugging Face's num_heads
HEADS = ("n_head", "num_heads", "n_heads")


def fused(name: str, layer) -> bool:
    """A q/k/v projection in one Linear: by its name, or an attention layer with three times its width out."""
    leaf = name.rsplit(".", 1)[-1].lower()
    return any(f in leaf for f in FUSED) or ("attn" in name.lower() and layer.out_features == 3 * layer.in_features)


def has_submodule(module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


# /feature: tensor
def without_plan(model: DictConfig) -> DictConfig:
    """The model config as its module takes it: `parallel` is the strategy's (ModelParallel applies it after the
    module's configure_model), unless the module asks for it."""
    import inspect

    from hydra.utils import get_class

    if "parallel" not in model:
        return model
    try:
        params = inspect.signature(get_class(model._target_)).parameters
    except Exception:  # noqa: BLE001 (a _target_ that does not import: instantiate reports it in its one line)
        return model
    if "parallel" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return model
    model = model.copy()  # keeps its parent: interpolations still resolve
    with open_dict(model):
        model.pop("parallel", None)
    return model


def repeats(model, module) -> bool:
    """A module class with parameters that occurs more than once: the candidates for `blocks`."""
    same = [m for m in model.modules() if type(m) is type(module)]
    return len(same) > 1 and next(module.parameters(), None) is not None and len(list(module.children())) > 1
