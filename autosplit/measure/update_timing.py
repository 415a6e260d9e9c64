"""The optimizer's update of each block's parameters, timed: what a training step costs after
its last backward (and after the replicas' all-reduce), once per step, on every device.

The update runs once per step whatever the micro-batches, on each stage's own parameters, so a
pipeline of p stages spends about 1/p of it per device and a data-parallel replica all of it
(docs/planning.md, "The optimizer's update").

Each optimizer of :data:`UPDATES` (the names of :data:`autosplit.cost.OPTIMIZER_STATE`) is
timed on copies of the block's parameters with a gradient set, as torch builds it by default
(the for-loop form on CPUs, the fused or foreach form where torch picks it), one warm-up step
(it allocates the state) and ``repeats`` timed steps taking turns over the blocks; the median.
``adam-mixed`` is Adam over fp32 master copies followed by the copy back into the
parameters' own dtype. The user's parameters are never touched.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["UPDATES", "UPDATE_PASSES", "time_updates"]

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

UPDATES: dict[str, Factory] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adam-mixed": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}
"""The optimizer timed for each name of :data:`autosplit.cost.OPTIMIZER_STATE` ("none"
updates nothing)."""

UPDATE_PASSES: dict[str, int] = {
    "sgd": 3,  # read the parameter and its gradient, write the parameter
    "sgd-momentum": 5,  # and read and write the momentum
    "adagrad": 5,  # and read and write the sum of squares
    "adam": 7,  # and read and write both moments
    "adamw": 7,
    "adam-mixed": 14,  # fp32 master and moments (4 bytes each) over 2-byte parameters
}
"""Bytes each update reads and writes per parameter byte, as a memory-bound kernel: what an
estimated profile (:mod:`autosplit.estimate.analytic`) charges for it."""


class _Update:
    """One optimizer over copies of one block's parameters, ready to step."""

    def __init__(self, name: str, params: Sequence[torch.Tensor]) -> None:
        self.own = [p.detach().clone() for p in params]
        mixed = name == "adam-mixed"
        self.master = [p.float() for p in self.own] if mixed else self.own
        for p in self.master:
            p.requires_grad_(True)
            p.grad = torch.full_like(p, 1e-3)
        self.optimizer = UPDATES[name](self.master)
        self.mixed = mixed

    def step(self) -> None:
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for p, q in zip(self.own, self.master):
                    p.copy_(q)


def _wall(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def time_updates(
    params: Sequence[Sequence[torch.Tensor]], dev: torch.device, repeats: int = 3,
) -> tuple[tuple[tuple[str, float], ...], ...]:
    """Per block, ``(optimizer name, ms)`` for every optimizer of :data:`UPDATES`: the median
    of ``repeats`` timed steps over copies of that block's ``params`` (on ``dev``), after one
    warm-up step. A block without parameters costs 0."""
    out: list[list[tuple[str, float]]] = [[] for _ in params]
    for name in UPDATES:
        updates = [_Update(name, ps) if ps else None for ps in params]
        times: list[list[float]] = [[] for _ in params]
        for round_ in range(1 + repeats):
            for i, update in enumerate(updates):
                if update is None:
                    continue
                start = _wall(dev)
                update.step()
                if round_:
                    times[i].append((_wall(dev) - start) * 1000.0)
        for i, row in enumerate(times):
            out[i].append((name, statistics.median(row) if row else 0.0))
        del updates
    return tuple(tuple(row) for row in out)
