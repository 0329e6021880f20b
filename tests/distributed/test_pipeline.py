"""Pipeline parallelism (strategy=pp) trains the tiny GPT exactly as one process does, on every schedule and
composed with FSDP and TP; impossible pipelines are refused before any process starts.

As in test_model_parallel.py: real `python -m mlproject.train` runs with gloo processes, fp32, the same seed
and global batch, compared with the single process on the loss of every step, the final parameters (merged
from every stage), the val and test metrics. The GPT has 4 blocks here, so that interleaved_1f1b has 2 stages of
one block per rank.
"""

from __future__ import annotations

import csv

import pytest

from tests.distributed.test_model_parallel import LOSS_RTOL, TINY, start_runs
from tests.helpers.gpt import RARE, assert_trains_like

# validation once, after the 6th (last) step: val/* through the pipeline against the single process's
PIPE = [o for o in TINY if not o.startswith(("model.net.n_layer=", "trainer.limit_val_batches="))]
PIPE += ["model.net.n_layer=4", "trainer.val_check_interval=6"]
# Twice test_model_parallel's: a pipeline sums each gradient over micro-batches, a longer reordering of the
# additions (measured here: <= 5e-6 everywhere but a rare element or two, see RARE).
PARAM_ATOL = 1e-5
PP = ["strategy=pp", "strategy.pipeline_parallel_size=2"]
THROUGHPUT = [  # logged every 2 steps, with the bubble of the schedule
    "+callbacks.throughput._target_=mlproject.callbacks.throughput.Throughput",
    "+callbacks.throughput.samples_per_step=16",
    "trainer.log_every_n_steps=2",
]
STRATEGIES = {
    "single": ["strategy=single"],
    # 8 sequences per data-parallel rank: gpipe in 2 micro-batches of 4, the 1F1B schedules in 4 of 2
    "gpipe": [
        *PP,
        *THROUGHPUT,
        "trainer.devices=2",
        "strategy.pipeline.schedule=gpipe",
        "strategy.pipeline.microbatches=2",
    ],
    "1f1b": [*PP, "trainer.devices=2", "strategy.pipeline.schedule=1f1b", "strategy.pipeline.microbatches=4"],
    "interleaved_1f1b": [
        *PP,
        *THROUGHPUT,
        "trainer.devices=2",
        "strategy.pipeline.schedule=interleaved_1f1b",
        "strategy.pipeline.microbatches=4",
    ],
}
# 2 stages x 2 FSDP shards (4 sequences per data-parallel rank: 2 micro-batches of 2), on every schedule
# (interleaved: 2 stages per rank)
PP_FSDP = [*PP, "trainer.devices=4", "strategy.pipeline.microbatches=2"]
STRATEGIES |= {
    "pp_fsdp": PP_FSDP,
    "pp_fsdp_gpipe": [*PP_FSDP, "strategy.pipeline.schedule=gpipe"],
    "pp_fsdp_interleaved_1f1b": [*PP_FSDP, "strategy.pipeline.schedule=interleaved_1f1b"],
}
REFERENCE = {}  # a run's reference other than single
# feature: tensor
# 2 stages x 2 TP ranks (one data-parallel rank: 4 micro-batches of 2), on every schedule. Clipping by the global
# norm binds under pp: pp x tp (DTensor and plain gradients on 2 stages) clips every step's gradient to a norm of
# 0.05, as one process with the same value does, which ends elsewhere than the single process that clips to 1.0
# (test_clipping_binds)
CLIP = "trainer.gradient_clip_val=0.05"
PP_TP = [*PP, "trainer.devices=4", "strategy.tensor_parallel_size=2", "strategy.pipeline.microbatches=4"]
STRATEGIES |= {
    "pp_tp": [*PP_TP, CLIP],
    "pp_tp_gpipe": [*PP_TP, "strategy.pipeline.schedule=gpipe"],
    "pp_tp_interleaved_1f1b": [*PP_TP, "strategy.pipeline.schedule=interleaved_1f1b"],
    "single_clip": ["strategy=single", CLIP],
}
REFERENCE["pp_tp"] = "single_clip"
# /feature: tensor


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    return start_runs(tmp_path_factory, PIPE, STRATEGIES)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first test waits for all runs
@pytest.mark.parametrize("name", [n for n in STRATEGIES if not n.startswith("single")])
def test_same_training_as_one_process(runs, name):
    # every stage's parameters under the single process's names; evaluation runs through the pipeline too
    ref = runs[REFERENCE.get(name, "single")]
    assert_trains_like(runs[name], ref, LOSS_RTOL, PARAM_ATOL, rare=RARE)
    got, expected = validated(runs[name]), validated(ref)
    assert got.keys() == expected.keys() == {"val/loss", "val/acc", "val/samples"}
    assert got["val/loss"] == pytest.approx(expected["val/loss"], rel=LOSS_RTOL)  # as test/*: assert_trains_like
    assert got["val/acc"] == pytest.approx(expected["val/acc"], abs=1e-3)
    assert got["val/samples"] == expected["val/samples"] > 0  # each validation sequence once


