"""Names in the generated code: short names for the model's modules, fresh value names."""

from __future__ import annotations

import keyword
import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from autosplit.codegen.text import quoted

# Names the generated code uses itself; graph values and attributes must not shadow them.
GLOBALS = {
    "self", "model", "torch", "nn", "pytree", "functools", "importlib", "os", "sys",
    "model_module", "move", "concat", "DEVICES", "SPLIT_SIZE", "MODEL_FILE", "MODEL_PATH",
    "MODEL_MODULE", "PARAMETERS", "tied_weights", "aten", "collections",
}


def short_names(model: nn.Module, paths: Sequence[str]) -> dict[str, str]:
    """The shortest ``_``-joined tail of each path that no other path shares.

    ``features.denseblock4.denselayer5`` → ``denseblock4_denselayer5`` when other dense blocks
    have a ``denselayer5``; ``layer3.1`` → ``layer3_1``; ``fc`` → ``fc``; the child ``0`` of
    an ``nn.Sequential`` model → ``linear_0`` (after its class).
    """
    distinct = sorted(set(paths))
    short: dict[str, str] = {}
    for path in distinct:
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            name = "_".join(parts[-k:])
            clash = any(o != path and "_".join(o.split(".")[-k:]) == name for o in distinct)
            if name.isidentifier() and not keyword.iskeyword(name) and not clash:
                break
        else:
            name = "_".join(parts)
        if not name.isidentifier():
            kind = re.sub(r"(?<!^)(?=[A-Z])", "_", type(resolve_path(model, path)).__name__).lower()
            name = f"{kind}_" + "".join(c if c.isalnum() else "_" for c in name)
        if hasattr(nn.Module, name) or name in GLOBALS:
            name += "_"
        short[path] = name
    return short


def resolve_path(model: nn.Module, target: str) -> Any:
    """The submodule, parameter or buffer at the dotted path ``target`` of ``model``."""
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def fresh_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2`` … when it is taken or a keyword."""
    if name not in taken and not keyword.iskeyword(name):
        return name
    k = 1
    while f"{name}_{k}" in taken:
        k += 1
    return f"{name}_{k}"


def path_expression(model: nn.Module, path: str, root: str = "model") -> str:
    """``model.layer3[0]``-style expression for a submodule, parameter or buffer of ``model``
    (``root`` is the name the code reads ``model`` by)."""
    expr, obj = root, model
    for part in path.split("."):
        children = getattr(obj, "_modules", {})
        if isinstance(obj, (nn.Sequential, nn.ModuleList)) and part.isdigit() and (
            isinstance(obj, nn.ModuleList) or list(children).index(part) == int(part)
        ):
            expr += f"[{part}]"
        elif part.isidentifier() and not keyword.iskeyword(part):
            expr += f".{part}"
        elif isinstance(obj, nn.ModuleDict):
            expr += f"[{quoted(part)}]"
        else:
            owner, _, leaf = path.rpartition(".")
            if isinstance(resolve_path(model, path), nn.Module):
                return f"{root}.get_submodule({quoted(path)})"
            return f"getattr({root}.get_submodule({quoted(owner)}), {quoted(leaf)})"
        obj = getattr(obj, part)
    return expr
