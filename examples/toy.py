"""The tutorial's ToyModel: Linear(10, 10) → ReLU → Linear(10, 5).

A model file for ``autosplit``: ``build_model()`` and ``example_inputs(batch_size)``.
"""

import torch
from torch import nn


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def build_model() -> nn.Module:
    return ToyModel()


def example_inputs(batch_size: int = 20) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 10),)
