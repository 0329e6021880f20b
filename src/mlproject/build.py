"""Build the objects of a run from their config keys, and the Trainer from them. A mistake in a `_target_` or
a constructor argument ends as one line naming the config key, the file it came from and the bad name."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import re
import warnings
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from mlproject.core.errors import ConfigError, root_cause, user_frame
from mlproject.distributed.strategies import without_plan

ABSENT = object()  # a key a config does not set


def lookup(tree, key: str):
    """The value at dotted `key` of a plain nested dict, or ABSENT."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return ABSENT
        tree = tree[part]
    return tree


def config_files(hc) -> list[tuple[str, dict]]:
    """(file, its content at its package, unresolved) of every config file composed into this run, in Hydra's
    merge order: the defaults tree as Hydra computes it (a group's option, the files it includes, then
    experiment, debug and the other `_global_` files), each file found on the run's search path."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from mlproject.core.constants import PROJECT_ROOT

    overrides = [*hc.overrides.hydra, *hc.overrides.task]
    defaults = GlobalHydra.instance().config_loader().compute_defaults_list(hc.job.config_name, overrides, RunMode.RUN)
    dirs = [Path(s.path) for s in hc.runtime.config_sources if s.schema == "file"]
    files = []
    for d in defaults.defaults:
        path = next((p for p in (root / f"{d.config_path}.yaml" for root in dirs) if p.is_file()), None)
        if path is None or d.package.split(".")[0] == "hydra":
            continue
        content = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        content.pop("defaults", None)
        for part in reversed(d.package.split(".") if d.package else []):
            content = {part: content}
        files.append((str(path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path), content))
    return files


def source(cfg: DictConfig, key: str) -> str | None:
    """Where `key` was set: the command line, or the config file whose value it holds (for a node, every file
    that set something in it). None where that cannot be told (outside a Hydra run; a value no file holds, like
    eval's data and model, which come from the checkpoint): better no file than a wrong one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    value = lookup(OmegaConf.to_container(cfg, resolve=False), key)
    set_keys = [o.lstrip("+~").split("=")[0] for o in hc.overrides.task if "." in o.split("=")[0]]
    on_command_line = any(f"{key}.".startswith(f"{k}.") for k in set_keys)  # the key or a node above it
    setters = [(path, found) for path, content in config_files(hc) if (found := lookup(content, key)) is not ABSENT]
    if not isinstance(value, dict):  # a value: the command line's, or the last file's if cfg holds that one
        if on_command_line:
            return "the command line"
        return setters[-1][0] if setters and setters[-1][1] == value else None
    if "_target_" in value and source(cfg, f"{key}._target_") is None:  # e.g. eval's model, from the checkpoint
        return None
    under_it = on_command_line or any(k.startswith(f"{key}.") for k in set_keys)
    return ", ".join([*(path for path, _ in setters), *(["the command line"] if under_it else [])]) or None


def chosen(cfg: DictConfig, group: str) -> str:
    """`data=digits (configs/data/digits.yaml)`: a group's option as the user would name it, where its
    `_target_` is that option's; else (set elsewhere, or eval's from the checkpoint) the class itself."""
    from hydra.core.hydra_config import HydraConfig

    choice = HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None
    file = f"configs/{group}/{choice}.yaml"
    if choice and source(cfg, f"{group}._target_") == file:
        return f"{group}={choice} ({file})"
    return f"{group} ({cfg[group]._target_})"


def with_source(cfg: DictConfig, key: str, text: str = "") -> str:
    """`text (where key was set)`, or `text` alone where that cannot be told; `text` defaults to the key."""
    where = source(cfg, key)
    return f"{text or key} ({where})" if where else text or key


def targets(node, prefix: str) -> dict[str, str]:
    """config key -> `_target_` of every node under `node` (itself included)."""
    found = {prefix: node["_target_"]} if isinstance(node, DictConfig) and "_target_" in node else {}
    for key, value in node.items() if isinstance(node, DictConfig) else ():
        if isinstance(value, DictConfig):
            found |= targets(value, f"{prefix}.{key}")
    return found


def did_you_mean(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def parameters(cls: type) -> list[str]:
    """The keyword arguments `cls(...)` takes: its own, and its bases' where it passes **kwargs on to them."""
    names = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(names))


def explain(cfg: DictConfig, key: str, exc: Exception) -> str:
    """One line for Hydra's nested instantiation errors (a module's constructor instantiates its own net)."""
    text = str(exc).replace("\\'", "'")
    found = targets(OmegaConf.select(cfg, key), key)
    if m := re.search(r"Error locating target '([\w.]+)'", text):
        bad = m.group(1)
        at = next((k for k, t in found.items() if t == bad), key)
        module, _, name = bad.rpartition(".")
        hint = ""
        with contextlib.suppress(ImportError, ValueError):
            hint = did_you_mean(name, dir(importlib.import_module(module)))
            hint = hint and hint.replace("mean ", f"mean {module}.")
        return f"{with_source(cfg, f'{at}._target_', f'{at}._target_={bad}')} cannot be imported{hint}"
    if m := re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", text):
        cls, arg = m.groups()
        at = next((k for k, t in found.items() if t.endswith(f".{cls}")), key)
        params = parameters(get_class(found[at])) if at in found else ()
        hint = did_you_mean(arg, params).replace("mean ", f"mean {at}.") or f"; it takes {', '.join(params)}"
        return f"{with_source(cfg, f'{at}.{arg}')}: {cls} takes no argument {arg!r}{hint}"
    cause = str(exc.__cause__ or exc).replace("\\'", "'")
    return f"{with_source(cfg, key)} could not be built: {cause}"


def config_mistake(cfg: DictConfig, key: str, exc: InstantiationException) -> bool:
    """Whether the config is what is wrong: a library raised (a `_target_` that cannot be imported), or a class of
    the config was called with arguments it does not take, even through a subclass passing **kwargs on."""
    root = root_cause(exc)
    if not user_frame(exc):
        return True
    called = re.match(r"(\w+)\.__init__\(\) (got an unexpected keyword|missing \d+ required)", str(root))
    classes = {t.rpartition(".")[2] for t in targets(OmegaConf.select(cfg, key), key).values()}
    return isinstance(root, TypeError) and called is not None and called.group(1) in classes


def instantiate_at(cfg: DictConfig, key: str, **kwargs):
    """`instantiate(cfg.<key>)`; a wrong `_target_` or argument is a ConfigError naming key, file and name. An
    exception the constructor itself raised is the user's bug, not the config's: it propagates with its frame."""
    node = OmegaConf.select(cfg, key)
    node = without_plan(node) if key == "model" else node  # the plan is the strategy's, not the module's
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        if not config_mistake(cfg, key, exc):
            raise root_cause(exc) from None
        raise ConfigError(explain(cfg, key, exc)) from exc  # the chain: HYDRA_FULL_ERROR=1 shows the library's frames


def instantiate_all(cfg: DictConfig, group: str) -> list:
    """Instantiate every entry of a group like `callbacks` or `logger` that has a `_target_`."""
    node = cfg.get(group) or {}
    return [
        instantiate_at(cfg, f"{group}.{name}")
        for name, c in node.items()
        if isinstance(c, DictConfig) and "_target_" in c
    ]


# The model config's LightningModule as last built on the meta device: the checks before training take copies of
# it, so a user's __init__ runs once per process for them (nanoGPT prints its size once)
_built: tuple[str, object] | None = None


def meta_model(cfg: DictConfig):
    """The LightningModule of the config, on the meta device, in the dtype its precision stores weights in: a copy
    of the one built for this model config."""
    import copy

    import torch

    def build():
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # metrics warn about states they cannot sync here
            return instantiate_at(cfg, "model")  # as train builds it; a bad key: one line naming it

    global _built
    key = OmegaConf.to_yaml(cfg.model, resolve=True)
    if _built is None or _built[0] != key:
        _built = (key, build())
    try:
        model = copy.deepcopy(_built[1])
    except Exception:  # noqa: BLE001 (what a module holds, e.g. an open file, is its own: build it again)
        model = build()
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(str(cfg.trainer.precision))
    return model.to(dtype) if dtype else model


def meta_network(cfg: DictConfig):
    """The model on the meta device (no memory, no initialisation) after its configure_model (a lazy build), for
    the checks that read the network as built; None where it does not build there (train's build reports why)."""
    try:
        model = meta_model(cfg)
        model.configure_model()  # the template's parallelize does nothing outside a Trainer
    except Exception:  # noqa: BLE001
        return None
    return model


def build_trainer(cfg: DictConfig, callbacks: list, plugins: tuple = ()):
    """cfg.trainer with the strategy, callbacks and loggers of their groups.

    Plugins from config (e.g. a cluster config's cluster environment) are kept next to the ones passed here:
    a `plugins=` argument alone would replace them. SyncBatchNorm goes through our plugin, which also
    works on CPU (torch's SyncBatchNorm is CUDA-only). Every run checks for signals every N steps rather
    than Lightning's every step, and for a non-finite loss (cluster/requeue.py), unless a callback of the
    config does already (a cluster's subclass of Signals).
    """
    from lightning.pytorch.callbacks import LearningRateMonitor
    from omegaconf import OmegaConf

    from mlproject.cluster.requeue import Signals
    from mlproject.distributed.syncbn import SyncBatchNormPlugin

    if not any(isinstance(c, Signals) for c in callbacks):
        every = OmegaConf.select(cfg, "cluster.signal_check_every_n_steps", default=10)
        divergence = cfg.get("divergence") or {}
        ratio = OmegaConf.select(cfg, "cluster.straggler_ratio", default=1.5)
        signals = Signals(every, divergence.get("skip", False), divergence.get("max_skipped", 10), ratio)
        callbacks = [*callbacks, signals]

    plugins = [*(instantiate(p) for p in cfg.trainer.get("plugins") or []), *plugins]
    if cfg.trainer.get("sync_batchnorm"):
        plugins.append(SyncBatchNormPlugin())
    loggers = instantiate_all(cfg, "logger")
    if not loggers:  # `~logger`: the LR monitor has nowhere to write, and Lightning would stop the run for it
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    return instantiate_at(
        cfg,
        "trainer",
        strategy=instantiate_at(cfg, "strategy"),
        callbacks=callbacks,
        logger=loggers or False,
        plugins=plugins or None,
    )


@contextlib.contextmanager
def first_batch_fits(cfg: DictConfig, trainer):
    """Around fit/test: a shape error before the first optimizer step names the layer that raised it, the shapes
    it met and the line of the model that called it (the data and the model may not be a pair, or the model has
    a bug: both read the same). A run that has taken a step keeps its directory, whatever ends it."""
    from mlproject.core.rundir import trained

    try:
        yield
    except RuntimeError as exc:
        words = ("shape", "size", "channels", "dimension")
        if trainer.global_step or not any(w in str(exc) for w in words):
            raise
        first = str(exc).strip().splitlines()[0]
        where = user_frame(exc)
        at = f" ({where.filename}:{where.lineno})" if where else ""
        raise ConfigError(
            f"at the first batch, {layer_and_shapes(exc, trainer.lightning_module)}{at}: {first}; with "
            f"{chosen(cfg, 'data')} and {chosen(cfg, 'model')}: if they are not a pair, pick matching data= and "
            "model= (or an experiment=), or make the model's input size the data's"
        ) from exc
    finally:
        if trainer.global_step:
            trained()


def layer_and_shapes(exc: BaseException, model) -> str:
    """`net.fc (Linear, weight 10x32) got input 64x64`: the innermost module whose forward was running when
    `exc` was raised, read from the traceback's frames (no hooks on the model, nothing per step)."""
    import torch

    names = {id(m): name for name, m in model.named_modules()} if model is not None else {}
    module, inputs, tb = None, [], exc.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        if tb.tb_frame.f_code.co_name == "forward" and isinstance(local.get("self"), torch.nn.Module):
            module = local["self"]
            inputs = [v for k, v in local.items() if k != "self" and isinstance(v, torch.Tensor)]
        tb = tb.tb_next
    if module is None:
        return "the model"
    weight = getattr(module, "weight", None)
    kind = type(module).__name__ + (f", weight {shape(weight)}" if isinstance(weight, torch.Tensor) else "")
    got = f" got input {', '.join(map(shape, inputs[:2]))}" if inputs else ""
    return f"{names.get(id(module)) or 'the model'} ({kind}){got}"


def shape(tensor) -> str:
    return "x".join(map(str, tensor.shape))
