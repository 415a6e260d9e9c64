"""Exceptions raised by autosplit.

Every error raised at the public boundary is an :class:`AutosplitError`; those caused by a bad
argument are also ``ValueError`` so that generic callers can catch them, and an argument of the
wrong type (:class:`ArgumentTypeError`) is a ``TypeError`` as well. Messages name the
offending value and say what to change. The CLI turns any of these into one line and exit 2.
"""

from __future__ import annotations

__all__ = [
    "AutosplitError",
    "InvalidInputError",
    "ArgumentTypeError",
    "TraceError",
    "CutValueError",
    "InfeasiblePlanError",
    "ModelMismatchError",
    "RecordFileError",
    "CodegenError",
    "ModelFileError",
    "RankFailedError",
    "ScheduleUnavailableError",
    "RendezvousError",
]


class AutosplitError(Exception):
    """Base class of every error autosplit raises on purpose."""


class InvalidInputError(AutosplitError, ValueError):
    """An argument (model, inputs, device count, size string, …) is not acceptable."""


class ArgumentTypeError(InvalidInputError, TypeError):
    """An argument has the wrong type (a string for a count, a float for an integer, …)."""


class ModelFileError(InvalidInputError):
    """The model file is missing, fails on import, or defines no model."""


class CutValueError(InvalidInputError):
    """A value that is not a tensor crosses a cut between stages (or leaves the last stage as
    part of the model's output); the message names it, the block that made it and the cut."""


class TraceError(AutosplitError):
    """The model cannot be captured as an ordered list of blocks."""


class InfeasiblePlanError(AutosplitError, ValueError):
    """No plan satisfies the memory limits.

    Attributes:
        min_capacity_bytes: the smallest per-device memory (bytes) with which a plan exists,
            or ``None`` when not even unlimited memory would help.
        stage: index of the stage that needs ``min_capacity_bytes`` in that smallest plan.
        blocks: the names of the first and last block of that stage, when known.
        finding: what does not fit, without the advice in the library's words that follows it
            in the message (``""``: the message alone); the command line follows it with its
            own options' names instead.
    """

    def __init__(
        self,
        message: str,
        *,
        min_capacity_bytes: float | None = None,
        stage: int | None = None,
        blocks: tuple[str, str] | None = None,
        finding: str = "",
    ) -> None:
        super().__init__(message)
        self.min_capacity_bytes = min_capacity_bytes
        self.stage = stage
        self.blocks = blocks
        self.finding = finding


class ModelMismatchError(AutosplitError, ValueError):
    """A plan or profile was made for another model (its fingerprint or block names differ)."""


class RecordFileError(AutosplitError, ValueError):
    """An autosplit JSON file (plan, profile, device spec) cannot be read.

    The file is missing, not JSON, or lacks a required field; the message names the file and
    the field.
    """


PlanMismatchError = ModelMismatchError
"""Former name of :class:`ModelMismatchError` (the same class)."""

PlanFileError = RecordFileError
"""Former name of :class:`RecordFileError` (the same class)."""


class CodegenError(AutosplitError):
    """The model's code cannot be written as the plan's stages; the message says why."""


class RankFailedError(AutosplitError):
    """A rank of a multi-process run died or raised; the message names it and its error.

    Attributes:
        rank: the rank that failed first (global rank).
        failures: ``{rank: one-line reason}`` for every rank that failed.
    """

    def __init__(self, message: str, *, rank: int, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures = failures


class ScheduleUnavailableError(InvalidInputError):
    """torch's schedule class cannot run the given ranks, stages per rank and micro-batches
    (e.g. 1F1B with fewer micro-batches than stages, ZB-V with v ≠ 2).

    Attributes:
        schedule: the autosplit schedule name; p, v, m: ranks, stages per rank, micro-batches.
        reason: torch's own message, on one line.
    """

    def __init__(self, message: str, *, schedule: str, p: int, v: int, m: int,
                 reason: str) -> None:
        super().__init__(message)
        self.schedule = schedule
        self.p, self.v, self.m = p, v, m
        self.reason = reason


class RendezvousError(AutosplitError):
    """A rank could not join its process group within the timeout: the rendezvous its
    environment names (``MASTER_ADDR``:``MASTER_PORT``) had no rank 0, or not every rank came;
    the message names the address, the rank and the variables it was read from."""
