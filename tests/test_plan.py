"""The memory planner (mlproject.plan): real layouts on a fake process group, and the layout it recommends.

Its per-rank bytes are proven against real runs in tests/distributed/test_model_parallel.py; here, in one
process: the arithmetic of a known model, 512 ranks in seconds, and the recommendation on a table of cases.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from mlproject import plan as planner
from mlproject.build import meta_model
from mlproject.core.constants import CONFIG_DIR
from mlproject.core.topology import Topology
from tests.helpers.gpt import TINY_GPT

GiB = 2**30
# GPTs of width 768 on windows of 64 tokens: 12 blocks are ~85M parameters (12 x 12 x 768^2, plus embeddings and
# head), 6 blocks ~43M, 24 blocks ~170M
WIDE = ["model=gpt", "data=text", "trainer.accelerator=cpu", "model.net.n_head=8", "model.net.n_embd=768"]
WIDE += ["data.block_size=64"]
GPT_85M = [*WIDE, "model.net.n_layer=12"]
# feature: pipeline
PIPE = ["strategy=pp", "strategy.pipeline_parallel_size=2", "trainer.devices=2"]
# 8 stages of 1F1B on 16 micro-batches: the planner's pipeline on 8 nodes
PP_8 = "strategy=pp strategy.pipeline_parallel_size=8 strategy.pipeline.schedule=1f1b strategy.pipeline.microbatches=16"
# /feature: pipeline


def world(n: int) -> list[str]:
    """n ranks in nodes of 8, 8 sequences per rank."""
    strategy = "strategy=single" if n == 1 else "strategy=ddp"
    return [strategy, f"trainer.devices={min(n, 8)}", f"trainer.num_nodes={max(1, n // 8)}", f"data.batch_size={8 * n}"]


@pytest.fixture(scope="module")
def plans() -> dict[tuple[int, int], planner.Plan]:
    """(blocks, world size) -> the plan of that GPT (memory set per case below)."""
    shapes = [(12, 1), (12, 8), (12, 64), (6, 8), (24, 64)]
    return {(b, n): plan_of(*WIDE, f"model.net.n_layer={b}", *world(n)) for b, n in shapes}


def plan_of(*overrides: str) -> planner.Plan:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        result = planner.plan(list(overrides))
    GlobalHydra.instance().clear()
    return result


def row(plan: planner.Plan, layout: str) -> planner.Row:
    (found,) = [r for r in plan.rows if r.layout == layout]
    return found


def test_adam_costs_16_bytes_per_parameter_under_ddp(plans):
    ddp = row(plans[12, 8], "strategy=ddp")
    n = ddp.params // 4  # fp32
    tensors = 2 + 12 * 16 + 2 + 1  # embeddings, 12 blocks of 8 weights and 8 biases, final norm, head
    assert ddp.grads == 4 * n and ddp.optimizer == 8 * n + 4 * tensors  # two fp32 moments, a step count per tensor
    assert row(plans[12, 8], "strategy=fsdp").states == pytest.approx(ddp.states / 8, rel=0.01)
    assert ddp.activations == row(plans[12, 64], "strategy=ddp").activations  # same micro-batch of 8 sequences
    # feature: deepspeed
    # DeepSpeed's estimators (16-bit mixed precision): ZeRO-2 replicates 16-bit weights (2 bytes per parameter)
    # and shards the other 18; ZeRO-3 shards all 18 and gathers the largest layer (4 bytes per parameter)
    largest = 768 * 3072 + 3072  # an MLP's fc layer, weight and bias
    assert row(plans[12, 8], "strategy=deepspeed_stage_2").states == 2 * n + 18 * n // 8
    assert row(plans[12, 8], "strategy=deepspeed_stage_3").states == 4 * largest + 18 * n // 8
    # /feature: deepspeed


@pytest.mark.parametrize(
    ("blocks", "ranks", "memory_gib", "layout"),
    [
        # 85M on 8 ranks, per rank (GiB): activations 0.66, model states: DDP 1.27, ZeRO-2 0.34, FSDP 0.16 and
        # 0.03 for a block gathered (fp32), ZeRO-3 0.19 (DeepSpeed's 18 bytes a parameter and the largest layer),
        # ZeRO-3 + offload 0.01; a total fits under 90% of the memory
        (12, 8, 3.0, "strategy=ddp"),  # 1.94 fits
        # feature: deepspeed
        (12, 8, 1.5, "strategy=deepspeed_stage_2"),  # DDP does not; ZeRO-2 (1.00) does, with DDP's traffic
        # /feature: deepspeed
        (12, 8, 1.0, "strategy=fsdp"),  # ZeRO-2 does not, FSDP over 8 (0.85) does
        # feature: deepspeed
        (12, 64, 1.5, "strategy=deepspeed_stage_2"),  # more ranks do not make DDP smaller
        # /feature: deepspeed
        # ZeRO-2 over 64 (0.843) does not fit, nor does FSDP in each node of 8 (HSDP, 0.847), FSDP over 64 (0.71) does
        (12, 64, 0.92, "strategy=fsdp"),
        # 170M on 64: ZeRO-2 (1.680) does not fit, HSDP (1.662: a block is 1/24 of the model) does
        (24, 64, 1.855, "strategy=hsdp"),
        # feature: deepspeed
        (12, 8, 0.8, "strategy=deepspeed_stage_3_offload"),  # FSDP over 8 needs 0.85, ZeRO-3 0.85
        (12, 1, 1.5, "strategy=deepspeed_stage_3_offload"),  # one GPU: offload is the only way down
        # /feature: deepspeed
        (12, 1, 3.0, "strategy=single"),
        (12, 8, 0.5, None),  # activations alone need 0.66: nothing fits
        # the model's size flips it on the same cluster: 43M fits DDP (0.97) where 85M needs ZeRO-2 ...
        (6, 8, 1.5, "strategy=ddp"),
        # feature: pipeline
        # ... and 170M (activations 1.32) on 8 nodes a pipeline stage of 3 blocks per node (0.49), where ZeRO-2
        # (1.68) and HSDP (1.66) do not fit; 85M's 12 blocks make no 8 stages, and ZeRO-2 fits it (above)
        (24, 64, 1.5, PP_8),
        # /feature: pipeline
    ],
)
def test_recommendation_flips_where_it_should(plans, blocks, ranks, memory_gib, layout):
    result = dataclasses.replace(plans[blocks, ranks], memory=int(memory_gib * GiB))
    assert (result.recommended.layout if result.recommended else None) == layout


def test_hsdp_across_nodes_tensor_parallel_inside_a_node_and_fsdp_without_a_plan(compose_cfg):
    cfg = compose_cfg(*GPT_85M, *world(64))
    assert planner.candidates(cfg, Topology.of(cfg)) == [
        ["strategy=ddp"],
        # feature: deepspeed
        ["strategy=deepspeed_stage_2"],
        # /feature: deepspeed
        ["strategy=hsdp"],
        ["strategy=fsdp"],
        # feature: tensor
        ["strategy=fsdp_tp", "strategy.tensor_parallel_size=8"],
        # /feature: tensor
        # feature: deepspeed
        ["strategy=deepspeed_stage_3"],
        ["strategy=deepspeed_stage_3_offload"],
        # /feature: deepspeed
    ]
    cfg = compose_cfg("model=digits", *world(8))  # no parallel plan: FSDP shards it whole, no TP
    assert [layout for (layout,) in planner.candidates(cfg, Topology.of(cfg))] == [
        "strategy=ddp",
        # feature: deepspeed
        "strategy=deepspeed_stage_2",
        # /feature: deepspeed
        "strategy=fsdp",
        # feature: deepspeed
        "strategy=deepspeed_stage_3",
        "strategy=deepspeed_stage_3_offload",
        # /feature: deepspeed
    ]


# feature: expert
def test_experts_split_where_the_model_has_them(compose_cfg):
    """model=gpt_moe (4 experts of every block): each FSDP layout comes first with the experts split over 4
    ranks of a node (as many bytes of model states per rank, less traffic and a smaller gather: a rank gathers
    only its own experts' weights). FSDP2 splits a stacked expert tensor by rows, 1 per rank on ranks 0-3 of 8:
    rank 0 holds a quarter of the experts however many ranks shard them."""
    moe = [*WIDE, "model=gpt_moe", "model.net.n_layer=4"]  # ~85M parameters, 75M of them in experts
    ep = "strategy.expert_parallel_size=4"
    cfg = compose_cfg(*moe, *world(64))
    layouts = planner.candidates(cfg, Topology.of(cfg))
    first = layouts.index(["strategy=hsdp", ep])
    assert layouts[first : first + 4] == [
        ["strategy=hsdp", ep],
        ["strategy=hsdp"],
        ["strategy=fsdp", ep],
        ["strategy=fsdp"],
    ]
    result = plan_of(*moe, *world(8))
    split, whole = row(result, f"strategy=fsdp {ep}"), row(result, "strategy=fsdp")
    assert split.states == whole.states
    # The largest unit gathered (fp32), rows padded to the shard group as FSDP2 pads them. Without EP: a block,
    # its 4 experts' two weights padded to 8 rows (1 on each of 8 ranks) and the attention; with EP: one
    # expert module, its rank's expert padded to 2 rows over its shard group of 2
    expert = 2 * 768 * 3072 * 4
    assert split.gathered == 2 * expert and whole.gathered > 8 * expert
    # totals (GiB): ZeRO-2 0.855, FSDP with EP 0.852 and without 0.97, ZeRO-3 0.77; a total fits under 90%
    for memory_gib, layout in [
        (0.948, f"strategy=fsdp {ep}"),
        # feature: deepspeed
        (0.88, "strategy=deepspeed_stage_3"),  # ZeRO-3 splits every tensor evenly: there it fits first
        # /feature: deepspeed
    ]:
        assert dataclasses.replace(result, memory=int(memory_gib * GiB)).recommended.layout == layout


# /feature: expert
def test_512_ranks_in_seconds(compose_cfg):
    cfg = compose_cfg("experiment=gpt_large", "trainer.devices=8", "trainer.num_nodes=64", "data.batch_size=1024")
    start = time.perf_counter()
    fsdp = planner.estimate(cfg)
    assert time.perf_counter() - start < 30
    # FSDP2 gives rank 0 the first ceil(rows / 512) rows of every tensor (fp32)
    full = meta_model(cfg).parameters()
    assert fsdp.params == sum(math.ceil(p.shape[0] / 512) * p[0].numel() * 4 for p in full)


def test_plan_prints_the_table(capsys):
    assert planner.main([*GPT_85M, *world(8), "cluster.gpu_memory_gb=1"]) == 0
    out = capsys.readouterr().out
    assert "per rank of 8; 1.00 GiB per device" in out and "fsdp <- use" in out


# feature: slurm
def test_a_job_that_cannot_fit_is_refused_in_one_line(capsys, no_sbatch):
    from mlproject import submit

    # ~85M parameters: DDP needs 1.3 GiB of model states per GPU, FSDP over 32 GPUs 1/32 of that
    big = ["model=gpt", "data=text", "model.net.n_layer=12", "model.net.n_embd=768", "data.block_size=64"]
    gpus = ["cluster.nodes=4", "cluster.gpus_per_node=8", "trainer=gpu", "strategy=ddp"]
    too_small = [*gpus, *big, "data.batch_size=32", "cluster.gpu_memory_gb=1"]
    assert submit.main(["--dry-run", *too_small]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: strategy=ddp needs" in err and "use strategy=" in err
    # feature: deepspeed
    assert "use strategy=deepspeed_stage_2" in err  # DDP's traffic, the 16-bit weights whole, the rest sharded over 32
    # /feature: deepspeed
    assert submit.main(["--dry-run", "--no-plan", *too_small]) == 0  # the flag skips the plan


# /feature: slurm
# feature: pipeline
def test_a_pipeline_stage_per_node(compose_cfg):
    """Two nodes of 8: pp with a stage per node comes between HSDP and FSDP (1F1B on 2 micro-batches per
    stage), and each of its ranks holds half the blocks sharded over the node: ~1/16 of the model, as FSDP
    over 16 does."""
    two_nodes = ["trainer.devices=8", "trainer.num_nodes=2", "data.batch_size=128"]
    cfg = compose_cfg(*GPT_85M, *two_nodes, "strategy=ddp")
    pp = ["strategy=pp", "strategy.pipeline_parallel_size=2", "strategy.pipeline.schedule=1f1b"]
    layouts = planner.candidates(cfg, Topology.of(cfg))
    hsdp = layouts.index(["strategy=hsdp"])
    assert layouts[hsdp : hsdp + 3] == [
        ["strategy=hsdp"],
        [*pp, "strategy.pipeline.microbatches=4"],
        ["strategy=fsdp"],
    ]
    single = planner.estimate(compose_cfg(*GPT_85M, *world(1)))
    cfg = compose_cfg(*GPT_85M, *two_nodes, *pp, "strategy.pipeline.microbatches=4")
    first, last = (planner.estimate(cfg, rank=rank) for rank in (0, 8))
    assert first.params == pytest.approx(single.params / 16, rel=0.01) == last.params
    cfg = compose_cfg(*GPT_85M, *two_nodes, "strategy=ddp", "model.net.n_layer=11")  # no 2 equal stages
    assert ["strategy=fsdp"] in planner.candidates(cfg, Topology.of(cfg))
    assert not any("strategy=pp" in layout for layout in planner.candidates(cfg, Topology.of(cfg)))


@pytest.mark.parametrize(
    ("schedule", "microbatches", "in_flight"),
    [("gpipe", 2, [2, 2]), ("1f1b", 4, [2, 1]), ("interleaved_1f1b", 4, [5 / 2, 3 / 2])],
)
def test_pipeline_activations_are_the_stages_times_the_micro_batches_in_flight(
    compose_cfg, schedule, microbatches, in_flight
):
    """2 stages on 2 ranks: with one micro-batch the ranks' activations add up to the whole network's (each saved
    tensor counted once, the loss on the last stage); with M, each rank holds a micro-batch of 1/M the batch
    as many times as the schedule keeps in flight: GPipe all M, 1F1B P - rank, interleaved torch's warm-up + 1
    stage forwards (of V M), each one of the rank's V stages."""
    from mlproject.distributed.pipeline import in_flight as forwards

    v = 2 if schedule == "interleaved_1f1b" else 1
    assert [forwards(schedule, 2, microbatches, rank) / v for rank in (0, 1)] == in_flight
    # narrow and long, so that the weights matmuls save (counted once, not per micro-batch) are ~1% of the rest
    small = ["model=gpt", "data=text", "trainer.accelerator=cpu", "model.net.n_layer=4", "model.net.n_embd=32"]
    small += ["data.block_size=64", "data.batch_size=64"]
    single = planner.estimate(compose_cfg(*small, "strategy=single"))
    pipe = [*small, *PIPE, f"strategy.pipeline.schedule={schedule}"]
    one = [planner.estimate(compose_cfg(*pipe, "strategy.pipeline.microbatches=1"), rank=rank) for rank in (0, 1)]
    assert sum(row.activations for row in one) == single.activations
    assert sum(row.params + row.optimizer for row in one) == single.params + single.optimizer
    cfg = compose_cfg(*pipe, f"strategy.pipeline.microbatches={microbatches}")
    for rank, stage in enumerate(one):
        planned = planner.estimate(cfg, rank=rank).activations
        assert planned == pytest.approx(stage.activations / microbatches * in_flight[rank], rel=0.02)


# /feature: pipeline
def test_ema_holds_one_more_copy_of_the_weights(compose_cfg):
    """callbacks.ema clones every trainable parameter, sharded like it: one more params column per rank."""
    small = ["model=gpt", "data=text", "trainer.accelerator=cpu", "model.net.n_layer=2", "model.net.n_embd=32"]
    # feature: deepspeed
    cfg = compose_cfg(*small, *world(8), "callbacks=[default,ema]")
    assert all("deepspeed" not in " ".join(layout) for layout in planner.candidates(cfg, Topology.of(cfg)))  # refused
    # /feature: deepspeed
    for strategy in ("strategy=ddp", "strategy=fsdp"):
        plain = planner.estimate(compose_cfg(*small, *world(8), strategy))
        ema = planner.estimate(compose_cfg(*small, *world(8), strategy, "callbacks=[default,ema]"))
        assert plain.ema == 0 and ema.ema == ema.params == plain.params
        assert ema.states == plain.states + plain.params


@pytest.mark.parametrize(
    ("precision", "gather"),
    [("bf16-mixed", 2), ("bf16-mixed strategy.fsdp.param_dtype=float32", 4), ("16-mixed", 4), ("32-true", 4)],
)
def test_fsdp_holds_fp32_shards_and_gathers_its_largest_unit_in_the_compute_dtype(compose_cfg, precision, gather):
    """The tiny GPT (width 32, 2 blocks, 256 byte ids, windows of 32) under fsdp on 2 ranks, by hand. Its FSDP
    units: each block (norms 2 x 64, q/k/v/proj 4 x (32 x 32 + 32), fc 32 x 128 + 128, proj 128 x 32 + 32) and
    the root, the rest (token and position embeddings 256 x 32 and 32 x 32, the final norm 64, the head 256 x 32).
    Rank 0 keeps half of every tensor (all rows even) in fp32 under mixed precision too (FSDP's master weights),
    with their fp32 gradients, AdamW's two fp32 moments and a 4-byte step count per tensor (37 tensors). The
    root, the largest unit, is gathered whole in bf16 under bf16-mixed (fsdp.param_dtype's default there), else
    in fp32 (under 16-mixed autocast casts each op's inputs; the gather stays fp32)."""
    block = 2 * 64 + 4 * (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
    root = 256 * 32 + 32 * 32 + 64 + 256 * 32
    half, tensors = (root + 2 * block) // 2, 5 + 2 * 16
    overrides = [*TINY_GPT, "trainer.accelerator=cpu", "strategy=fsdp", "trainer.devices=2"]
    overrides += f"trainer.precision={precision}".split()
    row = planner.estimate(compose_cfg(*overrides))
    assert (row.params, row.grads, row.optimizer) == (4 * half, 4 * half, 2 * 4 * half + 4 * tensors)
    assert row.gathered == gather * root
    assert row.total == 16 * half + 4 * tensors + gather * root + row.activations
