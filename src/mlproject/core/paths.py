"""Which paths may be URLs: every path names a local or shared-filesystem folder, unless refuse_url_paths lets it
through."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from mlproject.core.errors import ConfigError

# The folders a run writes or reads with plain file calls (Hydra's run directory, loggers, datasets): a URL there
# becomes a local folder named after its scheme. hydra.* is only in the config Hydra's callbacks see, before it makes
# the folder.
LOCAL_ONLY = (
    "paths.root_dir",
    "paths.data_dir",
    "paths.log_dir",
    "paths.output_dir",
    "hydra.run.dir",
    "hydra.sweep.dir",
)


def is_url(path: object) -> bool:
    """An fsspec URL other than a local file (gs://bucket/key, memory://...)."""
    return "://" in str(path) and not str(path).startswith("file://")


def refuse_url_paths(cfg: DictConfig) -> None:
    """Refuse a URL in any path a run reads or writes (LOCAL_ONLY and `paths.ckpt_dir`), in one line pointing to it."""
    for key in (*LOCAL_ONLY, "paths.ckpt_dir"):
        # feature: object_storage
        if key == "paths.ckpt_dir":
            continue  # checkpoints may be in object storage, through fsspec (checkpoint/object_storage.py)
        # /feature: object_storage
        # paths.output_dir reads Hydra's runtime, which is not set yet when Hydra's callbacks run: that value
        # is hydra.run.dir's, checked here too
        value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        if is_url(value):
            raise ConfigError(
                f"{key}={value} is a URL"  # taken as a path: a local folder named after its scheme
                # feature: object_storage
                ", but only paths.ckpt_dir may be one: logs, metrics and data are written to local folders"
                # /feature: object_storage
                f"; give {key} a local or shared-filesystem path"
                # feature: object_storage
                " and set paths.ckpt_dir=s3://<bucket>/<prefix> to keep checkpoints in object storage"
                # /feature: object_storage
            )
