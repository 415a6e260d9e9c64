"""A plan's blocks against the traced model's: the message says which stage and block differ.

No torch import; below :mod:`autosplit.records`, which checks a plan against a model with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autosplit.errors import PlanMismatchError
from autosplit.validation import show

__all__ = ["check_plan_blocks"]


def check_plan_blocks(stages: Sequence[Any], block_names: Sequence[str], model: str = "") -> None:
    """Raise :class:`PlanMismatchError` unless the ``stages``' blocks, concatenated in order,
    are exactly ``block_names`` (the traced model's blocks); ``model`` names it in messages.

    The message names the stage and the block: one the model does not have, one held twice,
    one out of order, or a model block that no stage holds.
    """
    names = list(block_names)
    known = set(names)
    planned = {name for stage in stages for name in stage.blocks}
    fix = ": make a new plan for this model"
    of = f"the model{' ' + model if model else ''}"
    held: dict[str, int] = {}
    pos = 0
    for stage in stages:
        s = stage.index
        for name in stage.blocks:
            if name not in known:
                raise PlanMismatchError(f"stage {s} holds block {name!r}, which {of} does "
                                        f"not have (its blocks: {show(names)}){fix}")
            if name in held:
                raise PlanMismatchError(f"stage {s} holds block {name!r} again (stage "
                                        f"{held[name]} holds it){fix}")
            held[name] = s
            expected = names[pos]  # pos < len(names): the names so far are distinct and known
            if name != expected and expected not in planned:
                raise PlanMismatchError(f"block {expected!r} of {of} is in no stage (stage "
                                        f"{s} holds {name!r} in its place){fix}")
            if name != expected:
                raise PlanMismatchError(f"stage {s} holds block {name!r} where {of} has "
                                        f"{expected!r}: the plan's blocks are out of "
                                        f"order{fix}")
            pos += 1
    if pos < len(names):
        missing, last = names[pos:], stages[-1]
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise PlanMismatchError(
            f"block {missing[0]!r}{more} of {of} is in no stage (the last, stage "
            f"{last.index}, ends with {last.blocks[-1]!r}){fix}"
        )
