"""The Hydra entry of every command: compose configs/<name>.yaml, run the task, end a config mistake in one line."""

from __future__ import annotations

import atexit
import functools
import os
import sys

import hydra
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
    return " ".join(ln if ln.endswith((".", ":")) else ln + "." for ln in lines).replace(": .", ":")


def exit_with(exc: BaseException) -> None:
    """Print `error: <one line>` and exit 2, or raise the traceback if the user set HYDRA_FULL_ERROR=1."""
    if os.environ.get("_MLPROJECT_FULL_ERROR") == "user":
        raise exc
    print(f"error: {one_line(exc)}", file=sys.stderr)
    sys.exit(2)


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
                exit_with(exc)

        wrapped = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=config_name)(job)

        @functools.wraps(task)
        def main():
            register_resolvers()
            if "_MLPROJECT_FULL_ERROR" not in os.environ:  # child processes inherit the user's choice
                os.environ["_MLPROJECT_FULL_ERROR"] = "user" if os.environ.get("HYDRA_FULL_ERROR") == "1" else "1"
            os.environ["HYDRA_FULL_ERROR"] = "1"
            try:
                return wrapped()
            except ERRORS as exc:
                exit_with(exc)
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
    dist.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
