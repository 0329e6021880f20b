"""The make targets pass every override through exactly as given, in both forms and mixed."""

from __future__ import annotations

import pytest

from tests.helpers.processes import make_command

# make command line (as a shell would read it) -> the overrides the Python command must receive
THREE = ["trainer.max_epochs=1", "seed=3", "data.batch_size=32"]
CASES = {
    'train ARGS="trainer.max_epochs=1 seed=3 data.batch_size=32"': THREE,
    "train trainer.max_epochs=1 seed=3 data.batch_size=32": THREE,
    "train tags='[a, b]' \"model.name=it's\"": ["tags=[a, b]", "model.name=it's"],
    "train +trainer.x=a=b,c ARGS='~logger \"paths.log_dir=my logs\"'": [
        "+trainer.x=a=b,c", "~logger", "paths.log_dir=my logs",
    ],
    'submit-dryrun ARGS="cluster=slurm cluster.nodes=4 cluster.gpus_per_node=8"': [
        "--dry-run", "cluster=slurm", "cluster.nodes=4", "cluster.gpus_per_node=8",
    ],
    "eval CKPT=a.ckpt data.batch_size=7": ["ckpt_path=a.ckpt", "data.batch_size=7"],
    "export CKPT=a.ckpt OUT=m.pt": ["ckpt_path=a.ckpt", "out=m.pt"],
    "eval \"CKPT=my runs/it's.ckpt\" data.batch_size=7": ["ckpt_path=my runs/it's.ckpt", "data.batch_size=7"],
    "export 'CKPT=a \"b\".ckpt' 'OUT=out dir/m.pt'": ['ckpt_path=a "b".ckpt', "out=out dir/m.pt"],
}  # fmt: skip


@pytest.mark.parametrize("make_line", CASES)
def test_make_passes_overrides_through(make_line):
    assert make_command(make_line) == CASES[make_line]
