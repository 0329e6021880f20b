"""Which paths may be URLs: only `paths.ckpt_dir` (object storage, through fsspec); every other path names a local
or shared-filesystem folder."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from mlproject.core.errors import ConfigError

# The folders a run writes or reads with plain file calls (Hydra's run directory, loggers, datasets): a URL there
# becomes a local folder named `s3:`. hydra.* is only in the config Hydra's callbacks see, before it makes the folder.
LOCAL_ONLY = (
    "paths.root_dir",
    "paths.data_dir",
    "paths.log_dir",
    "paths.output_dir",
    "hydra.run.dir",
    "hydra.sweep.dir",
)


def is_url(path: object) -> bool:
    """An fsspec URL other than a local file (s3://bucket/key, gs://..., memory://...)."""
    return "://" in str(path) and not str(path).startswith("file://")


def refuse_url_paths(cfg: DictConfig) -> None:
    """Refuse a URL in any path but `paths.ckpt_dir`, in one line pointing to it."""
    for key in LOCAL_ONLY:
        # paths.output_dir reads Hydra's runtime, which is not set yet when Hydra's callbacks run: that value
        # is hydra.run.dir's, checked here too
        value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        if is_url(value):
            raise ConfigError(
                f"{key}={value} is a URL, but only paths.ckpt_dir may be one: logs, metrics and data are written "
                f"to local folders; give {key} a local or shared-filesystem path and set "
                "paths.ckpt_dir=s3://<bucket>/<prefix> to keep checkpoints in object storage"
            )
