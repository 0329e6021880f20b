"""An out-of-memory error ends the run in one line (rank, step, figures, the fix), with no traceback. On CPU
the error is raised by the module, as CUDA's caching allocator raises it (tests/gpu makes a real one)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from mlproject.callbacks.memory import MemoryHistory
from mlproject.cluster.requeue import EXIT_OOM, Signals


class RunsOutOfMemory(L.LightningModule):
    def __init__(self, at_step: int):
        super().__init__()
        self.layer, self.at_step = torch.nn.Linear(2, 1), at_step

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.at_step:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_out_of_memory_ends_in_one_line(tmp_path, capsys):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)
    history = MemoryHistory(at_step=100)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[history, Signals(every_n_steps=2)],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exit:
        trainer.fit(RunsOutOfMemory(at_step=2), data)
    assert exit.value.code == EXIT_OOM != 0 and exit.value.__cause__ is None
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: out of memory on rank 0 at step 2 (host memory); ")
    # feature: planner
    assert "; `make plan ARGS=" in line
    # /feature: planner
    assert not list(tmp_path.glob("memory_snapshot_rank*.pickle"))  # recording is CUDA's: nothing on CPU
