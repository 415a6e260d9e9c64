"""Which rank holds which stage, as torch's schedule classes place them."""

from __future__ import annotations

from autosplit.errors import InvalidInputError

__all__ = ["V_SCHEDULES", "stage_indices", "stage_ranks"]

V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules placing stages in a V: of 2k stages on k ranks, rank r holds r and 2k − 1 − r."""


def stage_ranks(num_stages: int, world_size: int, v_shape: bool = False) -> tuple[int, ...]:
    """The pipeline rank holding each stage (torch's ``generate_stage_to_rank_mapping``).

    Looped (default): stage s on rank s mod w (w = world size). ``v_shape`` (ZB-V, DualPipeV):
    the stages go down the ranks and back up, so with 2w stages rank r holds r and 2w − 1 − r.

    Raises:
        InvalidInputError: ``num_stages`` is not a multiple of ``world_size``.
    """
    if world_size < 1 or num_stages % world_size:
        raise InvalidInputError(
            f"a plan of {num_stages} stages cannot be spread over {world_size} processes: use "
            f"{num_stages} processes (one per stage) or a divisor of {num_stages}"
        )
    if not v_shape:
        return tuple(s % world_size for s in range(num_stages))
    return tuple(s % world_size if (s // world_size) % 2 == 0
                 else world_size - 1 - s % world_size for s in range(num_stages))


def stage_indices(num_stages: int, rank: int, world_size: int,
                  v_shape: bool = False) -> tuple[int, ...]:
    """The stages rank ``rank`` holds, ascending: ``rank, rank + w, rank + 2w …`` (w = world
    size), or with ``v_shape`` the V of :func:`stage_ranks` (``rank, 2w − 1 − rank``).

    One stage per rank when ``world_size == num_stages``; several (interleaved schedules)
    when ``num_stages`` is a multiple of ``world_size``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidInputError(f"rank {rank} is outside a world of {world_size} processes")
    ranks = stage_ranks(num_stages, world_size, v_shape)
    return tuple(s for s, r in enumerate(ranks) if r == rank)
