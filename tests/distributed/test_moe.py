"""A mixture-of-experts GPT trains the same on one process, under DDP and FSDP, and with its experts split over
processes (expert parallelism: tokens travel to their expert's rank and back by all-to-all), alone and
composed with FSDP and with tensor parallelism.

Every run is a real `python -m mlproject.train` with gloo processes, fp32, the same seed and GLOBAL batch
(test_model_parallel.py's tiny GPT with 4 experts per block, top-2). Compared with the single process:
the loss of every step (cross-entropy plus the router losses, whose expert loads are counted over the
global batch), the final parameters and the test metrics; and what each rank holds, measured and planned.
"""

from __future__ import annotations

import pytest

from tests.distributed.test_model_parallel import LOSS_RTOL, PARAM_ATOL, TINY, start_runs
from tests.helpers.gpt import RARE, assert_trains_like

MOE = [*TINY, "model=gpt_moe"]
STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp", "trainer.devices=2"],  # expert loads summed over the world
    "fsdp": ["strategy=fsdp", "trainer.devices=2"],
    "ep2": ["strategy=fsdp", "trainer.devices=2", "strategy.expert_parallel_size=2"],
    "ep2_fsdp2": ["strategy=fsdp", "trainer.devices=4", "strategy.expert_parallel_size=2"],
    # TP splits attention; each TP pair routes the same tokens to the same expert ranks (the experts are not
    # TP-split: their work is repeated within the pair, which is the price of composing the two)
    "ep2_tp2": [
        "strategy=fsdp_tp",
        "trainer.devices=4",
        "strategy.tensor_parallel_size=2",
        "strategy.expert_parallel_size=2",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    return start_runs(tmp_path_factory, MOE, STRATEGIES)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test waits for all runs
@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "single"])
def test_same_training_as_one_process(runs, name):
    assert_trains_like(runs[name], runs["single"], LOSS_RTOL, PARAM_ATOL, rare=RARE)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_rank_holds_its_experts(runs):
    """Per-rank parameter + optimizer bytes: EP on 2 ranks (the dense part FSDP-sharded over both, each rank
    2 of the 4 experts) holds half the model; EP 2 x FSDP 2 on 4 ranks (each expert also sharded over 2) a
    quarter; EP 2 x TP 2 on 4 less than EP 2 alone. Shares are within 2% (FSDP pads rows to a multiple of the
    ranks; step counts are per tensor)."""
    single = runs["single"]["footprint"][0]
    assert len(runs["ep2"]["footprint"]) == 2 and len(runs["ep2_fsdp2"]["footprint"]) == 4
    for rank_bytes in runs["ep2"]["footprint"]:
        assert rank_bytes == pytest.approx(single / 2, rel=0.02)
    for rank_bytes in runs["ep2_fsdp2"]["footprint"]:
        assert rank_bytes == pytest.approx(single / 4, rel=0.02)
    assert max(runs["ep2_tp2"]["footprint"]) < min(runs["ep2"]["footprint"])  # TP also splits the attention


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_planner_predicts_every_rank_to_the_byte(runs, compose_cfg, name):
    from mlproject.plan import estimate

    cfg = compose_cfg(*MOE, *STRATEGIES[name])
    measured = runs[name]["footprint"]
    planned = [(row := estimate(cfg, rank=rank)).params + row.optimizer for rank in range(len(measured))]
    assert sorted(planned) == sorted(measured)
