"""Plan heuristics that peers use, as pure functions returning a balance (no torch).

A *balance* is the number of blocks per stage, e.g. ``(3, 2)`` for 5 blocks on p = 2 stages
(torchgpipe's form). These are the baselines autosplit's exact solvers are compared against:

* :func:`uniform`: DeepSpeed's ``partition_method="uniform"``, equal block counts.
* :func:`by_parameters`: DeepSpeed's ``partition_method="parameters"``, balanced parameter
  counts (here the exact min-max on parameter bytes, and never an empty stage).
* :func:`block_partition`: torchgpipe's ``balance_by_time`` partitioner, the "Block Partitions
  of Sequences" procedure (Bárány & Grinberg): greedy boundary moves; fast, not always optimal.
* :func:`manual`: the user's own cut points by block name, as in the tutorial
  (``seq1 = … layer2`` / ``seq2 = layer3 …`` is ``manual(names, ["layer3"])``).
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Sequence

from autosplit import checks
from autosplit.errors import ArgumentTypeError, InvalidInputError
from autosplit.solve.dp import solve_dp
from autosplit.solve.problem import PartitionProblem

__all__ = ["block_partition", "by_parameters", "manual", "uniform"]


def _parts(p: int, n: int) -> int:
    p = checks.positive_int("p (stages)", p)
    if p > n:
        raise InvalidInputError(
            f"cannot split {n} blocks into {p} non-empty stages: use at most {n} stages"
        )
    return p


def _weights(values: Sequence[float], what: str) -> list[float]:
    return list(checks.sequence_of(what, values, checks.non_negative_finite))


def uniform(n: int, p: int) -> tuple[int, ...]:
    """Equal block counts; the ``n mod p`` extra blocks go to the earliest stages.

    >>> uniform(10, 3)
    (4, 3, 3)

    Raises:
        ArgumentTypeError: ``n`` or ``p`` is not an int.
        InvalidInputError: ``n`` < 1, ``p`` < 1 or ``p`` > ``n``.
    """
    n = checks.positive_int("n (blocks)", n)
    _parts(p, n)
    q, r = divmod(n, p)
    return tuple(q + 1 if s < r else q for s in range(p))


def by_parameters(param_bytes: Sequence[float], p: int) -> tuple[int, ...]:
    """Balance by parameter size: minimise the largest stage's parameter bytes.

    DeepSpeed's ``"parameters"`` method balances parameter counts; this is the exact min-max
    of the same weights (blocks without parameters weigh 0), solved with
    :func:`~autosplit.solve.dp.solve_dp`, so ties go to the earliest cut and no stage is empty.

    Args:
        param_bytes: parameter bytes (or counts) of each block.
        p: number of stages, 1 ≤ p ≤ len(param_bytes).

    Raises:
        ArgumentTypeError: ``param_bytes`` is not a list of numbers, or ``p`` not an int.
        InvalidInputError: a negative or non-finite entry, no block, or a bad ``p``.
    """
    weights = _weights(param_bytes, "param_bytes")
    _parts(p, len(weights))
    return solve_dp(PartitionProblem.build(weights, p)).balance


def _sums(costs: list[float], balance: list[int]) -> list[float]:
    out, start = [], 0
    for count in balance:
        out.append(math.fsum(costs[start : start + count]))
        start += count
    return out


def block_partition(costs: Sequence[float], p: int) -> tuple[int, ...]:
    """The "Block Partitions of Sequences" heuristic (Bárány & Grinberg), as torchgpipe uses it.

    Written from the paper's procedure: with M the largest block sum and m the smallest, and the
    costs scaled so that the largest is 1, the paper proves a partition with M ≤ m + 1 exists and
    reaches one by moving boundary elements:

    1. Start from :func:`uniform`.
    2. Let B_p be the largest block (first on ties). Stop if M − m ≤ max(costs).
    3. Let B_q be the smallest block closest to B_p (first on ties) and B_h its neighbour on
       B_p's side; move the element of B_h next to B_q into B_q (the last element of B_h if
       q > p, the first if q < p). Repeated, this walks spare room from the smallest block to
       the largest, whose boundary element then moves out.
    4. Keep the best partition seen (smallest M, then the earlier one); stop when a state repeats,
       when M grows, or when a move would empty a block. Return the best.

    Never better than the exact optimum and often equal to it, but it can stop early; that is why
    torchgpipe documents it as "not always optimal" and why it is a baseline here.

    Args:
        costs: time of each block (any unit, ≥ 0).
        p: number of stages, 1 ≤ p ≤ len(costs).

    Raises:
        ArgumentTypeError: ``costs`` is not a list of numbers, or ``p`` not an int.
        InvalidInputError: a negative or non-finite cost, no block, or a bad ``p``.
    """
    x = _weights(costs, "costs")
    n = len(x)
    _parts(p, n)
    largest = max(x)
    balance = list(uniform(n, p))
    best = (max(_sums(x, balance)), tuple(balance))
    seen = {tuple(balance)}
    while True:
        sums = _sums(x, balance)
        big = max(sums)
        bp = sums.index(big)
        small = min(sums)
        if big - small <= largest:
            break
        candidates = [s for s in range(p) if sums[s] == small]
        bq = min(candidates, key=lambda s: (abs(s - bp), s))
        bh = bq + 1 if bq < bp else bq - 1
        if balance[bh] == 1:
            break  # the move would empty B_h: every stage must keep a block
        balance[bh] -= 1
        balance[bq] += 1
        state = tuple(balance)
        if state in seen:
            break
        seen.add(state)
        new_big = max(_sums(x, balance))
        if new_big > big:
            break
        if new_big < best[0]:
            best = (new_big, state)
    return best[1]


def manual(block_names: Sequence[str], split_points: Sequence[str]) -> tuple[int, ...]:
    """The balance that starts a new stage at each of ``split_points``.

    Each split point names the first block of a stage after the first: a block name such as
    ``"layer3.0"``, or a module prefix such as ``"layer3"``, meaning the first block whose name
    equals it or starts with ``"layer3."``. ``manual(names, ["layer3"])`` is the tutorial's
    two-stage ResNet50 split; p = len(split_points) + 1.

    Raises:
        ArgumentTypeError: ``block_names`` or ``split_points`` is a string or holds non-strings.
        InvalidInputError: an unknown name (the message lists the valid ones), a point that
            names the first block (stage 0 would be empty), or points out of order or repeated.
    """
    checks.sequence_of("block_names", block_names, checks.text, allow_empty=True)
    if isinstance(split_points, (str, bytes)):
        raise ArgumentTypeError(
            f"split_points must be a list of names, got the string {split_points!r}: "
            f"wrap a single split point in a list, e.g. [{split_points!r}]"
        )
    checks.sequence_of("split_points", split_points, checks.text, allow_empty=True)
    names = [str(name) for name in block_names]
    if not names:
        raise InvalidInputError("block_names is empty: there must be at least one block")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidInputError(f"block_names must be unique, repeated: {repeated}")
    starts: list[int] = []
    for point in split_points:
        point = str(point)
        index = next(
            (i for i, name in enumerate(names) if name == point or name.startswith(point + ".")),
            None,
        )
        if index is None:
            prefixes = [".".join(name.split(".")[:k]) for name in names for k in (1, 2)]
            choices = list(dict.fromkeys([*prefixes, *names]))  # module prefixes first, in order
            close = difflib.get_close_matches(point, choices, n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            shown = names if len(names) <= 40 else names[:40] + [f"… {len(names) - 40} more"]
            raise InvalidInputError(
                f"unknown split point {point!r}{hint}: use a block name or module prefix, "
                f"one of {shown}"
            )
        if index == 0:
            raise InvalidInputError(
                f"split point {point!r} is the first block {names[0]!r}, which would leave "
                "stage 0 empty: name the first block of the second stage"
            )
        if starts and index <= starts[-1]:
            what = "repeats" if index == starts[-1] else "comes before"
            raise InvalidInputError(
                f"split point {point!r} (block {index}, {names[index]!r}) {what} the previous "
                f"split point (block {starts[-1]}, {names[starts[-1]]!r}): give split points "
                "once each, in model order"
            )
        starts.append(index)
    bounds = [0, *starts, len(names)]
    return tuple(b - a for a, b in itertools.pairwise(bounds))
