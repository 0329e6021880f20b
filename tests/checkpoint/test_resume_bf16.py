"""Kill and resume under trainer.precision=bf16-mixed ends bitwise equal to a straight bf16 run.

Lightning's bf16 plugin has no loss scaler (bf16 has fp32's range), so the checkpoint needs nothing beyond
fp32's to resume exactly; this proves it, on the same machinery as the fp32 test.
"""

from __future__ import annotations

import pytest

from tests.checkpoint.helpers import strategy
from tests.checkpoint.test_resume import straight_vs_interrupted


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 5 processes, 3 at a time
def test_single_bf16_resume_is_bitwise(tmp_path):
    setup = [*strategy("single"), "trainer.precision=bf16-mixed"]
    straight_vs_interrupted(tmp_path, setup, kill_rank=None, mid_kill_rank=None)
