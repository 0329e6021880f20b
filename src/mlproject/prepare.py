"""Prepare a dataset ahead of training: `python -m mlproject.prepare data=tokens data.source='...'`.

Runs the datamodule's `prepare_data()` in this process, as the first training run on a node would, from
the same data config (so training finds the manifest and starts at once). Run it on each node whose
data.dir is node-local, or once where it is shared; nothing is redone while the manifest matches and the files
still match it (a damaged preparation, which a run refuses, is made again here). For a
corpus that takes longer to prepare than `strategy.timeout`, this is the way: inside a job the node's
other ranks wait for the preparation in a barrier with that timeout.
"""

from __future__ import annotations

from omegaconf import DictConfig

from mlproject.cli import hydra_entry, run_as_process


@hydra_entry("prepare")
def main(cfg: DictConfig) -> None:
    from mlproject.build import instantiate_at

    instantiate_at(cfg, "data").prepare_data()
    print(f"prepared: {cfg.data.get('dir', 'nothing to prepare for this dataset')}")


if __name__ == "__main__":
    run_as_process(main)
