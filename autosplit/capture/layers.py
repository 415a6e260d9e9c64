"""Which module an operation's block is keyed on: the model's repeated layers, wherever they sit.

With ``granularity="block"`` the key of a module path is found walking down from the model:
a container (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) is always entered, and so
is a module that holds a *layer stack* below it: a container of two or more children of one
class that hold parameters (GPT-2's ``transformer.h``, Llama's ``model.layers``, torchvision
ViT's ``encoder.layers``, a ResNet's ``layer3``). The first module that is neither is the
block. So GPT-2 becomes ``transformer.wte``, ``transformer.wpe``, ``transformer.h.0`` …
``transformer.ln_f`` and ``lm_head``, and a ResNet's blocks stay its bottlenecks.
``granularity="layer"`` keys every operation on its innermost module.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

__all__ = ["Granularity", "block_key", "entered_paths"]

Granularity = Literal["block", "layer"]
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _is_stack(module: nn.Module) -> bool:
    if not isinstance(module, CONTAINERS):
        return False
    children = list(module.children())
    return (len(children) >= 2 and len({type(c) for c in children}) == 1
            and all(any(True for _ in c.parameters()) for c in children))


def entered_paths(model: nn.Module) -> frozenset[str]:
    """The module paths a ``"block"`` key walks into: containers, and the modules above a
    layer stack."""
    entered = {""}
    for path, module in model.named_modules():
        if isinstance(module, CONTAINERS):
            entered.add(path)
        if _is_stack(module) and path:
            parts = path.split(".")
            entered.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(entered)


def block_key(entered: frozenset[str], path: str, granularity: Granularity) -> str:
    """The module path an operation run in module ``path`` is grouped under ("" for the
    model's own code); ``entered`` is :func:`entered_paths` of the model."""
    if granularity == "layer" or not path:
        return path
    prefix = ""
    for part in path.split("."):
        prefix = f"{prefix}.{part}" if prefix else part
        if prefix not in entered:
            return prefix
    return path
