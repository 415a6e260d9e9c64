"""A plan's cuts as ``torch.distributed.pipelining``'s ``split_spec``, where that can be done.

``pipeline(model, mb_args, split_spec=to_split_spec(plan, model))`` splits the model where the
plan does when every stage after the first begins where a submodule's forward begins.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from autosplit.errors import InvalidInputError
from autosplit.records import Plan
from autosplit.stages import graph_for_plan, stage_layout

__all__ = ["to_split_spec", "split_spec_problems"]

_FIX = (
    "make a plan whose stages start at submodules (e.g. granularity='block' or a manual split), "
    "or run this plan with autosplit.distributed / `autosplit run`, which split between any "
    "two blocks"
)


def to_split_spec(plan: Plan, model: nn.Module | None = None) -> dict[str, Any]:
    """The cuts of ``plan`` as ``{fqn: SplitPoint.BEGINNING}``.

    Every stage after the first must begin where a submodule's forward begins (the block's name
    is that submodule's qualified name). Without ``model`` only the block names are checked;
    with it (recommended) each cut is checked against the traced model: the stage must begin
    with the submodule's first operation, and the submodule must be called once.

    Raises:
        InvalidInputError: a cut does not fall on a module boundary; the message names the
            stage and the block. Such plans run with ``autosplit.distributed`` (Trainer,
            ``autosplit run``), which splits between any two blocks.
        PlanMismatchError: ``model`` is not the model this plan was made for.
    """
    from torch.distributed.pipelining import SplitPoint

    for index, name in enumerate(plan.split_points, start=1):
        if not name or name == "ops" or "#" in name:
            raise InvalidInputError(
                f"stage {index} begins with block {name!r}, which is not a module boundary "
                f"(a repeated call or loose operations): {_FIX}"
            )
    if model is not None:
        problems = split_spec_problems(model, plan)
        if problems:
            raise InvalidInputError(f"{'; '.join(problems)}: {_FIX}")
    return {name: SplitPoint.BEGINNING for name in plan.split_points}


def split_spec_problems(model: nn.Module, plan: Plan) -> list[str]:
    """Why ``plan``'s cuts are not all module boundaries of ``model`` (empty: they are).

    A cut is a module boundary for ``torch.distributed.pipelining.pipeline`` when the stage
    after it begins with the first operation of a submodule that is called once: splitting
    "at the beginning of" that submodule then cuts the same place.
    """
    from autosplit.blocks import module_path

    graph = graph_for_plan(model, plan)
    nodes = [n for n in graph.module.graph.nodes if n.op not in ("placeholder", "output")]
    position = {n.name: i for i, n in enumerate(nodes)}
    problems = []
    for spec in stage_layout(graph, plan).stages[1:]:
        s, block = spec.index, graph.blocks[spec.first]
        fqn = block.name
        try:
            model.get_submodule(fqn)
        except AttributeError:
            problems.append(f"stage {s} begins with block {fqn!r}, which is not a submodule")
            continue
        inside = [position[n.name] for n in nodes
                  if (p := module_path(graph.module, n)) == fqn or p.startswith(fqn + ".")]
        if not inside or inside[0] != position[block.nodes[0]]:
            problems.append(f"stage {s} begins inside module {fqn!r}, not where its forward begins")
        elif inside != list(range(inside[0], inside[0] + len(inside))):
            problems.append(
                f"stage {s} begins at module {fqn!r}, which is called more than once or "
                "interleaved with other operations"
            )
    return problems
