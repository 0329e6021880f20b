"""The marks of a test that needs a CUDA GPU: `pytestmark = requires_gpu` in a GPU test module."""

from __future__ import annotations

import pytest
import torch

requires_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run `make test-gpu` on a GPU machine"),
]
