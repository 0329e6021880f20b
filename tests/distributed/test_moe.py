"""A mixture-of-experts GPT trains the same on one process, under DDP and FSDP, and with its experts split over
processes (expert parallelism: tokens travel to their expert's rank and back by all-to-all), alone and
composed with FSDP and with tensor parallelism.

Every run is a real `python -m mlproject.train` with gloo processes, fp32, the same seed and GLOBAL batch
(test_model_parallel.py's tiny GPT with 4 experts per block, top-2). Compared with the single process:
the loss of every step (cross-entropy plus the router losses, whose expert loads are counted over the
global batch), the final parameters and the test metrics; and what each rank holds, measured and planned.
"""

from __future__ import annotations

import csv

import pytest

from tests.distributed.test_model_parallel import LOSS_RTOL, PARAM_ATOL, TINY, start_runs
from tests.helpers.gpt import RARE, assert_trains_like

MOE = [*TINY, "model=gpt_moe", "trainer.log_every_n_steps=2"]  # step metrics (the expert loads) every 2nd step
STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp", "trainer.devices=2"],  # expert loads summed over the world
    "fsdp": ["strategy=fsdp", "trainer.devices=2"],
    # feature: expert
    "ep2": ["strategy=fsdp", "trainer.devices=2", "strategy.expert_parallel_size=2"],
    "ep2_fsdp2": ["strategy=fsdp", "trainer.devices=4", "strategy.expert_parallel_size=2"],
    # feature: tensor
    # TP splits attention; each TP pair routes the same tokens to the same expert ranks (the experts are not
    # TP-split: their work is repeated within the pair, which is the price of composing the two)
    "ep2_tp2": [
        "strategy=fsdp_tp",
        "trainer.devices=4",
        "strategy.tensor_parallel_size=2",
        "strategy.expert_parallel_size=2",
    ],
    # /feature: tensor
    # /feature: expert
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
def test_expert_loads_are_logged(runs):
    """train/moe/load/layer<i>/expert<e>: expert e's share of layer i's routed token slots (k = 2 distinct experts
    per token) in the global batch of 8 x 32 tokens: a multiple of 1/512, at most 1/2 (an expert takes a token
    once), a layer's 4 shares sum to 1 (measured: by step 3 the routing of a layer may collapse onto 2 experts
    at 1/2 each). Every 2nd of the 6 steps; DDP (and EP 2 x FSDP 2) count the same global batch, so they log the
    single process's shares."""
    single = expert_loads(runs["single"])
    assert set(single) == {1, 3, 5}
    for shares in single.values():
        assert len(shares) == 2 * 4  # 2 blocks of 4 experts
        for layer in (0, 1):
            layer_shares = [shares[f"train/moe/load/layer{layer}/expert{e}"] for e in range(4)]
            assert sum(layer_shares) == pytest.approx(1)
            assert all(0 <= s <= 1 / 2 and s * 512 == pytest.approx(round(s * 512), abs=1e-3) for s in layer_shares)
    for name in ("ddp", "ep2_fsdp2"):
        if name in runs:
            assert expert_loads(runs[name]) == single, name


def expert_loads(run: dict) -> dict[int, dict[str, float]]:
    """step -> the expert loads the run's CSV logger wrote at that step."""
    (logged,) = run["run_dir"].rglob("metrics.csv")
    rows = [r for r in csv.DictReader(logged.open()) if r.get("train/moe/load/layer0/expert0")]
    return {int(r["step"]): {k: float(v) for k, v in r.items() if k.startswith("train/moe/load/")} for r in rows}


# feature: expert
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
    # feature: tensor
    assert max(runs["ep2_tp2"]["footprint"]) < min(runs["ep2"]["footprint"])  # TP also splits the attention
    # /feature: tensor


# /feature: expert
# feature: planner
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_planner_predicts_every_rank_to_the_byte(runs, compose_cfg, name):
    from mlproject.plan import estimate

    cfg = compose_cfg(*MOE, *STRATEGIES[name])
    measured = runs[name]["footprint"]
    planned = [(row := estimate(cfg, rank=rank)).params + row.optimizer for rank in range(len(measured))]
    assert sorted(planned) == sorted(measured)


# /feature: planner
