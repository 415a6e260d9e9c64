"""Each stage as the pipelined class builds it: a chain of the model's modules, or a class.

A stage that is a plain chain (each module called on the previous one's output alone) is
built as ``nn.Sequential(model.layer1, model.layer2)`` — or the one module itself; any other
stage gets a small generated ``class StageN(nn.Module)`` whose ``__init__`` holds the model's
own submodules and whose ``forward`` is the stage's code, one line per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from autosplit.codegen.coarse_trace import is_chain
from autosplit.codegen.expressions import ExpressionWriter
from autosplit.codegen.names import path_expression
from autosplit.codegen.structure import CONSTANTS, StageSplit
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
        *(line for path, attr in attrs.items() for line in _attribute_lines(split, path, attr)),
        "",
        *call_lines(4, "def forward", params, ":"),
        *body,
    ]
    return StageCode((), f"Stage{s}", "\n".join(lines))


def _attribute_lines(split: StageSplit, path: str, attr: str) -> list[str]:
    """The lines of ``StageN.__init__`` that hold the model's ``path`` as ``self.<attr>`` (or,
    for a small tensor constant the export made, the constant itself)."""
    if path.startswith(CONSTANTS):
        value = split.constant(path)
        return call_lines(8, "self.register_buffer", [
            quoted(attr), f"torch.tensor({value.tolist()!r}, dtype={value.dtype})",
            "persistent=False"])
    model = split.model
    owner_path, _, leaf = path.rpartition(".")
    owner = model.get_submodule(owner_path)
    expr = path_expression(model, path)
    if leaf in owner._buffers:
        return call_lines(8, "self.register_buffer", [quoted(attr), expr])
    line = f"        self.{attr} = {expr}"
    if len(line) <= LINE_LENGTH:
        return [line]
    return [f"        self.{attr} = (", f"            {expr}", "        )"]  # as ruff writes it
