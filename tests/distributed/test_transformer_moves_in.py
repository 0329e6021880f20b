"""A user's transformer moves in (issue 41): tests/fixtures/nanogpt, a tiny GPT in nanoGPT's layout (GPTConfig
nested under net.config, q/k/v fused in c_attn, wte tied to lm_head) in LightningModules that import nothing of
the template and log losses only, on PYTHONPATH with its configs found through hydra.searchpath. What it cannot
do is refused in one line: before any process starts where the config says so, once after setup where only the
built model does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.processes import FAST, clean_env, run_in_process

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
    return clean_env(PYTHONPATH=os.pathsep.join(p for p in (str(NANOGPT), os.environ.get("PYTHONPATH")) if p))


def refusal(tmp_path, *overrides: str) -> str:
    """The one line preflight prints for a run refused before anything starts."""
    code, err = run_in_process("train", *FAST, *PROJECT, *overrides, log_dir=tmp_path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["strategy=tp", "trainer.devices=2", MLP_PLAN.replace("[mlp.c_fc]", "[attn.c_attn, mlp.c_fc]")],
            "error: model.parallel.colwise: attn.c_attn of Block is a fused q/k/v projection (Linear 32 -> 96), "
            "which tensor parallelism cannot split by columns; split it into three Linear layers named in colwise "
            "(as model=gpt's attn.q, attn.k, attn.v), or drop it and its rowwise output projection from the plan "
            "(then TP splits the MLP only), or use strategy=fsdp",
        ),
        (
            ["strategy=tp", "trainer.devices=2", MLP_PLAN.replace("[mlp.c_fc]", "[mlp.fc]")],
            "error: model.parallel.colwise: mlp.fc of Block is no layer; its Linear and Embedding layers: "
            "attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj",
        ),
        (
            ["strategy=fsdp", "trainer.devices=2", MLP_PLAN.replace("mygpt.model.Block", "mygpt.model.GPT2Block")],
            "error: model.parallel.blocks: mygpt.model.GPT2Block is not an importable class (Error loading "
            "'mygpt.model.GPT2Block':",
        ),
        (
            ["strategy=fsdp", "trainer.devices=2", MLP_PLAN.replace("mygpt.model.Block", "torch.nn.GRU")],
            "error: model.parallel.blocks: no module of torch.nn.GRU in LitGPT; its repeated module classes: "
            "mygpt.model.Block",
        ),
        (
            ["strategy=tp", "trainer.devices=2", "model.net.config.n_head=3", "model.net.config.n_embd=48"],
            "error: model.net.config.n_head=3 must divide by strategy.tensor_parallel_size=2",
        ),
        (
            ["+data.vocab_size=256", "model.net.config.vocab_size=100"],
            "error: model.net.config.vocab_size=100 is smaller than data.vocab_size=256; drop the override (it "
            "follows the data) or raise it",
        ),
        (
            ["model=nanogpt_lazy", "+data.vocab_size=256", "model.config.vocab_size=100"],
            "error: model.config.vocab_size=100 is smaller than data.vocab_size=256",
        ),
    ],
    ids=["fused-qkv", "layer-typo", "class-typo", "class-absent", "nested-heads", "nested-vocab", "lazy-vocab"],
)
def test_plan_and_nested_settings_are_checked_before_launch(tmp_path, user_code, overrides, expected):
    """Each in one line from preflight (in this process: no rank starts), where the run used to fail after launch
    (a typo in blocks: 387 lines; the fused split: `not enough values to unpack` in the model's forward) or to pass
    unchecked (settings nested in net.config: an IndexError deep in the embedding)."""
    model = [] if any(o.startswith("model=") for o in overrides) else ["model=nanogpt"]
    assert refusal(tmp_path, *model, *overrides).startswith(expected)


def test_template_plans_pass_the_check(tmp_path, compose_cfg):
    """The template's own plans (separate q, k, v; MoE experts) name what exists, and the check sees their model
    (a wrong layer name in the same plan is refused)."""
    from mlproject.core.errors import ConfigError
    from mlproject.core.topology import Topology
    from mlproject.distributed.strategies import check_plan

    for overrides in (["model=gpt", "strategy=fsdp_tp", "trainer.devices=4"], ["model=gpt_moe", "strategy=fsdp"]):
        cfg = compose_cfg(*overrides, "data=text", "trainer=cpu")
        check_plan(cfg, Topology.of(cfg))
        cfg.model.parallel.rowwise = [*cfg.model.parallel.rowwise, "attn.c_proj"]
        with pytest.raises(ConfigError, match="^model.parallel.rowwise: attn.c_proj of Block is no layer; its"):
            check_plan(cfg, Topology.of(cfg))
