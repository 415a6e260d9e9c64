"""A small transformer whose embedding and output head dominate: a 32,000-token vocabulary on a
hidden size of 128 and 2 decoder blocks (token ids in, next-token logits out).

A model file for ``autosplit``: ``build_model(size)`` and ``example_inputs(batch_size)``, as
``examples/gpt.py``. The head is untied (its own 32,000 × 128 weight, not the embedding's), so
the embedding holds 44 % of the parameters and the head another 44 %, while the head's matrix
product over every token is ~15× a block's compute: splitting by parameters or by block count
puts the cut in the wrong place. Same layout and module names as ``examples/gpt.py``
(``tok_emb``, ``pos_emb``, ``blocks``, ``ln_f``, ``lm_head``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    # name: (layers, width, heads, vocabulary, context)
    "tiny": (1, 32, 2, 2048, 16),
    "small": (2, 128, 4, 32000, 32),
}
BATCH_SIZE = 32


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a 4× MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape[0], x.shape[1], x.shape[2]
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class BigVocab(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocab: int, context: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)  # untied from tok_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(size: str = "small") -> nn.Module:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose one of {', '.join(SIZES)}")
    return BigVocab(*SIZES[size])


def example_inputs(batch_size: int = BATCH_SIZE, size: str = "small") -> tuple[torch.Tensor, ...]:
    """``batch_size`` sequences of ``context`` random token ids."""
    vocab, context = SIZES[size][3:]
    return (torch.randint(0, vocab, (batch_size, context)),)