def validated(run: dict) -> dict[str, float]:
    """The val/* metrics of the run's one validation (after its last step), as its CSV logger wrote them."""
    (logged,) = run["run_dir"].rglob("metrics.csv")
    (row,) = [r for r in csv.DictReader(logged.open()) if r.get("val/loss")]
    return {k: float(v) for k, v in row.items() if k.startswith("val/") and v}


# feature: tensor
@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first test waits for all runs
def test_clipping_binds(runs):
    """A norm of 0.05 changes the training (the pp x tp run equals the single process clipping to 0.05, above):
    the gradient's norm exceeds it, which the default 1.0 of the other runs need not."""
    clipped, default = runs["single_clip"], runs["single"]
    assert clipped["losses"][0] == default["losses"][0]  # the same first step: clipping acts after its backward
    moved = max((clipped["state"][k] - v).abs().max().item() for k, v in default["state"].items())
    assert moved > 100 * PARAM_ATOL


# /feature: tensor
@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first test waits for all runs
def test_each_stage_holds_its_share(runs):
    """Per-rank parameter + optimizer bytes: the stages of a pipeline hold the whole model between them, once."""
    (single,) = runs["single"]["footprint"]
    for name in ("gpipe", "1f1b", "interleaved_1f1b"):
        footprint = runs[name]["footprint"]
        assert sum(footprint) == single and max(footprint) < 0.7 * single, name
    # FSDP halves each stage; both shards keep Adam's 4-byte step counter of every parameter (69 of them)
    pp_fsdp = runs["pp_fsdp"]["footprint"]
    assert sum(pp_fsdp) == single + 69 * 4 and max(pp_fsdp) < 0.35 * single
    # feature: tensor
    assert max(runs["pp_tp"]["footprint"]) < min(runs["1f1b"]["footprint"])  # TP splits each stage's blocks too
    # /feature: tensor


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first test waits for all runs
@pytest.mark.parametrize("name, bubble", [("gpipe", 1 / 3), ("interleaved_1f1b", 1 / 9)])
def test_throughput_reports_the_bubble(runs, name, bubble):
    """(P - 1) / (V M + P - 1): P = 2 stages, M = 2 micro-batches (gpipe) or V = 2 stages per rank of M = 4."""
    (logged,) = runs[name]["run_dir"].rglob("metrics.csv")
    rows = [r for r in csv.DictReader(logged.open()) if r.get("perf/pipeline_bubble")]
    assert {int(r["step"]) for r in rows} == {3, 5}  # every 2nd of 6 steps, after the first interval
    assert all(float(r["perf/pipeline_bubble"]) == pytest.approx(bubble) for r in rows)
    assert all(float(r["perf/samples_per_sec"]) > 0 for r in rows)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.net.n_layer=3"], "does not divide into 2 pipeline stages"),
        (["strategy.pipeline.schedule=interleaved_1f1b"], "does not divide into 4 pipeline stages"),
        (["strategy.pipeline.microbatches=1"], "1f1b needs at least 2"),
        (["strategy.pipeline.microbatches=3"], "do not divide into strategy.pipeline.microbatches=3"),
        (["trainer.accumulate_grad_batches=2"], "accumulate_grad_batches must be 1"),
        (["strategy.fsdp=null"], "runs on FSDP"),
        (["trainer.devices=3"], "must divide the 3 process(es)"),
    ],
)
def test_impossible_pipelines_refused(compose_cfg, overrides, message):
    """trainer=cpu: preflight only, no process starts."""
    from mlproject.core.errors import ConfigError
    from mlproject.preflight import preflight

    base = ["model=gpt", "data=text", "trainer=cpu", "data.batch_size=8", "model.net.n_layer=2", *PP]
    cfg = compose_cfg(*base, "trainer.devices=2", *overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preflight(cfg)


# feature: planner
@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first test waits for all runs
@pytest.mark.parametrize(
    "name", ["gpipe", "1f1b", "interleaved_1f1b", "pp_fsdp", *(["pp_tp"] if "pp_tp" in STRATEGIES else [])]
)
def test_planner_predicts_every_rank_to_the_byte(runs, compose_cfg, name):
    """mlproject.plan on a fake process group: rank r is on stage r // (world / P), holds that stage's modules only,
    sharded over its data-parallel ranks (pp_fsdp) or split by TP (pp_tp), against the footprint of the real run."""
    from mlproject.plan import estimate

    cfg = compose_cfg(*PIPE, *STRATEGIES[name])
    measured = runs[name]["footprint"]
    planned = [(row := estimate(cfg, rank=rank)).params + row.optimizer for rank in range(len(measured))]
    assert sorted(planned) == sorted(measured)  # the logs of the ranks are read in no particular order


# /feature: planner
