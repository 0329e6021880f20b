"""Sharded checkpoints (strategy=fsdp, a directory per checkpoint written by every rank): exact resume on
the same world size, close resume on another world size or from another strategy, eval and export.

The tiny GPT has no dropout and every world size reads the same global batches, so a resume on another
world size differs from a straight run only by the order of floating-point reductions.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.checkpoint.helpers import (
    assert_bitwise,
    assert_export_matches,
    epoch_metrics,
    kill_at,
    max_diff,
    run_dir,
    strategy,
    train,
    weights,
)
from tests.helpers.processes import run, together

DATA = [
    "data.block_size=32",
    "data.batch_size=8",
    "data.val_fraction=0.005",
    "data.test_fraction=0.005",
]
GPT = [
    "experiment=gpt",
    *DATA,
    "model.net.n_layer=2",
    "model.net.n_head=2",
    "model.net.n_embd=32",
    "model.scheduler.warmup_steps=2",
    "trainer.limit_train_batches=6",  # 6 steps per epoch, 18 in all
    "trainer.limit_val_batches=2",
    "trainer.max_epochs=3",
]
FSDP2 = [*GPT, *strategy("fsdp", 2)]
GPT4 = [o for o in GPT if not o.startswith("model.net.n_layer=")] + ["model.net.n_layer=4"]  # 2 stages of 2 blocks
CLOSE = 1e-5  # fp32 after 18 AdamW steps; measured differences are ~1e-7


def last(log_dir, run_id):
    return run_dir(log_dir, run_id) / "checkpoints" / "last.ckpt"


def assert_ends_near(log_dir, straight: dict, runs: dict[str, str]) -> None:
    """Each run (label -> run id) ends within CLOSE of the straight run's parameters; prints the differences."""
    diffs = {label: max_diff(straight, weights(last(log_dir, run_id))) for label, run_id in runs.items()}
    print("max |param - straight run's|:", diffs)
    assert all(d < CLOSE for d in diffs.values()), diffs


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 9 runs of 1-2 processes, in 2 rounds of runs started together
def test_fsdp_checkpoints_resume_anywhere(tmp_path):
    epoch2 = tmp_path / "epoch2.ckpt"

    def killed_after_epoch_2():
        # exact: killed after the epoch-2 checkpoint, resumed with ckpt_path=auto on the same 2 processes
        assert train(tmp_path, "epoch", *FSDP2, "ckpt_path=auto", *kill_at(12), check=False).returncode != 0
        shutil.copytree(last(tmp_path, "epoch"), epoch2)  # 2 shards, after 12 steps

    # a ddp file checkpoint (killed after epoch 2) for ddp -> fsdp below
    _, _, ddp = together(
        lambda: train(tmp_path, "straight", *FSDP2, test=True),
        killed_after_epoch_2,
        lambda: train(tmp_path, "ddp", *GPT, *strategy("ddp", 2), *kill_at(12), check=False),
    )
    assert ddp.returncode != 0
    straight = weights(last(tmp_path, "straight"))
    assert (last(tmp_path, "straight") / ".metadata").is_file()  # sharded: a directory of shards

    def two_one_two():
        # 2 -> 1 process (resharded), checkpoint every 2 steps, killed at step 15: its last.ckpt is 1 shard,
        # mid-epoch ...
        one = [*GPT, *strategy("fsdp", 1), "callbacks.last_checkpoint.every_n_train_steps=2"]
        assert train(tmp_path, "one", *one, f"ckpt_path={epoch2}", *kill_at(15), check=False).returncode != 0
        # ... and on to 2 processes again, from the middle of the last epoch
        train(tmp_path, "two", *FSDP2, f"ckpt_path={last(tmp_path, 'one')}")

    # eval on one process reads the sharded checkpoint (below: it gets the straight run's test metrics)
    best = max(run_dir(tmp_path, "straight").glob("checkpoints/epoch_*.ckpt"))
    evaluate = ["trainer=cpu", *DATA, f"ckpt_path={best}", "extras.print_config=false"]  # its model, its data
    # export through the command line once (below: from a sharded and from a ddp checkpoint in this process)
    cli_out = tmp_path / "cli.pt"
    together(
        lambda: train(tmp_path, "epoch", *FSDP2, "ckpt_path=auto"),
        two_one_two,
        # sharded -> one plain process (converted on load)
        lambda: train(tmp_path, "single", *GPT, *strategy("single"), f"ckpt_path={epoch2}"),
        # a ddp file checkpoint -> fsdp on 2 processes
        lambda: train(tmp_path, "ddp2fsdp", *FSDP2, f"ckpt_path={last(tmp_path, 'ddp')}"),
        lambda: run("eval", *evaluate, log_dir=tmp_path),
        lambda: assert_cli(["-m", "mlproject.export", f"ckpt_path={last(tmp_path, 'straight')}", f"out={cli_out}"]),
    )
    assert_bitwise(straight, weights(last(tmp_path, "epoch")))
    assert epoch_metrics(run_dir(tmp_path, "epoch")) == epoch_metrics(run_dir(tmp_path, "straight"))

    assert_ends_near(
        tmp_path,
        straight,
        {
            "fsdp 2 -> 1 -> 2": "two",
            "fsdp 2 -> single": "single",
            "ddp -> fsdp": "ddp2fsdp",
        },
    )

    (eval_dir,) = (tmp_path / "eval" / "runs").iterdir()
    tested = json.loads((eval_dir / "metrics.json").read_text())
    trained = json.loads((run_dir(tmp_path, "straight") / "metrics.json").read_text())
    assert tested == pytest.approx({k: v for k, v in trained.items() if k.startswith("test/")}, rel=1e-5)

    x = torch.randint(0, 256, (2, 32))
    assert_export_matches(last(tmp_path, "straight"), tmp_path / "fsdp.pt", x)
    assert_export_matches(last(tmp_path, "ddp"), tmp_path / "ddp.pt", x)
    assert (
        torch.load(cli_out, weights_only=True)["state_dict"].keys()
        == torch.load(tmp_path / "fsdp.pt")["state_dict"].keys()
    )


