"""The GPT example: the network, the text data, and the model-parallel preflight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlproject.core.errors import ConfigError
from mlproject.core.topology import Topology
from mlproject.data.text import VOCAB_SIZE, Chunks, corpus, decode, encode
from mlproject.models.components.gpt import GPT
from mlproject.preflight import preflight


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors this small gain nothing from threads, which only wait on each other on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB_SIZE, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_gpt_is_causal():
    """Changing token t changes the logits at t and after, never before."""
    net = tiny_gpt().eval()
    idx = torch.randint(0, VOCAB_SIZE, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (idx[:, 10] + 1) % VOCAB_SIZE
    a, b = net(idx), net(changed)
    assert a.shape == (2, 16, VOCAB_SIZE)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert net.generate(idx[:, :4], max_new_tokens=20).shape == (2, 24)  # feeds back at most block_size


def test_gpt_learns_the_text():
    text = encode(corpus()[:4096])
    data = Chunks(text, 16)
    x, y = map(torch.stack, zip(*(data[i] for i in range(32)), strict=True))
    torch.testing.assert_close(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    net = tiny_gpt()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(float(VOCAB_SIZE))).item(), rel=0.05)
    assert losses[-1] < 0.6 * losses[0]


def test_corpus_is_fixed_and_round_trips():
    text = corpus()
    assert len(text) > 300_000 and text == corpus()
    assert decode(encode(text[:5000])) == text[:5000]
    assert int(encode(text).max()) < VOCAB_SIZE


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["model=gpt", "data=text", "strategy=fsdp", "strategy.fsdp.cpu_offload=true"], "without a GPU"),
        # feature: tensor
        (["model=gpt", "data=text", "strategy=fsdp_tp", "trainer.devices=3"], "must divide the 3 process"),
        (["model=gpt", "data=text", "strategy=tp", "trainer.devices=4"], "use strategy=fsdp_tp"),
        (["model=gpt", "data=text", "strategy=tp", "trainer.devices=3", "strategy.tensor_parallel_size=3"], "n_head"),
        # /feature: tensor
        # feature: expert
        (
            ["model=gpt_moe", "data=text", "strategy=fsdp", "trainer.devices=3", "strategy.expert_parallel_size=3"]
            + ["data.batch_size=3"],
            "model.net.n_expert=4 must divide by strategy.expert_parallel_size=3",
        ),
        (
            ["model=gpt", "data=text", "strategy=fsdp", "trainer.devices=2", "strategy.expert_parallel_size=2"],
            "needs a mixture-of-experts",
        ),
        (
            ["model=gpt_moe", "data=text", "strategy=ddp", "trainer.devices=2", "+strategy.expert_parallel_size=2"],
            "needs strategy=fsdp or hsdp",
        ),
        # /feature: expert
    ],
)
def test_preflight_refuses_impossible_model_parallel(compose_cfg, overrides, error):
    cfg = compose_cfg("trainer.accelerator=cpu", *overrides)
    with pytest.raises(ConfigError, match=error):
        preflight(cfg)


# feature: tensor
def test_global_batch_divides_over_data_parallel_ranks_only(compose_cfg):
    tp = ["model=gpt", "data=text", "trainer.accelerator=cpu", "strategy=fsdp_tp", "trainer.devices=4"]
    assert Topology.of(compose_cfg(*tp)).data_parallel_size == 2  # 4 processes in TP groups of 2 read 2 batches
    assert Topology.of(compose_cfg(*tp, "strategy.tensor_parallel_size=4")).data_parallel_size == 1


# /feature: tensor
def test_the_mesh_is_named_by_the_strategy_config(compose_cfg):
    """8 processes on 2 nodes: hsdp replicates across the nodes (replicate_size defaults to num_nodes) and shards
    over each node's 4."""
    moe = ["model=gpt_moe", "data=text", "trainer.accelerator=cpu", "trainer.devices=4", "trainer.num_nodes=2"]
    topology = Topology.of(compose_cfg(*moe, "strategy=hsdp")).validate()
    assert topology.strategy == "hsdp" and topology.shard_size == 4 and topology.data_parallel_size == 8
    dims = {"replicate": 2, "shard": 4}
    # feature: pipeline
    dims = {"pipeline": 1, **dims}
    # /feature: pipeline
    # feature: tensor
    dims["tensor_parallel"] = 1
    # /feature: tensor
    assert topology.mesh_dims == dims
    # feature: expert
    # expert parallelism takes the inner 2 of each shard group (named_meshes splits `shard`)
    split = Topology.of(compose_cfg(*moe, "strategy=hsdp", "strategy.expert_parallel_size=2")).validate()
    assert split.mesh_dims == dims and split.expert_parallel_size == 2
    # /feature: expert
    fsdp = Topology.of(compose_cfg(*moe, "strategy=fsdp")).validate()
    assert fsdp.strategy == "fsdp" and fsdp.mesh_dims["replicate"] == 1 and fsdp.shard_size == 8
