"""A user's transformer moves in (issue 41): tests/fixtures/nanogpt, a tiny GPT in nanoGPT's layout (GPTConfig
nested under net.config, q/k/v fused in c_attn, wte tied to lm_head) in LightningModules that import nothing of
the template and log losses only, on PYTHONPATH with its configs found through hydra.searchpath. What it cannot
do is refused in one line: before any process starts where the config says so, once after setup where only the
built model does."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import FAST, run, run_dirs, run_in_process, together, with_path

NANOGPT = Path(__file__).parents[1] / "fixtures/nanogpt"
PROJECT = [f"hydra.searchpath=[file://{NANOGPT}/configs]", "data=text", "data.block_size=32", "data.batch_size=8"]
SHORT = ["trainer.max_steps=4", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]
# the MLP under tensor parallelism, as torchtitan's plans name layers (attention left whole)
MLP_PLAN = "+model.parallel={blocks: [mygpt.model.Block], colwise: [mlp.c_fc], rowwise: [mlp.c_proj]}"


@pytest.fixture
def user_code(monkeypatch):
    """The user's package importable in this process, as PYTHONPATH makes it in a run."""
    monkeypatch.syspath_prepend(str(NANOGPT))


def env() -> dict[str, str]:
    return with_path(NANOGPT)


