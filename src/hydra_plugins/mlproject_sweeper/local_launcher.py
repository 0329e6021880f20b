"""The launcher of `hydra/launcher=local`: hydra-submitit-launcher's local launcher, with disjoint devices per trial.

submitit's local launcher starts a batch's trials as processes of their own, all at once, but gives every
one the same GPUs (the first `gpus_per_node`). This subclass hands trial k of a batch its own slice of the
visible devices instead (CUDA_VISIBLE_DEVICES, through Hydra's `hydra.job.env_set`, which the trial sets
before its task runs; its local ranks inherit it), and refuses in one line, before the batch starts, a
batch whose trials need more devices than are visible.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher

from mlproject.core.errors import ConfigError

log = logging.getLogger(__name__)


class DevicesLauncher(LocalLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        from mlproject.core.topology import Topology

        configs = [self.hydra_context.config_loader.load_sweep_config(self.config, list(o)) for o in job_overrides]
        needs = [Topology.of(c).devices_per_node for c in configs]
        pool = visible_devices(str(configs[0].trainer.accelerator))
        if pool is None:  # CPU trials, no device list given: a device is a process, nothing to share out
            return super().launch(job_overrides, initial_job_idx)
        slices = split_devices(pool, needs)
        for n, devices in enumerate(slices, initial_job_idx):
            log.info(f"trial {n}: CUDA_VISIBLE_DEVICES={devices}")
        # quoted: a comma would make Hydra read the value as a sweep of its own
        env = [f"++hydra.job.env_set.CUDA_VISIBLE_DEVICES='{d}'" for d in slices]
        overrides = [[*o, e] for o, e in zip(job_overrides, env, strict=True)]
        return super().launch(overrides, initial_job_idx)


def visible_devices(accelerator: str) -> list[str] | None:
    """The devices a batch of trials shares: CUDA_VISIBLE_DEVICES as given (any accelerator: the user named
    them), else the GPUs torch sees when the trials may use GPUs; None for CPU trials."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    if accelerator == "cpu":
        return None
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else None


def split_devices(pool: list[str], needs: list[int]) -> list[str]:
    """Consecutive, disjoint slices of the pool: trial k gets the `needs[k]` devices after those of 0..k-1."""
    if sum(needs) > len(pool):
        raise ConfigError(
            f"{len(needs)} trials at once need {sum(needs)} devices (trainer.devices={'+'.join(map(str, needs))}) "
            f"but {len(pool)} are visible ({','.join(pool) or 'none'}); lower hydra.sweeper.n_jobs (or "
            "hydra.sweeper.max_batch_size for -m) or trainer.devices"
        )
    starts = [sum(needs[:k]) for k in range(len(needs))]
    return [",".join(pool[s : s + n]) for s, n in zip(starts, needs, strict=True)]
