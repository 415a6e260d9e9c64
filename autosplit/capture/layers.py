"""Which module an operation's block is keyed on: the model's repeated layers, wherever they sit.

With ``granularity="block"`` the key of a module path is found walking down from the model:
a container (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) is always entered, and so
is a module that holds a *layer stack* below it: a container of two or more children of one
class that hold parameters (GPT-2's ``transformer.h``, Llama's ``model.layers``, torchvision
ViT's ``encoder.layers``, a ResNet's ``layer3``), or a module whose children are such layers
numbered under one name (timm RegNet's ``s3.b1``, ``s3.b2`` …). The first module that is neither
is the block. So GPT-2 becomes ``transformer.wte``, ``transformer.wpe``, ``transformer.h.0`` …
``transformer.ln_f`` and ``lm_head``, and a ResNet's blocks stay its bottlenecks. A stack of
leaf modules (two convolutions in a ``Sequential``) inside one of the repeated layers belongs
to that layer.
``granularity="layer"`` keys every operation on its innermost module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from torch import nn

__all__ = ["Granularity", "block_key", "entered_paths"]

Granularity = Literal["block", "layer"]
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _is_stack(module: nn.Module) -> bool:
    """A layer stack: a container of two or more children of one class that hold parameters,
    or a module whose children are two or more layers (not containers: ShuffleNet's two
    branches ``branch1``, ``branch2`` are not a stack) of one class numbered under one name
    (timm RegNet's stages hold their bottlenecks as ``b1``, ``b2`` …)."""
    named = list(module.named_children())
    children = [c for _, c in named]
    if len(children) < 2 or len({type(c) for c in children}) != 1:
        return False
    if isinstance(module, CONTAINERS):
        return all(any(True for _ in c.parameters()) for c in children)
    numbered = {re.sub(r"\d+$", "", name) for name, _ in named}
    return (len(numbered) == 1 and all(re.search(r"\d$", name) for name, _ in named)
            and all(_is_layer(c) and not isinstance(c, CONTAINERS) for c in children))


def _inside(path: str, parents: set[str]) -> bool:
    """Whether module ``path`` lies strictly below one of ``parents``."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in parents for i in range(1, len(parts)))


def entered_paths(model: nn.Module, called_again: Iterable[str] = ()) -> frozenset[str]:
    """The module paths a ``"block"`` key walks into: containers, the modules above a layer
    stack, and those above a layer the model calls several times (``called_again``: ALBERT
    runs one layer group for all its depth; a layer inside it, called as often, does not
    count). A stack of leaf modules inside a repeated layer (two
    convolutions in a ``Sequential`` deep in EfficientViT's attention) is part of that layer: it
    does not open the modules above it."""
    modules = dict(model.named_modules())
    stacks = [path for path, module in modules.items() if path and _is_stack(module)]
    layers = {f"{path}.{name}" for path in stacks
              for name, child in modules[path].named_children()
              if any(True for _ in child.children())}
    again = [path for path in called_again if path in modules and _is_layer(modules[path])]
    layers.update(again)
    entered = {""} | {path for path, module in modules.items() if isinstance(module, CONTAINERS)}
    for path in stacks:
        leaves = not any(True for c in modules[path].children() for _ in c.children())
        if leaves and _inside(path, layers):
            continue
        parts = path.split(".")
        entered.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))  # and itself
    for path in again:
        if _inside(path, set(again)):  # a layer of one that is called again itself
            continue
        parts = path.split(".")
        entered.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(entered)


def _is_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a layer: it has submodules, and parameters."""
    return any(True for _ in module.children()) and any(True for _ in module.parameters())


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
