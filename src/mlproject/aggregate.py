"""After a multirun (k-fold, seeds): cv.json in hydra.sweep.dir with each trial's metrics and their mean and std."""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class Aggregate(Callback):
    """A Hydra callback: when a multirun ends, reads every trial's metrics.json (trial k in hydra.sweep.dir/k)
    and writes cv.json: `folds` (one entry per trial: its number, overrides and metrics) and `mean` and
    `std` (sample standard deviation, n-1) per metric over the trials that have it."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        folds = []
        for trial in sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
            if (trial / "metrics.json").exists():
                overrides = (trial / ".hydra" / "overrides.yaml").read_text().splitlines()
                metrics = json.loads((trial / "metrics.json").read_text())
                overrides = [o.removeprefix("- ") for o in overrides]
                folds.append({"trial": int(trial.name), "overrides": overrides, "metrics": metrics})
        if len(folds) < 2:
            return
        names = sorted({k for f in folds for k in f["metrics"]})
        values = {k: [f["metrics"][k] for f in folds if k in f["metrics"]] for k in names}
        summary = {
            "folds": folds,
            "mean": {k: statistics.fmean(v) for k, v in values.items()},
            "std": {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in values.items()},
        }
        (sweep_dir / "cv.json").write_text(json.dumps(summary, indent=2))
        log.info(f"cv.json: mean and std of {len(names)} metrics over {len(folds)} trials in {sweep_dir}")
