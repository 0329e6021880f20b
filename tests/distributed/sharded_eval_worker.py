"""One rank of an evaluation under a sharding strategy (started by tests.conftest.launch): validate the
template's model, built from Hydra overrides, and write this rank's metrics to <out>/rank<r>.json.
With one process it also writes the metrics computed directly over the whole split (the reference)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torchmetrics.functional.classification import multiclass_accuracy

from mlproject.build import instantiate_at
from mlproject.core.constants import CONFIG_DIR, IGNORE_INDEX
from mlproject.core.resolvers import register_resolvers
from mlproject.training.loaders import with_template_samplers


def direct(model, dataset) -> dict[str, float]:
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    y = torch.stack([dataset[i][1] for i in range(len(dataset))])
    with torch.no_grad():
        logits = model.eval()(x).flatten(0, -2).double()
    target = y.flatten()
    classes = logits.shape[-1]
    return {
        "acc": multiclass_accuracy(logits, target, num_classes=classes, average="micro").item(),
        "loss": F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX).item(),
        "samples": float(len(y)),
    }


def main(out: str, *overrides: str) -> None:
    warnings.filterwarnings("ignore")
    register_resolvers()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", [f"paths.output_dir={out}", "trainer.accelerator=cpu", *overrides])
    L.seed_everything(0)
    datamodule = with_template_samplers(instantiate(cfg.data))
    model = instantiate_at(cfg, "model")  # as train builds it (the plan is the strategy's)
    result = {}
    if world == 1:
        datamodule.setup()
        result["reference"] = direct(model, datamodule.val_set)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=instantiate(cfg.strategy),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    result["val"] = {k.split("/")[1]: v for k, v in trainer.validate(model, datamodule, verbose=False)[0].items()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # After validate-only FSDP2 on gloo, torch 2.13's interpreter teardown sometimes aborts ("terminate
    # called without an active exception", ~1 run in 10) although everything above completed: skip it.
    sys.stdout.flush()
    os._exit(0)


def compare(tmp_path: Path, strategy: str, overrides: list[str]) -> tuple[dict, dict]:
    """Run this worker on 1 process (direct reference) and on 2 under `strategy`, started together; both
    ranks must agree. Returns (what 2 processes logged, the reference)."""
    from tests.helpers.processes import launch, together

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    together(
        lambda: launch(Path(__file__), str(one), *overrides, world=1),
        lambda: launch(Path(__file__), str(two), f"strategy={strategy}", "trainer.devices=2", *overrides, world=2),
    )
    want = json.loads((one / "rank0.json").read_text())["reference"]
    ranks = [json.loads((two / f"rank{r}.json").read_text())["val"] for r in range(2)]
    assert ranks[0] == ranks[1], "ranks disagree on a synced metric"
    return {k: ranks[0][k] for k in want}, want


if __name__ == "__main__":
    main(*sys.argv[1:])
