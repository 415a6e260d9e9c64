"""How verification times stages: where, with how many threads, how many rounds, within what
budget, with which loss — one checked record for every function of :mod:`autosplit.verify`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autosplit import checks
from autosplit.measure.losses import check_loss

__all__ = ["TimingOptions"]


@checks.known_options
@dataclass(frozen=True, slots=True)
class TimingOptions:
    """The options of :func:`~autosplit.verify.stage_timing.time_stages` and the verification
    built on it, checked when made (a bad value raises ``ArgumentTypeError`` or
    ``InvalidInputError`` naming it).

    Attributes:
        device: where to time; ``None``: the first CUDA device, else the CPU.
        threads: intra-op threads of the CPU worker while timing.
        warmup: untimed rounds before the timed ones.
        rounds: the least number of timed rounds (2 at least: every other round starts
            without gradients, as a step's first micro-batch does).
        max_rounds: the most: rounds go on while a run's interquartile range exceeds 5 % of
            its median and ``budget_s`` is not spent.
        budget_s: time budget (s) of the stage runs; ``None``: no limit.
        loss: the loss timed after a run that ends with the model's last block
            (:data:`autosplit.measure.losses.LOSSES`); ``None``: the profile's where one is
            verified against, else ``"none"``.
    """

    device: str | torch.device | None = None
    threads: int = 1
    warmup: int = 1
    rounds: int = 3
    max_rounds: int = 10
    budget_s: float | None = 60.0
    loss: str | None = None

    def __post_init__(self) -> None:
        checks.optional(checks.instance_of, "device", self.device, (str, torch.device),
                        "a device name or torch.device")
        checks.positive_int("threads", self.threads)
        checks.non_negative_int("warmup", self.warmup)
        checks.positive_int("rounds", self.rounds)
        checks.positive_int("max_rounds", self.max_rounds)
        checks.optional(checks.non_negative_finite, "budget_s", self.budget_s, "s")
        if self.loss is not None:
            check_loss(self.loss)
