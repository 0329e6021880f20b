"""Every option of every config group composes and instantiates."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from mlproject.build import instantiate_all, instantiate_at
from mlproject.core.constants import CONFIG_DIR, PROJECT_ROOT
from mlproject.core.ranges import check_ranges
from mlproject.core.topology import global_batch


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


GROUP_OPTIONS = [
    (g, o)
    for g in (
        "data",
        "model",
        "trainer",
        "strategy",
        "callbacks",
        "logger",
        "cluster",
        "debug",
        "experiment",
        "hparams_search",
    )
    for o in options(g)
]


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_option_composes_and_instantiates(compose_cfg, group, option, monkeypatch):
    # feature: wandb
    monkeypatch.setenv("WANDB_MODE", "offline")
    # /feature: wandb
    cfg = compose_cfg(f"{group}={option}", "trainer.accelerator=cpu")
    OmegaConf.resolve(cfg)  # every interpolation resolves
    check_ranges(cfg)  # every default is within its declared range
    datamodule = instantiate(cfg.data)
    model = instantiate_at(cfg, "model")  # as train builds it: Hydra's semantics, `_recursive_` of the yaml
    assert sum(p.numel() for p in model.parameters()) > 0
    callbacks = instantiate_all(cfg, "callbacks")
    loggers = instantiate_all(cfg, "logger")
    assert len(callbacks) == len([c for c in (cfg.get("callbacks") or {}).values() if "_target_" in c])
    if group == "logger":
        assert len(loggers) == len(cfg.logger) == (len(options("logger")) - 1 if option == "many" else 1)  # many: all
    trainer = instantiate(
        cfg.trainer,
        strategy=instantiate(cfg.strategy),
        callbacks=callbacks,
        logger=loggers or False,
        devices=1,
    )
    assert trainer.max_epochs == cfg.trainer.max_epochs
    if global_batch(cfg.data):  # the template's DataModule; a plain one keeps its batch size where it likes
        assert datamodule.batch_size == cfg.data.batch_size


def test_eval_config_composes(compose_cfg):
    cfg = compose_cfg("ckpt_path=x.ckpt", config_name="eval")
    OmegaConf.resolve(cfg)
    assert cfg.task_name == "eval" and cfg.ckpt_path == "x.ckpt"


def test_every_config_key_has_a_comment():
    """A user may change any key of the template's configs: each one says what it does, on its own line or the
    line above. The template's house style, checked where it is developed (copier.yml, which a project made from
    it does not have): a project's configs, the user's own among them, are as its author writes them."""
    if not (PROJECT_ROOT / "copier.yml").exists():
        pytest.skip("the comment rule is the template's house style, checked in the template's repository")
    missing = []
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            body = line.split("#")[0].rstrip()
            if not body or body.lstrip().startswith("-") or body.endswith(":") or "_target_" in body:
                continue  # section headers, list items and targets explain themselves
            if "#" not in line and not (i and lines[i - 1].strip().startswith("#")):
                missing.append(f"{path.relative_to(CONFIG_DIR)}:{i + 1}: {line.strip()}")
    assert not missing, "keys without a comment:\n" + "\n".join(missing)
