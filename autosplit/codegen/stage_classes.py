"""Each stage as the pipelined class builds it: a chain of the model's modules, or a class.

A stage that is a plain chain (each module called on the previous one's output alone) is
built as ``nn.Sequential(model.layer1, model.layer2)`` — or the one module itself; any other
stage gets a small generated ``class StageN(nn.Module)`` whose ``__init__`` holds the model's
own submodules and whose ``forward`` is the stage's code, one line per node.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass

from torch import nn

from autosplit.codegen.expressions import ExpressionWriter
from autosplit.codegen.names import resolve_path
from autosplit.codegen.structure import StageSplit, is_chain
from autosplit.codegen.text import (
    LINE_LENGTH,
    block_span,
    call_lines,
    counted,
    docstring_safe,
    quoted,
)


@dataclass(frozen=True, slots=True)
class StageCode:
    """How the pipelined class's ``__init__`` builds one stage.

    Attributes:
        modules: the expressions of the model's modules a plain-chain stage runs in order
            (``model.layer1``); empty for a stage with its own class.
        class_name: ``StageN`` for a stage with its own class, else ``""``.
        class_source: the source of that class, else ``""``.
    """

    modules: tuple[str, ...]
    class_name: str = ""
    class_source: str = ""


def stage_code(split: StageSplit, expressions: ExpressionWriter, s: int) -> StageCode:
    """The code of stage s (records the imports its statements need in ``expressions``)."""
    nodes = split.nodes_of(s)
    inputs, outputs = split.inputs_of(s), split.outputs_of(s)
    chain = (
        len(inputs) == 1
        and outputs == nodes[-1:]
        and all(n.op == "call_module" for n in nodes)
        and nodes[0].args == (inputs[0],)
        and not nodes[0].kwargs
        and is_chain(nodes, split.stage)
    )
    if chain:
        return StageCode(tuple(path_expression(split.model, str(n.target)) for n in nodes))
    attrs: dict[str, str] = {}  # model path -> attribute of the stage module
    body: list[str] = []  # forward's statements, indented
    for node in nodes:
        body += expressions.statement(node, attrs)
    returned = [split.names[n] for n in outputs]
    if returned:
        line = "        return " + ", ".join(returned)
        body += [line] if len(line) <= LINE_LENGTH else call_lines(8, "return ", returned)
    blocks = split.blocks[s]
    params = ["self", *(split.names[n] for n in inputs)]
    summary = f"Stage {s}: {docstring_safe(block_span(blocks))} ({counted(len(blocks), 'block')})"
    lines = [
        f"class Stage{s}(nn.Module):",
        f'    """{summary}, the model\'s own modules."""',
        "",
        "    def __init__(self, model):",
        "        super().__init__()",
        *("        " + _attribute_line(split.model, path, attr) for path, attr in attrs.items()),
        "",
        *call_lines(4, "def forward", params, ":"),
        *body,
    ]
    return StageCode((), f"Stage{s}", "\n".join(lines))


def _attribute_line(model: nn.Module, path: str, attr: str) -> str:
    """The line of ``StageN.__init__`` that holds the model's ``path`` as ``self.<attr>``."""
    owner_path, _, leaf = path.rpartition(".")
    owner = model.get_submodule(owner_path)
    expr = path_expression(model, path)
    if leaf in owner._buffers:
        return f"self.register_buffer({quoted(attr)}, {expr})"
    return f"self.{attr} = {expr}"


def path_expression(model: nn.Module, path: str) -> str:
    """``model.layer3[0]``-style expression for a submodule, parameter or buffer."""
    expr, obj = "model", model
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
                return f"model.get_submodule({quoted(path)})"
            return f"getattr(model.get_submodule({quoted(owner)}), {quoted(leaf)})"
        obj = getattr(obj, part)
    return expr
