"""A small zoo of models for the tests: each is tiny, deterministic and CPU-friendly."""

from __future__ import annotations

import torch
from torch import nn


class ToyModel(nn.Module):
    """The tutorial's ToyModel: Linear(10, 10) → ReLU → Linear(10, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class LongSkip(nn.Module):
    """The output of the first layer is added back after four more: it crosses every cut."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.norm = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.inp(x)
        h = skip
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(self.norm(h + skip))


class TwoInOut(nn.Module):
    """Two inputs; returns a tuple whose first element is made early, and a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 6)
        self.mix = nn.Linear(6, 6)
        self.head1 = nn.Linear(6, 2)
        self.head2 = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ha = self.a(x)
        h = self.mix(torch.relu(ha + self.b(y)))
        return ha, {"small": self.head1(h), "big": self.head2(h) * y.sum(dim=1, keepdim=True)}


class TokenModel(nn.Module):
    """Token ids in (LongTensor), logits out; a tiny stack of residual MLP layers."""

    def __init__(self, vocab: int = 17, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class DataDependent(nn.Module):
    """Python control flow on tensor values: torch.fx cannot trace it."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return self.lin(-x)


class InOrder(nn.Module):
    """Untraceable, but calls its children one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.middle = DataDependent()
        self.last = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.middle(self.first(x)))


class Branching(nn.Module):
    """Untraceable, and its children are not a chain: no fallback is possible."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(6, 6)
        self.right = DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) + self.right(x)


class TiedLM(nn.Module):
    """A GPT-like language model whose output layer IS the embedding (tied weights).

    Token ids in, logits out: embedding → residual MLP blocks → LayerNorm → ``head``, whose
    weight is the embedding's (``head.weight is embed.weight``), as in GPT-2.
    """

    def __init__(self, vocab: int = 11, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


class TiedFunctional(nn.Module):
    """Tied weights read directly (``F.linear(h, self.embed.weight)``, a ``get_attr``)."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(ids)))
        return nn.functional.linear(h, self.embed.weight)


class ReusedLayer(nn.Module):
    """One Linear called twice, early and late: blocks ``shared`` and ``shared#2`` share it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.shared = nn.Linear(width, width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        return self.out(torch.tanh(self.shared(h)))


class DropNorm(nn.Module):
    """Dropout early (block ``inp``), BatchNorm in the middle (block ``norm``), a skip from
    ``norm`` to the output: for checkpointed stages, whose recomputation must draw the same
    dropout masks and update the BatchNorm statistics once."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.drop = nn.Dropout(0.5)
        self.a = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.b = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.inp(x)))
        h = torch.tanh(self.norm(self.a(h)))
        return self.out(torch.tanh(self.b(h)) + h)


class TupleAcross(nn.Module):
    """A tuple (``chunk``'s) is made in the first block and indexed in the last: a value that
    is neither a tensor nor a size crosses the cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(3, 3)
        self.c = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.a(x).chunk(2, dim=1)
        return self.c(self.b(parts[0])) + parts[1]
