"""A test-only callback that slows training down without changing what it computes."""

import time

from lightning.pytorch.callbacks import Callback


class SlowSteps(Callback):
    """Sleep after every training batch, so a signal sent during training arrives while it still runs
    (12 tiny steps can otherwise finish before the test's signal is delivered)."""

    def __init__(self, seconds: float = 0.5):
        self.seconds = seconds

    def on_train_batch_end(self, *args) -> None:
        time.sleep(self.seconds)
