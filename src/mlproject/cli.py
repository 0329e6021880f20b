"""The Hydra entry of every command: compose configs/<name>.yaml, run the task, end a config mistake in one line."""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys

import hydra
import yaml
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from mlproject.core.constants import CONFIG_DIR
from mlproject.core.errors import ConfigError
from mlproject.core.resolvers import register_resolvers

ERRORS = (HydraException, OmegaConfBaseException, ConfigError)


def one_line(exc: BaseException) -> str:
    """Hydra and OmegaConf errors span many lines (search paths, full keys); keep what a user needs."""
    text = str(exc).split("Config search path")[0]
    cause = str(exc.__cause__ or "")
    if cause and cause not in text and not isinstance(exc, ConfigError):
        text += "\n" + cause
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("full_key:", "object_type=", "reference_type="))]
    return " ".join(ln if ln.endswith((".", ":", "?")) else ln + "." for ln in lines).replace(": .", ":")


# lightning-hydra-template's options that are named otherwise here (docs/migrating.md); {} lists the group's own
HABITS = {
    "trainer/ddp": "strategy=ddp trainer.devices=<n> (the strategy is a config group of its own)",
    "trainer/ddp_sim": "trainer=cpu strategy=ddp trainer.devices=2",
    "trainer/mps": "trainer.accelerator=mps",
    "logger/many_loggers": "logger=many",
    "callbacks/rich_progress_bar": "callbacks=progress_bar (rich on a terminal, plain lines in a log)",
    # feature: sweeps
    "hparams_search/mnist_optuna": "hparams_search=<{}> (the search space of each model)",
    # its recipes' sweeper, hydra-optuna-sweeper: ours takes the same keys
    "hydra/sweeper/optuna": "override /hydra/sweeper: study, without hydra-optuna-sweeper's _target_ line",
    # /feature: sweeps
    "experiment/example": "experiment=<{}>",
}


