# feature: slurm, kubernetes
"""Submit training to a cluster: `python -m mlproject.submit [--dry-run] [overrides]`.

Composes the same config `python -m mlproject.train` would (with the first cluster of SCHEDULERS unless another
cluster is given), refuses settings the job could not run, then writes the job (its scheduler's module, in
mlproject.cluster) and gives it to the scheduler's client. The job runs `python -m mlproject.train` with the same
overrides in every process.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mlproject.cli import ERRORS, one_line
from mlproject.cluster.jobs import given_run_id
from mlproject.core.constants import CONFIG_DIR
from mlproject.core.errors import ConfigError
from mlproject.core.resolvers import register_resolvers
from mlproject.core.rundir import check_names

# The values of cluster.scheduler, each the name of its module in mlproject.cluster, which has
# check_before_submit(cfg, overrides) -> Topology and job(cfg, topology, overrides) -> jobs.Job.
# The first is submit's default cluster.
SCHEDULERS = [
    # feature: slurm
    "slurm",
    # /feature: slurm
    # feature: kubernetes
    "kubernetes",
    # /feature: kubernetes
]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dry_run, overrides = "--dry-run" in args, [a for a in args if a != "--dry-run"]
    # feature: planner
    # --no-plan: submit without the memory plan that refuses a layout the GPUs cannot hold (mlproject.plan)
    plan, overrides = "--no-plan" not in args, [a for a in overrides if a != "--no-plan"]
    # /feature: planner
    if not any(o.lstrip("+~").startswith("cluster=") for o in overrides):
        overrides = [f"cluster={SCHEDULERS[0]}", *overrides]
    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides)
            if cfg.cluster.get("scheduler") not in SCHEDULERS:
                clusters = " or ".join(f"cluster={name}" for name in SCHEDULERS)
                raise ConfigError(f"mlproject.submit needs a cluster with a scheduler; use {clusters}")
            scheduler = importlib.import_module(f".cluster.{cfg.cluster.scheduler}", __package__)
            # they name folders of the paths below; `${run_id:}` unresolved (it would make up an id here) stands
            # for the job's own id, which the scheduler gives it and which is a folder name
            check_names(OmegaConf.create({"task_name": cfg.task_name, "run_id": given_run_id(cfg) or "job-id"}))
            topology = scheduler.check_before_submit(cfg, overrides)
            # feature: planner
            if plan and cfg.cluster.get("gpus_per_node"):  # the plan is of GPU memory
                import contextlib

                from mlproject.plan import check_fits

                # what the planner's imports print (a library's accelerator warning) is not the script or manifest
                with contextlib.redirect_stdout(sys.stderr):
                    check_fits(overrides)
            # /feature: planner
        job = scheduler.job(cfg, topology, overrides)
    except ERRORS as exc:  # one line and exit 2, as in train
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    if dry_run:
        print(job.text, end="")
        return 0
    client = job.command[0]
    if not shutil.which(client):
        print(
            f"error: {client} not found; install it, or write the {job.kind} with --dry-run and submit it yourself",
            file=sys.stderr,
        )
        return 1
    if job.log_dir:
        job.log_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(job.command, input=job.text, text=True, capture_output=True, env=job.env)
    if proc.returncode != 0:
        print(f"error: `{' '.join(job.command)}` refused the {job.kind}: {proc.stderr.strip()}", file=sys.stderr)
        return 1
    print(job.submitted(proc.stdout))
    return 0


if __name__ == "__main__":
    sys.exit(main())

# /feature: slurm, kubernetes
