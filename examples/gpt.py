"""A small GPT-style decoder (token ids in, next-token logits out).

A model file for ``autosplit``: ``build_model(size)`` and ``example_inputs(batch_size)``.
``SIZES`` lists the configurations; the default "small" trains on a CPU in seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    # name: (layers, width, heads, vocabulary, context)
    "tiny": (2, 32, 2, 128, 16),
    "small": (6, 128, 4, 1024, 64),
    "medium": (12, 512, 8, 8192, 256),
    # 7.50e9 parameters (untied embeddings, a Llama-3-sized vocabulary): plan it on the meta
    # device (`autosplit plan examples/gpt.py --model-arg size=7b --gpus 8 --device h100-80gb`);
    # building it for real takes 30 GB
    "7b": (32, 4096, 32, 128256, 2048),
}
SEQUENCE = 64  # tokens per sample for the small sizes; "7b" uses its full context


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape[0], x.shape[1], x.shape[2]
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocab: int, context: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(size: str = "small") -> nn.Module:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose one of {', '.join(SIZES)}")
    return GPT(*SIZES[size])


def example_inputs(batch_size: int = 16, size: str = "small") -> tuple[torch.Tensor, ...]:
    *_, vocab, context = SIZES[size]
    tokens = context if size == "7b" else min(SEQUENCE, context)
    return (torch.randint(0, vocab, (batch_size, tokens)),)
