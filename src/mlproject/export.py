"""Export a checkpoint: `python -m mlproject.export ckpt_path=... out=model.pt`.

Any checkpoint this template writes (a single file from single/ddp, a sharded directory from fsdp, hsdp, ...: any
format of checkpoint/convert.py) becomes one file `{"state_dict": <the bare network's weights>, "config": <the run's
resolved config>}` that needs neither Lightning nor this package to read:

    ckpt = torch.load("model.pt", weights_only=True)
    net = hydra.utils.instantiate(ckpt["config"]["model"]["net"])
    net.load_state_dict(ckpt["state_dict"])

`out=model.safetensors` writes a safetensors file instead, with the same keys and the config as JSON in its
metadata:

    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open("model.safetensors", "pt") as f:
        config = json.loads(f.metadata()["config"])
    net = hydra.utils.instantiate(config["model"]["net"])
    net.load_state_dict(load_file("model.safetensors"))

The weights are the EMA where the run kept one (callbacks=ema): the weights it validated; `ema=false`
exports the raw ones. `out` goes into a directory that exists (checked before the checkpoint is read).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from omegaconf import DictConfig

from mlproject.cli import hydra_entry
from mlproject.core.errors import ConfigError


def check_out(out: str) -> None:
    """`out` must name a file in a directory that exists, checked before the checkpoint is read. A missing
    directory is refused, not made: it is more often a typo than a wish, and a made one would be left behind."""
    path = Path(str(out))
    parent = path.parent
    if path.is_dir():
        raise ConfigError(f"out={out} is a directory; name the file to write, e.g. out={path / 'model.pt'}")
    if not parent.is_dir():
        raise ConfigError(
            f"out={out}: the directory {parent} does not exist; create it (mkdir -p {shlex.quote(str(parent))}) "
            "or give out= a file in an existing one"
        )


@hydra_entry("export")
def main(cfg: DictConfig) -> None:
    from mlproject.checkpoint.convert import export

    check_out(cfg.out)
    export(cfg.ckpt_path, cfg.out, cfg.module, cfg.ema)
    print(f"wrote {cfg.out}")


if __name__ == "__main__":
    main()
