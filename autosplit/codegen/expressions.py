"""fx nodes as Python source: one statement per node of a stage's ``forward``.

A module call becomes ``self.<attribute>(…)`` on the stage module, an operator its infix form,
a function its qualified name (``torch.flatten``; a function of the model file is reached
through ``model_module()``), and a constant its literal. Tensors and other objects that have
no literal are refused: they belong in a parameter or buffer of a submodule.
"""

from __future__ import annotations

import builtins
import collections
import importlib
import math
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autosplit.capture.exported import BODIES, device_of, device_type_of
from autosplit.codegen.names import fresh_name, path_expression, resolve_path
from autosplit.codegen.structure import EXPORT_CHECKS, StageSplit
from autosplit.codegen.text import LINE_LENGTH, call_lines, quoted
from autosplit.errors import CodegenError

BINARY = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
    operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
    operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
    operator.le: "<=", operator.gt: ">", operator.ge: ">=",
}
CONTEXTS = {
    torch.ops.higher_order.wrap_with_autocast:
        ("torch.autocast", ("", "dtype", "enabled", "cache_enabled")),
}
"""torch.export's higher-order operations for a region under a context: the context manager
the code enters, and the keywords of the operation's leading arguments, its arguments (""
for a positional one; then come the body and its operands)."""
UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}

# A value built from others: a leaf's text, or (opening, items, closing) of a literal or call.
Tree = str | tuple[str, list["Tree"], str]


def tree_text(tree: Tree) -> str:
    """``tree`` on one line."""
    if isinstance(tree, str):
        return tree
    opening, items, closing = tree
    return opening + ", ".join(map(tree_text, items)) + closing.lstrip(",") if len(items) != 1 \
        else opening + tree_text(items[0]) + closing


def tree_lines(tree: Tree, indent: int, head: str = "") -> list[str]:
    """``head`` followed by ``tree``, on one line where it fits in the line length, else with
    one item per line (as ruff formats it), each indented 4 more."""
    pad = " " * indent
    line = pad + head + tree_text(tree)
    if isinstance(tree, str) or len(line) <= LINE_LENGTH:
        return [line]
    opening, items, closing = tree
    lines = [pad + head + opening]
    for item in items:
        *body, last = tree_lines(item, indent + 4)
        lines += [*body, last + ","]
    return [*lines, pad + closing.lstrip(",")]


def _prefixed(prefix: str, tree: Tree) -> Tree:
    """``tree`` written after ``prefix`` (``key=``, ``"key": ``)."""
    if isinstance(tree, str):
        return prefix + tree
    opening, items, closing = tree
    return (prefix + opening, items, closing)