def did_you_mean(exc: BaseException, config_name: str, argv: list[str]) -> ConfigError | None:
    """A misspelled group, option or key, with the closest name that exists. Hydra's own advice for an unknown
    key is `+key=value`, which adds a key nothing reads: the run then fails far away, or silently ignores it."""
    text = str(exc)
    if m := re.search(r"Could not find '([\w/]+)/([\w.-]+)'", text):
        group, option = m.groups()
        if here := HABITS.get(f"{group}/{option}"):
            options = "|".join(sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")))
            return ConfigError(f"{group}={option} is lightning-hydra-template's name; here: {here.format(options)}")
        close = difflib.get_close_matches(option, [p.stem for p in (CONFIG_DIR / group).glob("*.yaml")], n=1)
        return ConfigError(f"{one_line(exc)} Did you mean {group}={close[0]}?") if close else None
    if not (m := re.search(r"Could not override '([\w.]+)'", text)):
        return None
    key = m.group(1)
    value = next((a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == key), "...")
    parent, _, leaf = key.rpartition(".")
    if key in ("data.folds", "data.fold"):  # k-fold is the template DataModule's: a key of its own is not enough
        return ConfigError(
            f"'data' has no key '{leaf}': this datamodule cannot fold; k-fold needs a subclass of "
            "mlproject.training.datamodule.DataModule given folds and fold (as configs/data/digits.yaml)"
        )
    names = [] if parent else [p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name != "hydra"]
    try:  # the config as composed without the bad override: its keys where the bad one was
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import DictConfig, OmegaConf

        others = [a for a in argv if a.lstrip("+~").split("=", 1)[0] != key]
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            node = compose(config_name, others)
        node = OmegaConf.select(node, parent) if parent else node
        names += [k for k in node if k not in names] if isinstance(node, DictConfig) else []
    except Exception:  # another mistake on the same line: Hydra reports it once this one is fixed
        pass
    where = f"'{parent}' has no key '{leaf}'" if parent else f"'{key}' is neither a config group nor a key"
    if close := difflib.get_close_matches(leaf, names, n=1):
        if not parent and (CONFIG_DIR / close[0]).is_dir():
            return ConfigError(f"{where}; {group_hint(close[0], value)}")
        return ConfigError(f"{where}; did you mean {parent + '.' if parent else ''}{close[0]}={value}?")
    return ConfigError(f"{where}; its keys: {', '.join(names)} (to add a new key that your code reads: +{key}={value})")


def group_hint(group: str, option: str) -> str:
    """The fix for a misspelled group: `group=option` only where that option exists (a suggestion that does
    not exist only leads to the next error), else the group and its options closest to `option`."""
    options = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
    if option in options:
        return f"did you mean {group}={option}?"
    close = difflib.get_close_matches(option, options, n=3)
    listed = f"the closest: {', '.join(close)}" if close else f"its options: {', '.join(options)}"
    return f"did you mean the group {group}? It has no option {option!r}; {listed}"


def exit_with(exc: BaseException) -> None:
    """Print `error: <one line>` and exit 2, or raise the traceback if the user set HYDRA_FULL_ERROR=1."""
    if os.environ.get("_MLPROJECT_FULL_ERROR") == "user":
        raise exc
    print(f"error: {one_line(exc)}", file=sys.stderr)
    sys.exit(2)


def to_log_file(message: str, exc: BaseException | None = None) -> str | None:
    """Write `message` (and `exc`'s traceback) into the run's log file only, not the console; returns its path."""
    import logging

    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    info = (type(exc), exc, exc.__traceback__) if exc else None
    record = logging.getLogger(__name__).makeRecord(__name__, logging.ERROR, __file__, 0, message, None, info)
    for handler in files:
        handler.handle(record)
    return files[0].baseFilename if files else None


def report_bug(exc: BaseException) -> None:
    """An exception raised in code: the full traceback into the run's log file, and a few lines here, the error
    and the innermost frame outside installed libraries (where the user's code raised it or called into one)."""
    import traceback

    from mlproject.core.errors import root_cause, user_frame

    root = root_cause(exc)
    log_file = to_log_file("the run failed:", exc)
    lines = [f"error: {type(root).__name__}: {root}".rstrip()]
    if frame := user_frame(exc):
        lines += traceback.format_list([frame])[0].rstrip().splitlines()
    where = f"the full traceback is in {log_file}, or " if log_file else "the full traceback: "
    lines.append(f"({where}run again with HYDRA_FULL_ERROR=1)")
    print("\n".join(lines), file=sys.stderr)


def discard_run_dir(cfg) -> None:
    """A run refused before it trained (preflight, or a config error at the first batch) leaves no folder it made
    behind: rank 0 removes the run directory if this process created it (core/rundir.py), else says it kept it."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from mlproject.core.rundir import discard, is_primary

    hc = HydraConfig.get()
    if hc.mode.name != "RUN" or hc.output_subdir is None or not is_primary():  # export writes no run directory
        return
    log_dir = OmegaConf.select(cfg, "paths.log_dir", default=None)
    if log_dir and (kept := discard(hc.runtime.output_dir, log_dir)):
        print(f"note: {kept}", file=sys.stderr)


def hydra_entry(config_name: str):
    """`hydra.main` on configs/<config_name>.yaml; a config mistake ends with one line and exit code 2.

    Hydra prints multi-line reports for bad overrides; we ask it to raise instead (HYDRA_FULL_ERROR)
    and print one line, unless the user set HYDRA_FULL_ERROR=1 to see the traceback.
    """

    def decorator(task):
        @functools.wraps(task)
        def job(cfg):
            from mlproject.distributed.launch import local_ranks_end

            # Errors inside the job are caught here: Hydra would first print its own multi-line header.
            try:
                with local_ranks_end():  # the local ranks a task started (launch_local_ranks) end with it
                    return task(cfg)
            except ERRORS as exc:
                from hydra.core.hydra_config import HydraConfig

                to_log_file(f"error: {one_line(exc)}")  # for a run directory that is kept
                discard_run_dir(cfg)
                if HydraConfig.get().mode.name == "MULTIRUN":  # one trial fails: Hydra records it, the sweep goes on
                    print(f"error: trial {HydraConfig.get().job.num}: {one_line(exc)}", file=sys.stderr)
                    raise
                exit_with(exc)
            except Exception as exc:  # a bug in code, the user's or ours: its frame, never a config message
                from hydra.core.hydra_config import HydraConfig

                if HydraConfig.get().mode.name == "MULTIRUN" or os.environ.get("_MLPROJECT_FULL_ERROR") == "user":
                    raise
                report_bug(exc)
                sys.exit(1)

        wrapped = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=config_name)(job)

        @functools.wraps(task)
        def main():
            register_resolvers()
            # what a job's other local ranks run: a sweep's launcher may run the job in a process of its own
            spec = sys.modules["__main__"].__spec__
            os.environ["_MLPROJECT_ENTRY"] = spec.name if spec else os.path.abspath(sys.argv[0])
            if "_MLPROJECT_FULL_ERROR" not in os.environ:  # child processes inherit the user's choice
                os.environ["_MLPROJECT_FULL_ERROR"] = "user" if os.environ.get("HYDRA_FULL_ERROR") == "1" else "1"
            os.environ["HYDRA_FULL_ERROR"] = "1"
            try:
                return wrapped()
            except ERRORS as exc:
                exit_with(did_you_mean(exc, config_name, sys.argv[1:]) or exc)
            except yaml.YAMLError as exc:  # a config file that is not YAML: its file and line, not the parser's stack
                mark = getattr(exc, "problem_mark", None)
                where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}: " if mark else ""
                what = " ".join(str(getattr(exc, k) or "") for k in ("context", "problem")).strip() or str(exc)
                exit_with(ConfigError(f"{where}not valid YAML ({what}); fix that line of the file"))
            except ValueError as exc:  # Hydra reports `group=null` with a plain ValueError
                if "Config group override must be" not in str(exc):
                    raise
                exit_with(ConfigError(f"{exc}; to drop a config group use ~<group>, e.g. ~logger"))

        return main

    return decorator


def run_as_process(main) -> None:
    """Run an entry point's `main` as this process's last act. After a success in a distributed job, end
    the process group, run the exit hooks (loggers flush there) and leave without interpreter teardown:
    torch 2.13 sometimes aborts in it after gloo work ("terminate called without an active exception"),
    which would turn a finished job into a failed one. Failures exit as usual."""
    main()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from mlproject.utils import compat

    dist.destroy_process_group()
    compat.exit_now(0)
