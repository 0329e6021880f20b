"""What the gpt example's tests share (dropped with the example: scripts/rename_project.py)."""

# The GPT of the strategy proofs: 2 blocks of width 32 on windows of 32 bytes, a small eval split.
TINY_GPT = [
    "model=gpt",
    "data=text",
    "model.net.n_layer=2",
    "model.net.n_head=4",
    "model.net.n_embd=32",
    "data.block_size=32",
    "data.batch_size=8",
    "data.val_fraction=0.005",
    "data.test_fraction=0.005",
]
