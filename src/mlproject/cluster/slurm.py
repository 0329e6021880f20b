"""The sbatch script of a training job, written from the composed config, the checks before submission, and the
check inside the job (preflight)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from omegaconf import DictConfig

from mlproject.cluster.jobs import Job, check_allocation, given_run_id, single_line
from mlproject.core.errors import ConfigError
from mlproject.core.ranges import check_ranges
from mlproject.core.topology import Topology

# srun starts every process; the rendezvous address is the first node's address as SLURM knows it
# (its NodeAddr, which resolves even where node names do not), the port is derived from the job id.
RENDEZVOUS = [
    'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    "export MASTER_ADDR=$(scontrol show node \"$head\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
    "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 40000))",
]


# the key a refused #SBATCH value is named by, where it is not cluster.<option>
SOURCES = {"job-name": "task_name", "chdir": "the current directory", "output": "paths.log_dir"}
WHOLE = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1, "time_min": 1, "signal_seconds": 1}
PLAIN = re.compile(r"[\w@%+=:,./-]+")  # no blank, quote, backslash or '#': an #SBATCH argument as it is


def check_job_size(cfg: DictConfig) -> None:
    """With cluster=slurm, the Trainer must ask for exactly what the sbatch header allocates."""
    check_allocation(cfg, "slurm", "tasks_per_node", WHOLE, "DDP runs")


def check_in_job(cfg: DictConfig) -> None:
    """Inside the job (preflight): every process must be an srun task, else Lightning waits for the missing ones."""
    if (cfg.get("cluster") or {}).get("scheduler") == "slurm" and "SLURM_STEP_ID" not in os.environ:
        raise ConfigError(
            "cluster=slurm runs one srun task per device inside a SLURM job; submit it with "
            "`python -m mlproject.submit ...` (or drop cluster=slurm to run here)"
        )
    check_job_size(cfg)


def check_before_submit(cfg: DictConfig, overrides: list[str]) -> Topology:
    """What preflight would refuse in the job, minus what only the compute nodes can tell (their GPUs)."""
    check_ranges(cfg)
    check_job_size(cfg)
    return Topology.of(cfg).validate()


def sbatch_word(key: str, value: object) -> str:
    """`value` as one argument of an #SBATCH line. sbatch reads these lines itself (src/sbatch/opt.c,
    _get_argument): blanks split arguments, an unquoted '#' starts a comment, quotes group and a backslash escapes
    (inside quotes too), up to the end of the line."""
    text = single_line(key, value, "an #SBATCH line")
    return text if PLAIN.fullmatch(text) else '"' + re.sub(r'(["\\])', r"\\\1", text) + '"'


def job(cfg: DictConfig, topology: Topology, overrides: list[str]) -> Job:
    """The sbatch script, for `sbatch --parsable`; its log goes to <log_dir>/<task_name>/slurm/<job id>.out."""
    log_dir = Path(cfg.paths.log_dir).resolve() / cfg.task_name / "slurm"
    output = str(log_dir).replace("%", "%%") + "/%j.out"  # sbatch expands %<letter> in the path, %% is a %

    def submitted(stdout: str) -> str:
        job_id = stdout.strip().split(";")[0]  # "<job id>[;<cluster>]"
        run_dir = Path(cfg.paths.log_dir).resolve() / cfg.task_name / "runs" / (given_run_id(cfg) or job_id)
        return f"submitted SLURM job {job_id}\n  log: {log_dir / (job_id + '.out')}\n  run directory: {run_dir}"

    script = sbatch_script(cfg, topology, overrides, workdir=os.getcwd(), output=output)
    # The job's run_id must be its SLURM_JOB_ID; an id exported in this shell would override it.
    env = {k: v for k, v in os.environ.items() if k != "MLPROJECT_RUN_ID"}
    return Job(script, "sbatch script", ["sbatch", "--parsable"], submitted, log_dir=log_dir, env=env)


def sbatch_script(cfg: DictConfig, topology: Topology, overrides: list[str], workdir: str, output: str) -> str:
    """The job: one srun task per device, each running `python -m mlproject.train` with the same overrides.

    The run directory is keyed on SLURM_JOB_ID (core/resolvers.run_id), so all tasks and all requeues share it,
    and `ckpt_path=auto` makes a requeued job resume there (unless the overrides set ckpt_path).
    Each value is one argument where it goes: quoted for sbatch in the #SBATCH lines (a line break refused), for
    bash in the srun line. cluster.setup is shell lines, the user's own, written as they are.
    """
    c = cfg.cluster
    options = {
        "job-name": cfg.task_name,
        "nodes": c.nodes,
        "ntasks-per-node": c.tasks_per_node,
        "gpus-per-node": c.gpus_per_node or None,
        "cpus-per-task": c.cpus_per_task,
        "mem": f"{c.mem_gb}G" if c.mem_gb else None,
        "time": c.time_min,
        "partition": c.partition,
        "account": c.account,
        "qos": c.qos,
        "constraint": c.constraint,
        "signal": f"USR1@{c.signal_seconds}",  # to every task, not the batch shell: mlproject.cluster.requeue
        "requeue": True,
        "open-mode": "append",  # a requeued job appends to the same log
        "chdir": workdir,
        "output": output,
    }
    header = [
        f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={sbatch_word(SOURCES.get(k, f'cluster.{k}'), v)}"
        for k, v in options.items()
        if v is not None
    ]
    # each item one argument: a blank in it does not start another option
    header += [f"#SBATCH {sbatch_word(f'cluster.extra_sbatch[{i}]', o)}" for i, o in enumerate(c.extra_sbatch)]
    if not any(o.startswith("ckpt_path=") for o in overrides):
        overrides = [*overrides, "ckpt_path=auto"]
    srun = ["srun", "--kill-on-bad-exit=1", f"--cpus-per-task={c.cpus_per_task}"]
    train = [c.python or sys.executable, "-m", "mlproject.train", *overrides]
    t = cfg.trainer
    return "\n".join(
        [
            "#!/bin/bash",
            *header,
            f"# trainer.num_nodes={t.num_nodes} trainer.devices={t.devices}: {topology.world_size} processes",
            "set -eo pipefail",
            *([c.setup] if c.setup else []),
            *RENDEZVOUS,
            shlex.join([*srun, *train]),
            "",
        ]
    )
