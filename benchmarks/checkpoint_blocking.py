"""How long a checkpoint save holds the training loop, sync vs async (callbacks.model_checkpoint.async_save),
for the GPT example at two sizes: `python benchmarks/checkpoint_blocking.py [strategy] [devices]`.

Each run trains a few steps with a save every 2 steps and reports the median of what ModelCheckpoint logs
at the end of fit (the time inside each save, on rank 0)."""

from __future__ import annotations

import re
import sys
import tempfile

from tests.helpers.processes import run

SIZES = {  # name -> overrides; parameters: ~0.8M and ~25M (checkpoint with AdamW moments: ~10 MB, ~300 MB)
    "gpt 4x128": ["model.net.n_layer=4", "model.net.n_embd=128"],
    "gpt 8x512": ["model.net.n_layer=8", "model.net.n_embd=512", "model.net.n_head=8"],
}
COMMON = [
    "experiment=gpt",
    "extras.print_config=false",
    "trainer=cpu",
    "logger=csv",
    "test=false",
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=12",
    "+trainer.limit_val_batches=1",
    "data.batch_size=8",
    "data.block_size=64",
    "callbacks.last_checkpoint.every_n_train_steps=2",
]
LINE = re.compile(r"(\d+) checkpoint save\(s\) \((\w+)\) held training (\d+) ms each \(median\), ([\d.]+) s in all")


def main(strategy: str = "single", devices: int = 1) -> None:
    print("| model | strategy | saves | sync: blocked per save | async: blocked per save |")
    print("|---|---|---|---|---|")
    for name, size in SIZES.items():
        found = {}
        for mode in ("false", "true"):
            with tempfile.TemporaryDirectory() as logs:
                proc = run(
                    "train",
                    *COMMON,
                    *size,
                    f"strategy={strategy}",
                    f"trainer.devices={devices}",
                    f"callbacks.model_checkpoint.async_save={mode}",
                    log_dir=logs,
                    timeout=1800,
                )
            saves, _, ms, _ = LINE.findall(proc.stdout + proc.stderr)[0]
            found[mode] = (saves, ms)
        print(
            f"| {name} | {strategy} x{devices} | {found['false'][0]} | {found['false'][1]} ms | {found['true'][1]} ms |"
        )


if __name__ == "__main__":
    main(*sys.argv[1:2], *[int(a) for a in sys.argv[2:3]])