def refusal(tmp_path, *overrides: str) -> str:
    """The one line preflight prints for a run refused before anything starts."""
    code, err = run_in_process("train", *FAST, *PROJECT, *overrides, log_dir=tmp_path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


CHECKS = {  # id -> (overrides, the line's start)
    # feature: tensor
    "fused-qkv": (
        ["strategy=tp", "trainer.devices=2", MLP_PLAN.replace("[mlp.c_fc]", "[attn.c_attn, mlp.c_fc]")],
        "error: model.parallel.colwise: attn.c_attn of Block is a fused q/k/v projection (Linear 32 -> 96), "
        "which tensor parallelism cannot split by columns; split it into three Linear layers named in colwise "
        "(as model=gpt's attn.q, attn.k, attn.v), or drop it and its rowwise output projection from the plan "
        "(then TP splits the MLP only), or use strategy=fsdp",
    ),
    "layer-typo": (
        ["strategy=tp", "trainer.devices=2", MLP_PLAN.replace("[mlp.c_fc]", "[mlp.fc]")],
        "error: model.parallel.colwise: mlp.fc of Block is no layer; its Linear and Embedding layers: "
        "attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj",
    ),
    # /feature: tensor
    "class-typo": (
        ["strategy=fsdp", "trainer.devices=2", MLP_PLAN.replace("mygpt.model.Block", "mygpt.model.GPT2Block")],
        "error: model.parallel.blocks: mygpt.model.GPT2Block is not an importable class (Error loading "
        "'mygpt.model.GPT2Block':",
    ),
    "class-absent": (
        ["strategy=fsdp", "trainer.devices=2", MLP_PLAN.replace("mygpt.model.Block", "torch.nn.GRU")],
        "error: model.parallel.blocks: no module of torch.nn.GRU in LitGPT; its repeated module classes: "
        "mygpt.model.Block",
    ),
    # feature: tensor
    "nested-heads": (  # attn.c_proj's input is the heads side by side: the attention module around it counts them
        ["strategy=tp", "trainer.devices=2", "model.net.config.n_head=3", "model.net.config.n_embd=48"]
        + [MLP_PLAN.replace("[mlp.c_proj]", "[attn.c_proj, mlp.c_proj]")],
        "error: model.net.config.n_head=3 must divide by strategy.tensor_parallel_size=2",
    ),
    "width": (
        ["strategy=tp", "trainer.devices=8", "strategy.tensor_parallel_size=8", "model.net.config.n_head=3"]
        + ["model.net.config.n_embd=33", MLP_PLAN],
        "error: model.parallel.colwise: mlp.c_fc of Block has 132 output features, which do not divide by "
        "strategy.tensor_parallel_size=8",
    ),
    # /feature: tensor
    "nested-vocab": (
        ["+data.vocab_size=256", "model.net.config.vocab_size=100"],
        "error: model.net.config.vocab_size=100 is smaller than data.vocab_size=256; drop the override (it "
        "follows the data) or raise it",
    ),
    "lazy-vocab": (
        ["model=nanogpt_lazy", "+data.vocab_size=256", "model.config.vocab_size=100"],
        "error: model.config.vocab_size=100 is smaller than data.vocab_size=256",
    ),
}


@pytest.mark.parametrize(("overrides", "expected"), list(CHECKS.values()), ids=list(CHECKS))
def test_plan_and_nested_settings_are_checked_before_launch(tmp_path, user_code, overrides, expected):
    """Each in one line from preflight (in this process: no rank starts), where the run used to fail after launch
    (a typo in blocks: 387 lines; the fused split: `not enough values to unpack` in the model's forward) or to pass
    unchecked (settings nested in net.config: an IndexError deep in the embedding)."""
    model = [] if any(o.startswith("model=") for o in overrides) else ["model=nanogpt"]
    assert refusal(tmp_path, *model, *overrides).startswith(expected)


# feature: tensor
def test_template_plans_pass_the_check(tmp_path, compose_cfg):
    """The template's own plans (separate q, k, v; MoE experts) name what exists, and the check sees their model
    (a wrong layer name in the same plan is refused)."""
    from mlproject.build import meta_network
    from mlproject.core.errors import ConfigError
    from mlproject.core.topology import Topology
    from mlproject.distributed.strategies import check_plan

    for overrides in (["model=gpt", "strategy=fsdp_tp", "trainer.devices=4"], ["model=gpt_moe", "strategy=fsdp"]):
        cfg = compose_cfg(*overrides, "data=text", "trainer=cpu")
        check_plan(cfg, Topology.of(cfg), meta_network(cfg))
        cfg.model.parallel.rowwise = [*cfg.model.parallel.rowwise, "attn.c_proj"]
        with pytest.raises(ConfigError, match="^model.parallel.rowwise: attn.c_proj of Block is no layer; its"):
            check_plan(cfg, Topology.of(cfg), meta_network(cfg))
    heads = ["model.net.n_head=3", "model.net.n_embd=48"]  # the built attention's n_head, named by its config key
    cfg = compose_cfg("model=gpt", "strategy=tp", "trainer.devices=2", *heads, "data=text", "trainer=cpu")
    with pytest.raises(ConfigError, match="^model.net.n_head=3 must divide by strategy.tensor_parallel_size=2$"):
        check_plan(cfg, Topology.of(cfg), meta_network(cfg))


# /feature: tensor
STEPS = ["trainer.max_steps=6", "trainer.max_epochs=1", "+callbacks.steps._target_=tests.helpers.callbacks.RecordSteps"]
SHARDED = ["strategy=fsdp", "trainer.devices=2"]
QUICK = ["callbacks=none", "test=false", "trainer.limit_val_batches=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Side by side: the module with the network built in __init__ in one process (with the default callbacks:
    validation every 3 steps, the best checkpoint, a test), the same under an empty configure_model and the
    lazy-build module on one process and under fsdp on 2, and a parameter outside any submodule under fsdp."""
    plans = {
        "single": ["model=nanogpt", "trainer.val_check_interval=3", "trainer.limit_val_batches=2"]
        + ["trainer.limit_test_batches=2"],
        "empty_hook": [
            *("model=nanogpt", "model._target_=mygpt.lit.EmptyHookLitGPT", *QUICK, *SHARDED),
            "+callbacks.steps.checkpoint=true",  # last.ckpt: a sharded checkpoint to export
        ],
        "ddp": ["model=nanogpt", *QUICK, "strategy=ddp", "trainer.devices=2"],
        "lazy_single": ["model=nanogpt_lazy", *QUICK],
        "lazy": ["model=nanogpt_lazy", *QUICK, *SHARDED],
        "outside": ["model=nanogpt", "model._target_=mygpt.lit.ScaledLitGPT", *QUICK, *SHARDED],
        # feature: tensor
        # the plan from config alone (the module takes no `parallel`), clipped by the strategy (gradient_clip_val 1)
        "tp": ["model=nanogpt", MLP_PLAN, *QUICK, "strategy=tp", "trainer.devices=2"],
        "fsdp_tp": ["model=nanogpt", MLP_PLAN, *QUICK, "strategy=fsdp_tp", "trainer.devices=4"],
        # /feature: tensor
    }
    root = tmp_path_factory.mktemp("moves_in")

    def one(name):
        proc = run("train", *FAST, *PROJECT, *STEPS, *plans[name], log_dir=root / name, env=env(), check=False)
        (run_dir,) = run_dirs(root / name) or [None]  # a run that fails before training leaves none
        done = run_dir is not None and (run_dir / "steps.pt").exists()
        return {"proc": proc, "run_dir": run_dir, **(torch.load(run_dir / "steps.pt") if done else {})}

    return dict(zip(plans, together(*(lambda n=n: one(n) for n in plans)), strict=True))


SAME_AS = [("ddp", "single"), ("empty_hook", "single"), ("lazy", "lazy_single")]  # (run, its one-process reference)
BUILDS = [("single", 2), ("ddp", 3), ("empty_hook", 3)]  # (run, how often the network is built)
# feature: tensor
SAME_AS += [("tp", "single"), ("fsdp_tp", "single")]
BUILDS += [("fsdp_tp", 5)]
# /feature: tensor


@pytest.mark.slow
@pytest.mark.parametrize(("name", "reference"), SAME_AS)
def test_the_module_is_sharded_by_its_plan_or_whole_and_trains_as_one_process(runs, name, reference):
    """DDP replicates the module as it is. An empty configure_model, or one that builds the network (Lightning's
    lazy-build hook), used to leave the network whole under fsdp: each rank trained its own copy, unsynced. The
    strategy now shards it after the hook;
    under tp and fsdp_tp it splits the MLP of each block by the plan in the config, which the module never sees,
    and clips the gradients that mix DTensors and plain tensors. Every step's global loss within 2e-6 relative and
    every final parameter within 5e-6 of one process (the strategy-equivalence tolerances of
    docs/model-parallel.md), and the ranks started from the same weights."""
    got, ref = runs[name], runs[reference]
    assert got["proc"].returncode == 0, got["proc"].stderr[-3000:]
    assert len(got["losses"]) == len(ref["losses"]) == 6
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=2e-6, atol=0)
    assert got["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=0, atol=5e-6, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "builds"), BUILDS)
def test_the_network_is_built_once_per_rank_and_once_on_the_meta_device(runs, name, builds):
    """The user's GPT prints its size in __init__, as nanoGPT does: rank 0 builds it once on the meta device, which
    preflight's checks and the memory estimate copy, and each rank once to train (one process used to build it 3
    times, fsdp on 2 ranks 4)."""
    proc = runs[name]["proc"]
    assert (proc.stdout + proc.stderr).count("number of parameters: ") == builds


@pytest.mark.slow
def test_a_parameter_outside_every_submodule_is_refused_once_after_setup(runs):
    """The strategy shards submodules; a parameter held by the LightningModule itself would stay one copy per rank:
    the run stops after setup, before the first step, with one line naming it."""
    proc = runs["outside"]["proc"]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: strategy=")]
    assert proc.returncode != 0 and "losses" not in runs["outside"]
    assert set(errors) == {  # the same line from each rank
        "error: strategy=fsdp: parameter temperature of ScaledLitGPT is not sharded, so each rank would train its "
        "own copy without gradient sync; keep it in a submodule (the strategy shards each one after "
        "configure_model), or shard it in configure_model with mlproject.distributed.parallel.parallelize(self, "
        "<its module>)."
    }


@pytest.mark.slow
def test_a_module_that_logs_only_losses_keeps_its_best_checkpoint_by_val_loss(runs):
    """The default monitor (val/acc) is a classifier's: a module that logs val/loss only used to crash at its first
    validation. The best checkpoint now follows val/loss (min), with one notice, and the test loads it."""
    import csv

    proc, run_dir = runs["single"]["proc"], runs["single"]["run_dir"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "LitGPT logs no val/acc: the best checkpoint is the one with the lowest val/loss" in out
    with open(run_dir / "csv/metrics.csv") as f:
        val = [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]
    assert len(val) == 2
    (best,) = (run_dir / "checkpoints").glob("epoch_*.ckpt")
    state = torch.load(best, weights_only=True)["callbacks"]
    (score,) = [v["best_model_score"] for k, v in state.items() if k.startswith("ModelCheckpoint")]
    assert float(score) == pytest.approx(min(val), rel=1e-6)
    assert f"testing {best}" in out


@pytest.mark.slow
def test_the_fsdp_checkpoint_exports_the_tied_weight_once_and_loads_into_the_bare_network(runs, tmp_path):
    """The export holds nanoGPT's own keys, wte tied to lm_head stored once, and loads with strict=True into the
    network built from the exported config alone: the weights the run ended with."""
    import hydra

    from tests.helpers.processes import PYTHON

    out = tmp_path / "gpt.pt"
    export = [PYTHON, "-m", "mlproject.export", f"ckpt_path={runs['empty_hook']['run_dir'] / 'last.ckpt'}"]
    subprocess.run([*export, f"out={out}"], cwd=tmp_path, env=env(), check=True, capture_output=True, timeout=240)
    exported = torch.load(out, weights_only=True)
    weights = exported["state_dict"]
    assert weights["transformer.wte.weight"].data_ptr() == weights["lm_head.weight"].data_ptr()
    net = hydra.utils.instantiate(exported["config"]["model"]["net"])
    net.load_state_dict(weights, strict=True)
    final = {k.removeprefix("net."): v for k, v in runs["empty_hook"]["state"].items()}
    assert all(torch.equal(v, final[k]) for k, v in net.state_dict().items())
