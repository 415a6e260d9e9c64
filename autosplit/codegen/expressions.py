"""fx nodes as Python source: one statement per node of a stage's ``forward``.

A module call becomes ``self.<attribute>(…)`` on the stage module, an operator its infix form,
a function its qualified name (``torch.flatten``; a function of the model file is reached
through ``model_module()``), and a constant its literal. Tensors and other objects that have
no literal are refused: they belong in a parameter or buffer of a submodule.
"""

from __future__ import annotations

import builtins
import importlib
import math
import operator
from typing import Any

import torch
from torch import fx

from autosplit.codegen.names import fresh_name, resolve_path
from autosplit.codegen.structure import StageSplit
from autosplit.codegen.text import call_lines, quoted
from autosplit.errors import CodegenError

BINARY = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
    operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
    operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
    operator.le: "<=", operator.gt: ">", operator.ge: ">=",
}
UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}
class ExpressionWriter:
    """Writes the nodes of a stage split as Python source.

    Attributes:
        split: the stage split whose value names the code uses.
        model_module: the name the model file was imported under (its functions are reached
            through ``model_module()`` in the generated code).
        imports: modules outside torch and the model file that the written code calls into.
    """

    def __init__(self, split: StageSplit, model_module: str) -> None:
        self.split = split
        self.model_module = model_module
        self.imports: set[str] = set()

    def attribute(self, target: str, attrs: dict[str, str]) -> str:
        """The stage module's attribute for the model path ``target`` (added to ``attrs``)."""
        if target not in attrs:
            attrs[target] = fresh_name(self.split.short[target], set(attrs.values()))
        return attrs[target]

    def statement(self, node: fx.Node, attrs: dict[str, str]) -> list[str]:
        """The lines of ``forward`` computing ``node``, indented for a method body."""
        head, args = self.expression(node, attrs)
        target = "" if not node.users else f"{self.split.names[node]} = "
        if args is None:
            return [f"        {target}{head}"]
        return call_lines(8, target + head, args)

    def expression(self, node: fx.Node, attrs: dict[str, str]) -> tuple[str, list[str] | None]:
        """(head, arguments) of a call, or (expression, None)."""
        args = list(node.args)
        kwargs = [f"{k}={self.value(v)}" for k, v in node.kwargs.items()]
        if node.op == "call_module":
            if str(node.target).startswith("_tensor_constant"):
                raise CodegenError(f"{node.target} is a tensor made during tracing, not a module")
            attribute = self.attribute(str(node.target), attrs)
            return f"self.{attribute}", [*map(self.value, args), *kwargs]
        if node.op == "get_attr":
            target = str(node.target)
            if target.rpartition(".")[2].startswith("_tensor_constant"):
                raise CodegenError(
                    f"{node.name} reads a tensor constant that tracing created ({target}); "
                    "make it a buffer of the model (register_buffer) to emit code for it"
                )
            return f"self.{self.attribute(target, attrs)}", None
        if node.op == "call_method":
            receiver, *rest = args
            return f"{self.operand(receiver)}.{node.target}", [*map(self.value, rest), *kwargs]
        fn = node.target
        if fn in BINARY and len(args) == 2 and not kwargs:
            return f"{self.operand(args[0])} {BINARY[fn]} {self.operand(args[1])}", None
        if fn in UNARY and len(args) == 1 and not kwargs:
            return f"{UNARY[fn]}{self.operand(args[0])}", None
        if fn is operator.getitem and len(args) == 2 and not kwargs:
            return f"{self.operand(args[0])}[{self.index(args[1])}]", None
        if (
            fn is builtins.getattr
            and len(args) == 2
            and isinstance(args[1], str)
            and args[1].isidentifier()
            and not kwargs
        ):
            return f"{self.operand(args[0])}.{args[1]}", None
        return self.function(fn), [*map(self.value, args), *kwargs]

    def function(self, fn: Any) -> str:
        """How the generated code names a function; records the import it needs."""
        name = getattr(fn, "__name__", None)
        if name and getattr(builtins, name, None) is fn:
            return name
        try:
            qualified = fx.node._get_qualified_name(fn)
        except Exception as exc:
            raise CodegenError(f"cannot name the function {fn!r} in generated code") from exc
        module, _, attr = qualified.rpartition(".")
        module = {"_operator": "operator", "builtins": ""}.get(module, module)
        if module.startswith("torch._C") and getattr(torch.nn.functional, attr, None) is fn:
            return f"torch.nn.functional.{attr}"
        if module == "torch" or module.startswith("torch."):
            return qualified
        if module in ("", None):
            return attr
        if module == self.model_module:
            return f"model_module().{attr}"
        try:
            found = resolve_path(importlib.import_module(module), attr)  # type: ignore[arg-type]
        except (ImportError, AttributeError):
            found = None
        if found is not fn:
            raise CodegenError(
                f"the model calls {qualified}, which generated code cannot import; make it "
                "part of a block module's forward (a submodule) instead of the top level"
            )
        self.imports.add(module)
        return qualified

    def operand(self, value: Any) -> str:
        """``value`` as an operand of an operator: parenthesised unless it is atomic."""
        text = self.value(value)
        if isinstance(value, fx.Node) or text[0] in "([{\"'" or text.replace("_", "").isalnum():
            return text
        return f"({text})"

    def index(self, index: Any) -> str:
        """The text between the brackets of ``x[index]``."""
        if isinstance(index, tuple) and not isinstance(index, torch.Size):
            parts = [self.slice_text(i) for i in index]
            return ", ".join(parts) + ("," if len(parts) == 1 else "") if parts else "()"
        return self.slice_text(index)

    def slice_text(self, value: Any) -> str:
        """One item of an index: ``lo:hi:step`` for a slice."""
        if isinstance(value, slice):
            lo, hi, step = (
                "" if v is None else self.value(v) for v in (value.start, value.stop, value.step)
            )
            return f"{lo}:{hi}" + (f":{step}" if step else "")
        return self.value(value)

    def value(self, value: Any) -> str:
        """A constant or a value of the graph, as source text."""
        if isinstance(value, fx.Node):
            return self.split.names[value]
        if value is None or isinstance(value, (bool, int)):
            return repr(value)
        if isinstance(value, float):
            if math.isinf(value):
                return 'float("inf")' if value > 0 else '-float("inf")'
            return 'float("nan")' if math.isnan(value) else repr(value)
        if isinstance(value, str):
            return quoted(value)
        if value is Ellipsis:
            return "..."
        if isinstance(value, torch.Size):
            return f"torch.Size([{', '.join(map(self.value, value))}])"
        if isinstance(value, tuple):
            items = [self.value(v) for v in value]
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if isinstance(value, list):
            return "[" + ", ".join(self.value(v) for v in value) + "]"
        if isinstance(value, dict):
            items = [f"{self.value(k)}: {self.value(v)}" for k, v in value.items()]
            return "{" + ", ".join(items) + "}"
        if isinstance(value, slice):
            bounds = (value.start, value.stop, value.step)
            return f"slice({', '.join(map(self.value, bounds))})"
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            return str(value)
        if isinstance(value, torch.device):
            return f"torch.device({quoted(str(value))})"
        raise CodegenError(
            f"cannot write the constant {value!r} (a {type(value).__name__}) into generated "
            "code: tensors and other objects are not written out; make it a parameter or "
            "buffer of a submodule"
        )
