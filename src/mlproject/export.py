"""Export a checkpoint: `python -m mlproject.export ckpt_path=... out=model.pt`.

Any checkpoint this template writes (a single file from single/ddp, a sharded directory from fsdp/tp, a
DeepSpeed directory) becomes one file `{"state_dict": <the bare network's weights>, "config": <the run's
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
exports the raw ones.
"""

from __future__ import annotations

from omegaconf import DictConfig

from mlproject.cli import hydra_entry


@hydra_entry("export")
def main(cfg: DictConfig) -> None:
    from mlproject.checkpoint.convert import export

    export(cfg.ckpt_path, cfg.out, cfg.module, cfg.ema)
    print(f"wrote {cfg.out}")


if __name__ == "__main__":
    main()