class ExpressionWriter:
    """Writes the nodes of a stage split as Python source.

    Attributes:
        split: the stage split whose value names the code uses.
        model_module: the name the model file was imported under (its functions are reached
            through ``model_module()`` in the generated code).
        imports: modules outside torch and the model file that the written code calls into.
        inline: values written where they are used rather than named (an exported model's
            weights, ``self.layers_0.mlp.up_proj.weight``).
        aten: whether the code calls torch's operators, as ``aten.add.Tensor`` (the module
            then defines ``aten = torch.ops.aten``).
    """

    def __init__(self, split: StageSplit, model_module: str) -> None:
        self.split = split
        self.model_module = model_module
        self.imports: set[str] = set()
        self.inline: dict[fx.Node, str] = {}  # values written where they are used
        self.aten = False  # whether the code calls torch's operators (``aten.…``)

    def attribute(self, target: str, attrs: dict[str, str]) -> str:
        """The stage module's attribute for the model path ``target`` (added to ``attrs``)."""
        if target not in attrs:
            attrs[target] = fresh_name(self.split.short[target], set(attrs.values()))
        return attrs[target]

    def statement(self, node: fx.Node, attrs: dict[str, str]) -> list[str]:
        """The lines of ``forward`` computing ``node``, indented for a method body (none for
        an exported model's weight: it is read where it is used)."""
        if node.op == "get_attr" and str(node.target).startswith(f"{BODIES}."):
            return []  # a region's body: written out where the region runs
        if node.op == "call_function" and node.target in CONTEXTS:
            return self.region(node, attrs)
        if any(str(a.target).startswith(f"{BODIES}.") for a in node.all_input_nodes
               if a.op == "get_attr"):
            raise CodegenError(
                f"{node.name} runs torch.export's higher-order operation {node.target}, which "
                "generated code cannot write; run the plan with autosplit.partition(model, "
                "plan=plan) instead")
        head, args = self.expression(node, attrs)
        if self.split.exported and (node.op == "get_attr" or node.target in (device_of,
                                                                            device_type_of)):
            self.inline[node] = head  # a weight, or a tensor's device
            return []
        target = "" if not node.users else f"{self.split.names[node]} = "
        if args is None:
            line = f"        {target}{head}"
            if len(line) <= LINE_LENGTH or not target:
                return [line]
            return [f"        {target}(", f"            {head}", "        )"]
        return call_lines(8, target + head, args)

    def region(self, node: fx.Node, attrs: dict[str, str]) -> list[str]:
        """A region under a context (torch.export's higher-order operation, :data:`CONTEXTS`):
        ``with torch.autocast(...):`` over its body's operations, one line each, then its
        value, the tuple of the body's outputs."""
        context, keywords = CONTEXTS[node.target]
        count = len(keywords)
        given = [f"{k}={self.value(a)}" if k else self.value(a)
                 for k, a in zip(keywords, node.args[:count])]
        body, operands = self.split.body(node.args[count]), node.args[count + 1:]
        taken = set(self.split.names.values())
        lines = call_lines(8, f"with {context}", given, ":")
        placeholders = [n for n in body.nodes if n.op == "placeholder"]
        for inner, operand in zip(placeholders, operands):
            self.inline[inner] = self.value(operand)
        for inner in body.nodes:
            if inner.op == "placeholder" or inner.target in EXPORT_CHECKS:
                continue
            if inner.op == "output":
                value = f"{self.split.names[node]} = {self.value(tuple(inner.args[0]))}"
                lines += [f"            {value}"]
                continue
            self.split.names[inner] = fresh_name(inner.name, taken)
            taken.add(self.split.names[inner])
            lines += [f"    {line}" for line in self.statement(inner, attrs)]
        return lines

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
            holder, below = self.split.held(target)
            attribute = f"self.{self.attribute(holder, attrs)}"
            if not below:
                return attribute, None
            return path_expression(resolve_path(self.split.model, holder), below, attribute), None
        if node.op == "call_method":
            receiver, *rest = args
            return f"{self.operand(receiver)}.{node.target}", [*map(self.value, rest), *kwargs]
        fn = node.target
        if fn is device_of and len(args) == 1 and not kwargs:  # where the export fixed one
            return f"{self.operand(args[0])}.device", None
        if fn is device_type_of and len(args) == 1 and not kwargs:
            return f"{self.operand(args[0])}.device.type", None
        if fn in BINARY and len(args) == 2 and not kwargs:
            if not node.all_input_nodes and all(
                    isinstance(a, (bool, int, float, str, type(None))) for a in args):
                return self.value(fn(*args)), None  # folded: ``False == False`` is ``True``
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
        if qualified.startswith("torch.ops.aten."):  # as torch.export recorded it
            self.aten = True
            return qualified.removeprefix("torch.ops.")
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

    def tree(self, spec: pytree.TreeSpec, leaves: Iterator[str]) -> Tree:
        """How to build a value of pytree structure ``spec`` from the texts of its leaves, in
        order: tuple, list and dict literals, ``collections.OrderedDict``, a namedtuple's
        class, and a class built by keyword (a Hugging Face ``ModelOutput``); write it with
        :func:`tree_lines`.

        Raises:
            CodegenError: a structure of another kind (its class is named).
        """
        if spec.is_leaf():
            return next(leaves)
        items = [self.tree(child, leaves) for child in spec.children()]
        kind, context = spec.type, spec.context
        if kind is tuple:
            return ("(", items, ",)" if len(items) == 1 else ")")
        if kind is list:
            return ("[", items, "]")
        if kind in (dict, collections.OrderedDict):
            pairs: list[Tree] = [_prefixed(f"{self.value(k)}: ", v) for k, v in zip(context, items)]
            if kind is dict:
                return ("{", pairs, "}")
            self.imports.add("collections")
            return ("collections.OrderedDict({", pairs, "})")
        if kind is collections.namedtuple:
            return (f"{self.function(context)}(", items, ")")
        if isinstance(context, (list, tuple)) and len(context) == len(items) and all(
                isinstance(k, str) and k.isidentifier() for k in context):
            fields = [_prefixed(f"{k}=", v) for k, v in zip(context, items)]
            return (f"{self.function(kind)}(", fields, ")")
        raise CodegenError(
            f"the model returns a {getattr(kind, '__name__', kind)}, which generated code cannot "
            "build; run the plan with autosplit.partition(model, plan=plan) instead"
        )

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
            return self.inline.get(value) or self.split.names[value]
        if value is None or isinstance(value, (bool, int)):
            return repr(value)
        if isinstance(value, float):
            if math.isinf(value):
                return 'float("inf")' if value > 0 else '-float("inf")'
            return 'float("nan")' if math.isnan(value) else repr(value).replace("e+", "e")
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
