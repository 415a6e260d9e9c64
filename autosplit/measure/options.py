"""How the profiler measures: sizes, rounds, threads, budget and loss, as one checked record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autosplit import checks
from autosplit.measure.losses import check_loss

__all__ = ["ProfileOptions"]


@checks.known_options
@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """The options of :func:`autosplit.profile` and :func:`autosplit.measure.profiler.
    profile_graph`, checked when made (a bad value raises ``ArgumentTypeError`` or
    ``InvalidInputError`` naming it).

    Attributes:
        microbatch_sizes: sizes b to measure; ``None``: :func:`autosplit.measure.budget.
            default_microbatch_sizes` for B and ``stages``, kept in order while they fit
            ``budget_s``. Given sizes are all measured.
        stages: the number of stages planned for (only used to choose default sizes).
        warmup: untimed runs per block and size (after one untimed run of the whole model).
        repeats: the least number of timed runs per block and size; the median is kept.
        max_repeats: the most (``None``: ``3 * repeats``): rounds go on while a figure's
            interquartile range is above 5 % of its median and the budget allows.
        threads: intra-op threads of the CPU worker during measurement.
        budget_s: time budget (s): default sizes are kept, in order, while their measurement
            (estimated from the untimed run of the whole model) fits in it, and extra rounds
            past ``repeats`` stop when it is spent. The first size is always measured, and so
            are the first sizes of fewer and of more micro-batches than 3·p
            (:func:`autosplit.measure.budget.bracketing_count`). ``None``: no limit.
        include: sizes to measure first, whatever the budget (e.g. a hand-written split's).
        loss: the training loss timed with the last block (:data:`autosplit.measure.losses.
            LOSSES`); ``None``: the model's own (``"model"``) where it returns one, else the
            tutorial's ``"mse"``; ``"none"`` leaves it out.
    """

    microbatch_sizes: tuple[int, ...] | None = None
    stages: int = 2
    warmup: int = 1
    repeats: int = 3
    max_repeats: int | None = None
    threads: int = 1
    budget_s: float | None = 40.0
    include: tuple[int, ...] = ()
    loss: str | None = None

    def __post_init__(self) -> None:
        if self.microbatch_sizes is not None:
            object.__setattr__(self, "microbatch_sizes", _sizes("microbatch_sizes",
                                                                self.microbatch_sizes))
        object.__setattr__(self, "include", _sizes("include", self.include, allow_empty=True))
        checks.positive_int("stages", self.stages)
        checks.non_negative_int("warmup", self.warmup)
        checks.positive_int("repeats", self.repeats)
        checks.optional(checks.positive_int, "max_repeats", self.max_repeats)
        checks.positive_int("threads", self.threads)
        checks.optional(checks.non_negative_finite, "budget_s", self.budget_s, "s")
        if self.loss is not None:
            check_loss(self.loss)

    @property
    def most_repeats(self) -> int:
        """The most timed runs per block and size: ``max_repeats``, at least ``repeats``."""
        cap = self.max_repeats if self.max_repeats is not None else 3 * self.repeats
        return max(cap, self.repeats)


def _sizes(name: str, value: Sequence[int], allow_empty: bool = False) -> tuple[int, ...]:
    """``value`` as a tuple of positive integers (checked against the batch later)."""
    return tuple(checks.sequence_of(name, value, checks.positive_int, allow_empty=allow_empty))
