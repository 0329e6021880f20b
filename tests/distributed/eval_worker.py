"""One rank of an evaluation job (started by tests.conftest.launch): validate and test a fixed model on
digits splits of several sizes and write this rank's metrics to <out>/rank<r>.json."""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning as L
import torch

from mlproject.data.digits import DigitsDataModule
from mlproject.models.classifier import Classifier
from mlproject.training.loaders import with_template_samplers

VAL_SIZES = [3, 7, 200]  # none below the largest world (3), which EvalBatches refuses
TEST_SIZE = 359  # odd


def fixed_model() -> Classifier:
    torch.manual_seed(0)
    net = {"_target_": "mlproject.models.components.cnn.SmallCNN", "channels": 8}
    return Classifier(net=net, num_classes=10, optimizer={"lr": 1e-3}, scheduler={})


def main(out: str, strategy: str) -> None:
    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", 1))
    results = {}
    for n in VAL_SIZES:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        datamodule = with_template_samplers(DigitsDataModule(batch_size=4 * world, val_size=n, test_size=TEST_SIZE))
        results[f"val{n}"] = trainer.validate(fixed_model(), datamodule=datamodule, verbose=False)[0]
        if n == VAL_SIZES[-1]:
            results["test"] = trainer.test(fixed_model(), datamodule=datamodule, verbose=False)[0]
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # torch 2.13's teardown of a gloo process sometimes aborts after all work is done (sharded_eval_worker)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
