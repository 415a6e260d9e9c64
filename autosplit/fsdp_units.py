"""Which modules FSDP2 gathers as each block's unit: the ones the graph calls.

FSDP2 (``fully_shard``) gathers a unit's parameters in the forward hooks of its modules, so a
block's unit must be modules that the graph actually calls: the block's own module where the
graph calls it, else the modules inside it that the graph calls (one unit of several modules,
``fully_shard([...])``). A block whose graph reads a parameter directly (``get_attr``: every
weight of a model captured by torch.export; a torch.fx graph that traced through a module
subclass, as timm's ``BatchNormAct2d``) has no such unit.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from autosplit.errors import InvalidInputError

__all__ = ["block_units", "shardable"]


def block_units(body: nn.Module, blocks: Sequence[str]) -> list[nn.Module | list[nn.Module]]:
    """The units of ``blocks`` (module paths in ``body``, a GraphModule), outermost first and
    none inside another, blocks without parameters left out.

    Raises:
        InvalidInputError: a block's graph reads a parameter that no module it calls holds.
    """
    graph = getattr(body, "graph", None)
    called = [str(n.target) for n in graph.nodes if n.op == "call_module"] if graph else []
    units: list[nn.Module | list[nn.Module]] = []
    taken: list[str] = []
    for name in blocks:
        try:
            block = body.get_submodule(name)
        except AttributeError:
            continue  # a block of functions, not a module: the root holds its parameters
        if any(name.startswith(t + ".") for t in taken):
            continue
        params = {id(p) for p in block.parameters()}
        if not params:
            continue
        taken.append(name)
        if name in called:
            units.append(block)
            continue
        inner = _outermost([c for c in called if c.startswith(name + ".")])
        modules = [m for m in map(body.get_submodule, inner) if any(True for _ in m.parameters())]
        if {id(p) for m in modules for p in m.parameters()} != params:
            raise InvalidInputError(
                f"block {name!r}: its graph reads parameters that none of the modules it calls "
                "holds (as a model captured by torch.export does), so FSDP2 cannot gather them "
                "block by block: plan it with replica_mode='ddp'")
        units.append(modules[0] if len(modules) == 1 else modules)
    return units


def _outermost(names: list[str]) -> list[str]:
    """``names`` (module paths) less those inside another of them, in their order."""
    return [n for n in dict.fromkeys(names)
            if not any(n.startswith(o + ".") for o in names if o != n)]


def shardable(body: nn.Module, blocks: Sequence[str]) -> bool:
    """Whether FSDP2 can shard every one of ``blocks`` as a unit (:func:`block_units`)."""
    try:
        block_units(body, blocks)
    except InvalidInputError:
        return False
    return True
