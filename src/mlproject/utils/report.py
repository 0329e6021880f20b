"""What a run tells the world: config tree, hyperparameters, final metrics table and metrics.json."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mlproject.utils.rank_logging import drop_lightning_console_handler, get_logger, rank

log = get_logger(__name__)


# Third-party warnings that are understood and not the user's to act on: (message regex, category, why). Every
# other warning shows. pyproject.toml's pytest filterwarnings names the same ones.
KNOWN_WARNINGS = [
    # torchdata's StatefulDataLoader calls torch.set_vital, deprecated in torch 2.13; nothing to change on our side
    (r"'set_vital' is deprecated", UserWarning),
    # Lightning 2.6's own pytree helper (lightning/pytorch/utilities/_pytree.py) builds torch's LeafSpec, deprecated in
    # torch 2.13; fixed upstream by a Lightning release, not by us
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # feature: mlflow
    # logger=mlflow: MLflow's SQLite store configures a SQLAlchemy loader strategy that SQLAlchemy 2.1 deprecates
    (r"The ``noload`` loader strategy is deprecated", DeprecationWarning),
    # /feature: mlflow
]


def filter_known_warnings() -> None:
    for message, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def apply_extras(cfg: DictConfig) -> None:
    """Optional start-of-run conveniences from configs/extras/."""
    drop_lightning_console_handler()
    extras = cfg.get("extras") or {}
    filter_known_warnings()
    if extras.get("ignore_warnings"):
        warnings.filterwarnings("ignore")
    if extras.get("print_config") and rank() == 0:
        print_config_tree(cfg)


def print_config_tree(cfg: DictConfig) -> None:
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("config", guide_style="dim")
    for key, value in cfg.items():
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        tree.add(str(key)).add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark"))
    rich.print(tree)


def log_hyperparameters(cfg: DictConfig, model, trainer) -> None:
    """Send the resolved config and parameter counts to every logger (loggers write on rank 0 only)."""
    if not trainer.loggers:
        return
    hparams = OmegaConf.to_container(cfg, resolve=True)
    hparams["model/params/total"] = sum(p.numel() for p in model.parameters())
    hparams["model/params/trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)


def log_outcome(cfg: DictConfig, trainer, metrics: dict[str, float], best_checkpoint: str) -> None:
    """The run's outcome to every logger, each in the form it shows: the best checkpoint's path, and the
    final test metrics. Lightning logged those as metrics during test; TensorBoard also gets them beside the
    config, for its HParams view. A logger of ours with its own form has `log_outcome` (mlproject/loggers/).
    Rank 0: the loggers write there."""
    if rank() != 0 or not trainer.loggers:
        return
    from lightning.pytorch.loggers import TensorBoardLogger

    test = {k: v for k, v in metrics.items() if k.startswith("test/")}
    best = {"best_checkpoint": best_checkpoint} if best_checkpoint else {}
    for logger in trainer.loggers:
        if callable(log := getattr(type(logger), "log_outcome", None)):
            log(logger, best)
        elif isinstance(logger, TensorBoardLogger):
            hparams = OmegaConf.to_container(cfg, resolve=True)
            logger.log_hyperparams({**hparams, **best}, metrics=test, step=trainer.global_step)
        else:  # csv: beside the config in hparams.yaml
            logger.log_hyperparams(best)


def write_metrics(metrics: dict, run_dir: str | Path, prefix: tuple[str, ...] = ("val/", "test/")) -> dict[str, float]:
    """Write `metrics.json` (name -> float) in the run directory: the final validation's and the test's metrics;
    rank 0 writes, atomically."""
    values = {k: float(v) for k, v in sorted(metrics.items()) if k.startswith(prefix)}
    if rank() == 0:
        path = Path(run_dir) / "metrics.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(values, indent=2) + "\n")
        os.replace(tmp, path)
    return values


def print_summary(values: dict[str, float], run_dir: str | Path) -> None:
    """A small table of the final metrics and where the run lives (rank 0)."""
    if rank() != 0:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="final metrics", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in values.items():
        table.add_row(name, f"{value:.4f}")
    console = Console()
    console.print(table)
    console.print(f"run directory: {run_dir}")