def assert_cli(args: list[str]) -> None:
    import subprocess

    from mlproject.core.constants import PROJECT_ROOT
    from tests.helpers.processes import PYTHON, clean_env

    proc = subprocess.run([PYTHON, *args], cwd=PROJECT_ROOT, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


# feature: tensor
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp_checkpoint_resumes_exactly_and_exports(tmp_path):
    """strategy=tp writes sharded checkpoints too (each rank its column/row halves): killed after the
    epoch-2 checkpoint and resumed with ckpt_path=auto, it ends bitwise equal to a straight run, and the
    export gathers the halves into the plain network."""
    tp2 = [*GPT, *strategy("tp", 2), "strategy.tensor_parallel_size=2"]
    _, proc = together(
        lambda: train(tmp_path, "straight", *tp2),
        lambda: train(tmp_path, "killed", *tp2, "ckpt_path=auto", *kill_at(12), check=False),
    )
    straight = weights(last(tmp_path, "straight"))
    assert (last(tmp_path, "straight") / ".metadata").is_file()
    assert proc.returncode != 0
    train(tmp_path, "killed", *tp2, "ckpt_path=auto")
    assert_bitwise(straight, weights(last(tmp_path, "killed")))
    assert_export_matches(last(tmp_path, "straight"), tmp_path / "tp.pt", torch.randint(0, 256, (2, 32)))


# /feature: tensor
# feature: expert
@pytest.mark.slow
@pytest.mark.timeout(1800)  # 5 runs of 1-4 processes, in 2 rounds of runs started together
def test_expert_parallel_and_hsdp_checkpoints_resume_anywhere(tmp_path):
    """The MoE GPT with its experts split over 2 ranks (EP 2, FSDP on the dense part) checkpoints after epoch
    2; from there it resumes as HSDP 2 x 2 with EP 2 on 4 processes, as plain FSDP (each rank all experts,
    sharded) on 2, and into one process, from HSDP's own mid-epoch checkpoint. Each run ends where the
    straight run does, up to the order of reductions (measured <= 2.4e-7), and the EP x HSDP checkpoint
    exports to one plain state dict of the bare network."""
    moe = [*GPT, "experiment=gpt_moe"]
    ep2 = [*moe, *strategy("fsdp", 2), "strategy.expert_parallel_size=2"]
    _, proc = together(
        lambda: train(tmp_path, "straight", *ep2),
        lambda: train(tmp_path, "epoch", *ep2, *kill_at(12), check=False),
    )
    straight = weights(last(tmp_path, "straight"))
    assert straight["net.blocks.0.mlp.experts.fc_weight"].shape[0] == 4  # gathered: every expert, one tensor
    assert proc.returncode != 0
    epoch2 = last(tmp_path, "epoch")

    def hsdp_then_single():
        hsdp = [*moe, *strategy("hsdp", 4), "strategy.replicate_size=2", "strategy.expert_parallel_size=2"]
        every2 = "callbacks.last_checkpoint.every_n_train_steps=2"
        proc = train(tmp_path, "hsdp", *hsdp, every2, f"ckpt_path={epoch2}", *kill_at(15), check=False)
        assert proc.returncode != 0
        train(tmp_path, "single", *moe, *strategy("single"), f"ckpt_path={last(tmp_path, 'hsdp')}")

    together(hsdp_then_single, lambda: train(tmp_path, "fsdp", *moe, *strategy("fsdp", 2), f"ckpt_path={epoch2}"))
    assert_ends_near(
        tmp_path,
        straight,
        {
            "ep 2 -> hsdp 2x2 ep 2 -> single": "single",
            "ep 2 -> fsdp 2 (ep 1)": "fsdp",
        },
    )
    assert_export_matches(last(tmp_path, "hsdp"), tmp_path / "moe.pt", torch.randint(0, 256, (2, 32)))


# /feature: expert
# feature: pipeline
@pytest.mark.slow
@pytest.mark.timeout(1800)  # 7 runs of 1-4 processes, in 2 rounds of runs started together
def test_pipeline_checkpoints_resume_anywhere_and_export(tmp_path):
    """strategy=pp on 2 processes (stages of 2 blocks, 1f1b) checkpoints under the single process's keys: killed
    after the epoch-2 checkpoint and resumed on the same layout it ends bitwise equal to a straight run. From
    that checkpoint it resumes as interleaved_1f1b x FSDP 2 on 4 processes (each rank blocks i and i + 2, each
    stage sharded), into one process from that run's mid-epoch checkpoint, and as plain FSDP on 2 (pp 1), each
    ending where the straight run does up to the order of reductions (measured <= 5.7e-8); it exports to one
    plain state dict and one process evaluates it (the test metrics of the straight run)."""
    pp2 = [*GPT4, *strategy("pp", 2)]
    epoch2 = tmp_path / "epoch2.ckpt"

    def killed_after_epoch_2():
        assert train(tmp_path, "epoch", *pp2, "ckpt_path=auto", *kill_at(12), check=False).returncode != 0
        shutil.copytree(last(tmp_path, "epoch"), epoch2)

    together(lambda: train(tmp_path, "straight", *pp2, test=True), killed_after_epoch_2)
    straight = weights(last(tmp_path, "straight"))

    def interleaved_then_single():
        interleaved = [
            *GPT4,
            *strategy("pp", 4),
            "strategy.pipeline.schedule=interleaved_1f1b",
            "strategy.pipeline.microbatches=2",
            "callbacks.last_checkpoint.every_n_train_steps=2",
        ]
        proc = train(tmp_path, "interleaved", *interleaved, f"ckpt_path={epoch2}", *kill_at(15), check=False)
        assert proc.returncode != 0
        train(tmp_path, "single", *GPT4, *strategy("single"), f"ckpt_path={last(tmp_path, 'interleaved')}")

    best = max(run_dir(tmp_path, "straight").glob("checkpoints/epoch_*.ckpt"))
    evaluate = ["trainer=cpu", *DATA, f"ckpt_path={best}", "extras.print_config=false"]  # its model, its data
    together(
        lambda: train(tmp_path, "epoch", *pp2, "ckpt_path=auto"),
        interleaved_then_single,
        lambda: train(tmp_path, "fsdp", *GPT4, *strategy("fsdp", 2), f"ckpt_path={epoch2}"),
        lambda: run("eval", *evaluate, log_dir=tmp_path),
    )
    assert_bitwise(straight, weights(last(tmp_path, "epoch")))
    assert epoch_metrics(run_dir(tmp_path, "epoch")) == epoch_metrics(run_dir(tmp_path, "straight"))

    assert_ends_near(
        tmp_path,
        straight,
        {
            "pp 2 -> interleaved pp 2 x fsdp 2 -> single": "single",
            "pp 2 -> fsdp 2 (pp 1)": "fsdp",
        },
    )

    assert_export_matches(last(tmp_path, "straight"), tmp_path / "pp.pt", torch.randint(0, 256, (2, 32)))
    (eval_dir,) = (tmp_path / "eval" / "runs").iterdir()
    tested = json.loads((eval_dir / "metrics.json").read_text())
    trained = json.loads((run_dir(tmp_path, "straight") / "metrics.json").read_text())
    assert tested == pytest.approx({k: v for k, v in trained.items() if k.startswith("test/")}, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 4 runs of 1-4 processes: the straight run, then 2 chains from its checkpoints together
def test_checkpoints_of_other_layouts_resume_into_pipeline(tmp_path):
    """A single process's file checkpoint after epoch 2 resumes as pp 2 on 2 processes; an FSDP 2 run resumed
    from its epoch-1 checkpoint and killed after epoch 2 resumes from its sharded directory as pp 2 x fsdp 2 on
    4. Each rank takes its stage's share of the whole network's weights and optimizer state, and each run ends
    where the straight single run does up to the order of reductions (measured <= 2.8e-7)."""
    single = [*GPT4, *strategy("single")]
    train(tmp_path, "straight", *single, "callbacks.model_checkpoint.save_top_k=-1")  # keeps every epoch's
    straight = weights(last(tmp_path, "straight"))
    epoch1, epoch2 = (run_dir(tmp_path, "straight") / "checkpoints" / f"epoch_00{i}.ckpt" for i in (0, 1))

    def fsdp_then_pp_fsdp():
        # from epoch 1 (not from scratch): 12 steps of FSDP's reduction order would differ by ~5e-6 on their own
        fsdp = [*GPT4, *strategy("fsdp", 2), f"ckpt_path={epoch1}", *kill_at(12)]
        assert train(tmp_path, "fsdp", *fsdp, check=False).returncode != 0
        train(tmp_path, "fsdp2pp", *GPT4, *strategy("pp", 4), f"ckpt_path={last(tmp_path, 'fsdp')}")

    together(lambda: train(tmp_path, "single2pp", *GPT4, *strategy("pp", 2), f"ckpt_path={epoch2}"), fsdp_then_pp_fsdp)
    assert_ends_near(
        tmp_path,
        straight,
        {
            "single -> pp 2": "single2pp",
            "single -> fsdp 2 -> pp 2 x fsdp 2": "fsdp2pp",
        },
    )


# /feature: pipeline
