"""How the meta-device estimate counts a model: the sizes, the dtype and the attention kernel."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autosplit import checks
from autosplit.errors import ArgumentTypeError

__all__ = ["EstimateOptions"]


@checks.known_options
@dataclass(frozen=True, slots=True)
class EstimateOptions:
    """The options of :func:`~autosplit.estimate.op_counting.count_costs` and
    :func:`~autosplit.estimate.analytic.analytic_profile`, checked when made.

    Attributes:
        microbatch_sizes: sizes b to count; ``None``:
            :func:`autosplit.measure.budget.default_microbatch_sizes` for B and ``stages``.
        stages: the number of stages planned for (only used for the default sizes).
        dtype: count the model with its floating parameters, buffers and inputs in this dtype
            (e.g. ``torch.bfloat16``); ``None``: as they are.
        attention: ``"flash"`` (mask-free ``scaled_dot_product_attention`` counted as the fused
            kernel that GPUs and PyTorch's CPU backend run) or ``"math"`` (the unfused path).
    """

    microbatch_sizes: Sequence[int] | None = None
    stages: int = 2
    dtype: torch.dtype | None = None
    attention: str = "flash"

    def __post_init__(self) -> None:
        if self.microbatch_sizes is not None:
            object.__setattr__(self, "microbatch_sizes", checks.sequence_of(
                "microbatch_sizes", self.microbatch_sizes, checks.positive_int))
        checks.positive_int("stages", self.stages)
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype)
                                           and self.dtype.is_floating_point):
            raise ArgumentTypeError(
                f"dtype must be a floating torch.dtype such as torch.bfloat16, got {self.dtype!r}"
            )
        checks.one_of("attention", self.attention, ("flash", "math"))
