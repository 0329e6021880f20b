"""Submit training to SLURM or Kubernetes: `python -m mlproject.submit [--dry-run] [--no-plan] [overrides]`.

Composes the same config `python -m mlproject.train` would (with cluster=slurm unless another cluster
is given), refuses settings the job could not run and, unless `--no-plan`, a layout that would not fit the GPUs'
memory (mlproject.plan), then writes the job and submits it: under cluster=slurm the sbatch script (`sbatch`),
under cluster=kubernetes the Kubeflow TrainJob manifest (`kubectl apply -f -`). The job runs
`python -m mlproject.train` with the same overrides in every process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mlproject.cli import ERRORS, one_line
from mlproject.cluster import kubernetes
from mlproject.cluster.names import given_run_id
from mlproject.cluster.slurm import check_before_submit, sbatch_script
from mlproject.core.constants import CONFIG_DIR
from mlproject.core.resolvers import register_resolvers
from mlproject.core.rundir import check_names
from mlproject.plan import check_fits


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dry_run, check_memory = "--dry-run" in args, "--no-plan" not in args
    overrides = [a for a in args if a not in ("--dry-run", "--no-plan")]
    if not any(o.lstrip("+~").startswith("cluster=") for o in overrides):
        overrides = ["cluster=slurm", *overrides]
    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides)
            # they name folders of the paths below; `${run_id:}` unresolved (it would make up an id here) stands
            # for the job's own id, SLURM_JOB_ID or the TrainJob's name, which are folder names
            check_names(OmegaConf.create({"task_name": cfg.task_name, "run_id": given_run_id(cfg) or "job-id"}))
            on_kubernetes = cfg.cluster.get("scheduler") == "kubernetes"
            topology = kubernetes.check_before_submit(cfg, overrides) if on_kubernetes else check_before_submit(cfg)
            if check_memory and cfg.cluster.get("gpus_per_node"):  # the plan is of GPU memory
                # what the planner's imports print (DeepSpeed's accelerator warning) is not the script or manifest
                with contextlib.redirect_stdout(sys.stderr):
                    check_fits(overrides)
        if on_kubernetes:
            name = kubernetes.job_name(cfg)
            manifest = kubernetes.manifest(cfg, topology, overrides, name)
            run_dir = kubernetes.run_dir(cfg, overrides, name)
            return apply(cfg.cluster.namespace, manifest, name, run_dir, dry_run)
        slurm_dir = Path(cfg.paths.log_dir).resolve() / cfg.task_name / "slurm"
        output = str(slurm_dir).replace("%", "%%") + "/%j.out"  # sbatch expands %<letter> in the path, %% is a %
        script = sbatch_script(cfg, topology, overrides, workdir=os.getcwd(), output=output)
    except ERRORS as exc:  # one line and exit 2, as in train
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    if dry_run:
        print(script, end="")
        return 0
    slurm_dir.mkdir(parents=True, exist_ok=True)
    # The job's run_id must be its SLURM_JOB_ID; an id exported in this shell would override it.
    env = {k: v for k, v in os.environ.items() if k != "MLPROJECT_RUN_ID"}
    proc = subprocess.run(["sbatch", "--parsable"], input=script, text=True, capture_output=True, env=env)
    if proc.returncode != 0:
        print(f"error: sbatch refused the job: {proc.stderr.strip()}", file=sys.stderr)
        return 1
    job = proc.stdout.strip().split(";")[0]  # "<job id>[;<cluster>]"
    run_dir = Path(cfg.paths.log_dir).resolve() / cfg.task_name / "runs" / (given_run_id(cfg) or job)
    print(f"submitted SLURM job {job}\n  log: {slurm_dir / (job + '.out')}\n  run directory: {run_dir}")
    return 0


def apply(ns: str, manifest: str, name: str, run_dir: str, dry_run: bool) -> int:
    """Print the manifest (--dry-run), or give it to `kubectl apply -f -` and say how to follow the job."""
    if dry_run:
        print(manifest, end="")
        return 0
    if not shutil.which("kubectl"):
        print(
            "error: kubectl not found; install it, or write the manifest with --dry-run and apply it", file=sys.stderr
        )
        return 1
    proc = subprocess.run(["kubectl", "apply", "-f", "-"], input=manifest, text=True, capture_output=True)
    if proc.returncode != 0:
        print(f"error: kubectl apply refused the TrainJob: {proc.stderr.strip()}", file=sys.stderr)
        return 1
    print(
        f"applied TrainJob {name} in namespace {ns} with `kubectl apply -f -`:\n{proc.stdout.rstrip()}\n"
        f"  watch: kubectl get trainjob {name} -n {ns} -w\n"
        f"  logs:  kubectl logs -n {ns} -f -l {kubernetes.JOBSET_NAME}={name}\n"
        f"  run directory: {run_dir} (on the shared volume)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
