"""A small GPT (decoder-only transformer) after nanoGPT. A plain nn.Module: no Lightning in here.

Attention keeps q, k and v as separate Linear layers and the MLP names its two layers, so tensor
parallelism can split each one by name (configs/model/gpt.yaml, `parallel`). Heads are counted from
the tensors, not from the config: under tensor parallelism a rank holds only its share of the heads.
With n_expert > 0 every block's MLP is a mixture of experts (models/components/moe.py, model=gpt_moe).
Blocks are a ModuleDict keyed by their index (checkpoint keys `blocks.<i>.` as a ModuleList would give), so a
pipeline stage keeps its own blocks under their original names; its forward skips the embeddings or the head
where a stage has none (distributed/pipeline.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mlproject.models.components.moe import MoE


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head, self.head_dim, self.dropout = n_head, n_embd // n_head, dropout  # preflight reads n_head
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (layer(x).view(b, t, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, n_expert: int = 0, top_k: int = 2):
        super().__init__()
        self.norm1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.norm2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MoE(n_embd, n_expert, top_k, dropout) if n_expert else MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token ids (batch, time) -> next-token logits (batch, time, vocab_size)."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        n_expert: int = 0,
        top_k: int = 2,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must divide by n_head={n_head}")
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleDict(
            {str(i): Block(n_embd, n_head, dropout, bias, n_expert, top_k) for i in range(n_layer)}
        )
        self.norm = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the layers that write into the residual stream by depth, so its variance stays put
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "proj_weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids -> logits; a later pipeline stage (no embeddings) takes hidden states, and a stage before the
        last (no head) returns them."""
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        x = idx
        if self.tok_emb is not None:
            x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(self.norm(x))

    def flops_per_token(self) -> int:
        """Training FLOPs (forward and backward) per token, as nanoGPT's estimate_mfu (PaLM, appendix B):
        6 per weight that multiplies (the embeddings are lookups) plus attention's scores and mixing,
        12 x layers x width (heads x head size) x context. A DTensor counts its global size."""
        weights = sum(p.numel() for name, p in self.named_parameters() if not name.startswith(("tok_emb", "pos_emb")))
        for moe in self.moe_layers:  # a token passes through top_k of the experts only
            experts = sum(p.numel() for p in moe.experts.parameters())
            weights -= experts - experts * moe.top_k // moe.router.out_features
        return 6 * weights + 12 * len(self.blocks) * self.tok_emb.embedding_dim * self.block_size

    @property
    def moe_layers(self) -> list[MoE]:
        return [block.mlp for block in self.blocks.values() if isinstance(block.mlp, MoE)]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (batch, time), feeding back the last block_size."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1] / temperature
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx
