"""torchgpipe 0.0.7 as a peer of the comparison (``compare.py``): its own ``balance_by_time`` on
a model flattened into an ``nn.Sequential``, its layer counts mapped back to autosplit's blocks.

torchgpipe is optional (``pip install torchgpipe==0.0.7``); without it ``balance_by_time`` and
``TORCHGPIPE`` (its version) are ``None``.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

try:  # optional peer: pip install torchgpipe==0.0.7
    from torchgpipe.balance import balance_by_time

    TORCHGPIPE = importlib.metadata.version("torchgpipe")
except ImportError:  # pragma: no cover - depends on the machine
    balance_by_time = None
    TORCHGPIPE = None

INSTALL_TORCHGPIPE = "pip install torchgpipe==0.0.7"


class _Embeddings(nn.Module):
    """examples/gpt.py's token + position embedding as one layer (torchgpipe needs a Sequential)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.tok_emb = gpt.tok_emb
        self.pos_emb = gpt.pos_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))


def flatten(key: str, model: Any) -> list[tuple[str, nn.Module]]:
    """The model as a list of (autosplit block that the layer belongs to, layer) for torchgpipe's
    nn.Sequential. A layer covers the blocks from the previous layer's block up to its own."""
    if key.startswith("resnet"):
        # torchgpipe times each layer on a detached leaf input: the stem's in-place ReLU would
        # fail there, so the flattened copy uses an out-of-place one (same function)
        layers = [("conv1", model.conv1), ("bn1", model.bn1), ("bn1", nn.ReLU()), ("bn1", model.maxpool)]
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            layers += [(f"{stage}.{i}", block) for i, block in enumerate(getattr(model, stage))]
        last = layers[-1][0]
        return layers + [(last, model.avgpool), (last, nn.Flatten(1)), ("fc", model.fc)]
    if key.startswith("gpt-"):
        layers = [("pos_emb", _Embeddings(model))]
        layers += [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
        return layers + [("ln_f", model.ln_f), ("lm_head", model.lm_head)]
    raise ValueError(f"no nn.Sequential form of {key}")


def to_block_balance(layer_balance: Sequence[int], owners: Sequence[str],
                     block_names: Sequence[str]) -> tuple[tuple[int, ...], list[str]]:
    """torchgpipe's layer counts as autosplit block counts; a cut inside a block moves to the
    block's end (noted)."""
    index = {name: i for i, name in enumerate(block_names)}
    ranks = [index[o] for o in owners]
    assert ranks == sorted(ranks) and ranks[-1] == len(block_names) - 1, "layers out of block order"
    notes, ends, start = [], [], 0
    for count in layer_balance[:-1]:
        start += count
        before, after = owners[start - 1], owners[start]
        if before == after:
            notes.append(f"torchgpipe's cut inside block {before} moved to its end")
        ends.append(index[before] + 1)
    bounds = [0, *ends, len(block_names)]
    balance = tuple(b - a for a, b in itertools.pairwise(bounds))
    if min(balance) < 1:
        raise ValueError(f"torchgpipe's balance {list(layer_balance)} maps to an empty stage")
    return balance, notes


def torchgpipe_balance(key: str, model: nn.Module, inputs: tuple[torch.Tensor, ...],
                       split_size: int, block_names: Sequence[str], device: torch.device) -> dict[str, Any]:
    """torchgpipe 0.0.7's balance_by_time for 2 partitions on one micro-batch of ``split_size``
    of the model ``key`` (a :class:`harness.ModelSpec` key); its time in seconds."""
    pairs = flatten(key, model)
    sequential = nn.Sequential(*(layer for _, layer in pairs))
    sample = tuple(x[:split_size].to(device) for x in inputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one CPU worker, as autosplit's profile
    start = time.perf_counter()
    try:
        layer_balance = balance_by_time(2, sequential, sample[0] if len(sample) == 1 else sample,
                                        device=device)
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    balance, notes = to_block_balance(layer_balance, [o for o, _ in pairs], block_names)
    return {"layer_balance": list(layer_balance), "layers": len(pairs), "balance": balance,
            "notes": notes, "seconds": seconds, "sample_rows": split_size}
