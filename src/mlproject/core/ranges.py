"""The allowed range of every numeric setting, checked on the composed config before anything is built.

One table instead of a chain of ifs: a new rule is one line. A key the config does not have (another model,
another dataset) or that is null (off) is skipped; ints and floats are checked, anything else ("auto",
lists) is left to the check that knows it.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from mlproject.core.errors import ConfigError


@dataclass(frozen=True)
class Range:
    low: float | None = None  # inclusive, unless open
    high: float | None = None  # inclusive, unless open
    open: bool = False  # exclusive bounds: e.g. a learning rate must be > 0, not >= 0

    def holds(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.open else value >= self.low)
        below = self.high is None or (value < self.high if self.open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        low, high = (">", "<") if self.open else (">=", "<=")
        parts = [
            f"{low} {self.low:g}" if self.low is not None else "",
            f"{high} {self.high:g}" if self.high is not None else "",
        ]
        return " and ".join(p for p in parts if p)


COUNT, POSITIVE, FRACTION = Range(1), Range(0, open=True), Range(0, 1)
RANGES: dict[str, Range] = {
    "seed": Range(0),
    "data.batch_size": COUNT,
    "data.num_workers": Range(0),
    "data.block_size": COUNT,
    "data.val_size": COUNT,
    "data.test_size": COUNT,
    "data.val_fraction": Range(0, 1, open=True),
    "data.test_fraction": Range(0, 1, open=True),
    "trainer.devices": COUNT,
    "trainer.num_nodes": COUNT,
    "trainer.max_epochs": Range(-1),  # -1: no limit (Lightning)
    "trainer.min_epochs": Range(0),
    "trainer.accumulate_grad_batches": COUNT,
    "trainer.gradient_clip_val": Range(0),
    "trainer.check_val_every_n_epoch": COUNT,
    "trainer.log_every_n_steps": COUNT,
    "trainer.num_sanity_val_steps": Range(-1),
    "model.num_classes": Range(2),
    "model.net.dropout": Range(0, 1),
    "model.net.channels": COUNT,
    "model.net.vocab_size": COUNT,
    "model.net.n_layer": COUNT,
    "model.net.n_head": COUNT,
    "model.net.n_embd": COUNT,
    "model.optimizer.lr": POSITIVE,
    "model.optimizer.weight_decay": Range(0),
    "model.optimizer.base_batch_size": COUNT,
    "model.scheduler.warmup_steps": Range(0),
    "model.scheduler.warmup_fraction": FRACTION,
    "model.scheduler.min_lr_ratio": FRACTION,
    "strategy.timeout": POSITIVE,
    "cluster.collective_timeout_s": POSITIVE,
    # feature: tensor
    "strategy.tensor_parallel_size": COUNT,
    # /feature: tensor
    "cluster.signal_check_every_n_steps": COUNT,
    # feature: planner
    "cluster.gpu_memory_gb": POSITIVE,
    # /feature: planner
    "callbacks.last_checkpoint.every_n_train_steps": COUNT,
    "callbacks.model_checkpoint.save_top_k": Range(-1),
    "callbacks.ema.decay": FRACTION,
}


def check_ranges(cfg) -> None:
    """Refuse the first value outside its range, in one line naming the key, the value and the range."""
    for key, allowed in RANGES.items():
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not allowed.holds(value):
            raise ConfigError(f"{key}={value} is out of range: it must be {allowed}")
