"""Write a plan as a readable, standalone Python module in the tutorial's style.

``emit(plan, "examples/resnet50.py:build_model")`` returns the source of a module that builds
the model with the model file's own factory (no weights are written into it), gathers the
model's own submodules into one stage per device — an ``nn.Sequential`` where the stage is a
plain chain, else a small generated ``nn.Module`` whose ``forward`` is the stage's code — moves
each stage with ``.to(device)``, and runs them as the tutorial's ``PipelineParallelResNet50``
does, generalised to p stages. A weight that several stages share (tied embeddings) stays
once, on the first such stage's device; stages on other devices read it through a
differentiable ``.to()`` (``torch.func.functional_call``), so its gradient reaches it.

Short stage code: the model is traced a second time with torch.fx, treating every block's
module (``layer3.0``, ``fc`` …) as a leaf, so a stage is one line per block plus the small
root-level operations between blocks (``torch.flatten``, ``+``). Every node of that coarse graph
is matched back to its block through the module stack torch.fx records on the fine graph, so
the stage boundaries are exactly the plan's. Children of a plain ``nn.Sequential`` that all
run in order on one stage are folded into the container (``model.layer1``); a container split
between stages is not: each stage holds only the children it runs (``model.layer3[0]``).

Finding the model file again: the generated module imports it from the absolute path it had
when the code was emitted, and, when nothing is there any more, from the path as it was given,
relative to the working directory. A ``package.module:factory`` reference is imported by name.
"""

from __future__ import annotations

import builtins
import importlib
import itertools
import json
import keyword
import math
import operator
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from autosplit import checks
from autosplit.errors import CodegenError, InvalidInputError, TraceError
from autosplit.graph import BlockGraph, Granularity, leaf_module_list, trace
from autosplit.modelfile import MODEL_NAMES, load_model_file
from autosplit.profiler import check_inputs
from autosplit.records import Plan
from autosplit.units import format_bytes, format_ms

__all__ = ["LINE_LENGTH", "CodegenError", "emit"]

LINE_LENGTH = 88
"""Longest line the generated code aims for (ruff's and black's default)."""

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_INPUTS = -1  # stage index of the model's inputs

# Names the generated code uses itself; graph values and attributes must not shadow them.
_GLOBALS = {
    "self", "model", "torch", "nn", "pytree", "functools", "importlib", "os", "sys",
    "model_module", "move", "concat", "DEVICES", "SPLIT_SIZE", "MODEL_FILE", "MODEL_PATH",
    "MODEL_MODULE", "PARAMETERS", "tied_weights",
}
# Locals of the pipelined forward: the model's input names must not shadow them either.
_FORWARD_LOCALS = {"micro", "mb", "b", "m", "p", "s", "tick", "v", "last", "dev", "outputs"}

_BINARY = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
    operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
    operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
    operator.le: "<=", operator.gt: ">", operator.ge: ">=",
}
_UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}
# Values that are not tensors (shapes, sizes, tuples): moved between devices with move().
_NON_TENSOR_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"}
_NON_TENSOR_METHODS = {
    "size", "dim", "numel", "nelement", "item", "tolist", "split", "chunk", "unbind",
    "tensor_split", "stride", "element_size", "get_device", "is_contiguous", "__len__",
}
_NON_TENSOR_FUNCTIONS = {
    torch.split, torch.chunk, torch.unbind, torch.tensor_split, builtins.len, builtins.int,
    builtins.float, builtins.tuple, builtins.list,
}


# ------------------------------------------------------------------------------------ public


def emit(
    plan: Plan,
    model_ref: str,
    *,
    devices: Sequence[str] | None = None,
    class_name: str | None = None,
    model: nn.Module | None = None,
    command: str | None = None,
    granularity: Granularity = "block",
    leaf_modules: Sequence[type[nn.Module] | str] = (),
) -> str:
    """The source of a standalone module that runs ``plan`` in the tutorial's style.

    Args:
        plan: the plan to write out.
        model_ref: how the generated code builds the model: ``"path/to/file.py:factory"``
            (``:factory`` may be left out for ``build_model``/``model``) or
            ``"package.module:factory"``; :attr:`autosplit.modelfile.ModelFile.ref` is one.
        devices: one device per stage for the generated ``DEVICES`` (default: the plan's).
        class_name: name of the generated class (default ``Pipelined<ModelClass>``).
        model: the model whose structure the code is written from, already built (default:
            built from ``model_ref``); the plan must have been made for it.
        command: the command line that made the plan, quoted in the header (default: the
            equivalent ``autosplit plan … --emit …``).
        granularity, leaf_modules: as given to :func:`autosplit.trace` when the plan's
            profile was taken.

    Returns:
        Python source (ends with a newline); write it to a ``.py`` file.

    Raises:
        ArgumentTypeError: an argument of the wrong type (``plan`` not a Plan, ``model_ref``
            not a string, ``devices="cuda:0"`` instead of a list, …); also a ``TypeError``.
        InvalidInputError: bad arguments, or a ``model_ref`` that cannot be imported or names
            no model (:class:`autosplit.modelfile.ModelFileError`).
        PlanMismatchError: the plan was made for another model than ``model_ref`` builds.
        CodegenError: a stage's code cannot be written (an unsupported construct, or the
            coarse graph cannot be matched to the plan's blocks).
    """
    checks.instance_of("plan", plan, Plan, "an autosplit Plan")
    checks.instance_of(
        "model_ref", model_ref, str, "'path/to/file.py:factory' or 'package.module:factory'"
    )
    checks.optional(checks.sequence_of, "devices", devices, checks.device_name)
    checks.optional(checks.text, "class_name", class_name)
    checks.optional(checks.instance_of, "model", model, nn.Module, "a torch.nn.Module")
    checks.optional(checks.text, "command", command)
    checks.one_of("granularity", granularity, ("block", "layer"))
    leaf_modules = leaf_module_list(leaf_modules)
    source = _ModelSource.load(model_ref)
    if model is None:
        model = source.build()
    try:
        graph = trace(model, granularity=granularity, leaf_modules=tuple(leaf_modules))
    except TraceError:
        if source.example_inputs is None:
            raise
        # torch.fx cannot trace it: the fallback to its children needs example inputs
        graph = trace(
            model,
            granularity=granularity,
            leaf_modules=tuple(leaf_modules),
            example_inputs=check_inputs(source.example_inputs(None)),
        )
    plan.check_model(graph.fingerprint, graph.model_name)
    plan.check_blocks(graph.block_names, graph.model_name)
    p = len(plan.stages)
    devs = [st.device for st in plan.stages]
    if devices is not None:
        if isinstance(devices, str) or len(devices) != p:
            raise InvalidInputError(
                f"devices={devices!r} for a plan of {p} stages: give one device per stage, "
                f"e.g. {devs!r}"
            )
        devs = [str(torch.device(d)) for d in devices]
    name = class_name if class_name is not None else f"Pipelined{graph.model_name}"
    if not name.isidentifier() or keyword.iskeyword(name) or name in _GLOBALS or (
        name.startswith("Stage") and name[5:].isdigit()
    ):
        raise InvalidInputError(
            f"class_name {name!r} is not usable as the generated class's name: give a Python "
            "identifier such as 'PipelinedNet' (not a keyword, nor StageN)"
        )
    split = _StageSplit.build(model, graph, plan, granularity, tuple(leaf_modules))
    split.check_devices(devs)
    return _Writer(plan, source, split, devs, name, command).render()


# ------------------------------------------------------------------------------ model source


@dataclass(frozen=True, slots=True)
class _ModelSource:
    """Where the generated code finds the model.

    Attributes:
        given: the file as given (``"examples/resnet50.py"``) or the module name.
        path: absolute path of the file, ``None`` for a module name.
        attr: the factory (or module-level model) in it.
        is_instance: ``attr`` is a module-level ``nn.Module`` rather than a factory.
        module_name: the name autosplit imported it under (to recognise its functions).
        build: builds the model.
        example_inputs: ``example_inputs(batch_size)`` when it defines one, else ``None``.
    """

    given: str
    path: Path | None
    attr: str
    is_instance: bool
    module_name: str
    build: Any
    example_inputs: Any

    @classmethod
    def load(cls, model_ref: str) -> _ModelSource:
        if not isinstance(model_ref, str) or not model_ref.strip():
            raise InvalidInputError(
                f"model_ref must be 'path/to/file.py:factory' or 'package.module:factory', "
                f"got {model_ref!r}"
            )
        target, sep, attr = model_ref.rpartition(":")
        if not sep or not attr.isidentifier():  # no factory given (or a Windows drive colon)
            target, attr = model_ref, ""
        loaded = load_model_file(target, attr or None)
        attr = loaded.ref.rpartition(":")[2]
        module = sys.modules.get(loaded.module_name)
        value = getattr(module, attr, None)
        return cls(
            given=target if loaded.path is not None else loaded.module_name,
            path=loaded.path,
            attr=attr,
            is_instance=isinstance(value, nn.Module),
            module_name=loaded.module_name,
            build=loaded.build,
            example_inputs=loaded.example_inputs if loaded.inputs is not None else None,
        )

    def build_call(self) -> str:
        """The expression building the model in the generated code."""
        return f"model_module().{self.attr}" + ("" if self.is_instance else "()")


# ----------------------------------------------------------------------- the stages as graphs


@dataclass(slots=True)
class _StageSplit:
    """The coarse graph of the model, each node assigned to its stage.

    Attributes:
        model: the model (the generated code refers to its submodules by path).
        graph: the coarse fx graph: one node per block module call or root-level operation.
        stage: stage of every node; the model's inputs have stage -1.
        names: the variable name of every value in the generated code.
        blocks: the plan's block names per stage.
        short: a short name for every module and weight the code uses, by path.
    """

    model: nn.Module
    graph: fx.Graph
    stage: dict[fx.Node, int]
    names: dict[fx.Node, str]
    blocks: list[tuple[str, ...]]
    short: dict[str, str]

    @classmethod
    def build(
        cls,
        model: nn.Module,
        graph: BlockGraph,
        plan: Plan,
        granularity: Granularity,
        leaf_modules: tuple[type[nn.Module] | str, ...],
    ) -> _StageSplit:
        if graph.traced and granularity == "block":
            coarse, block_of = _coarse_trace(model, graph, leaf_modules)
        else:  # one node per block already (fallback), or leaf-level blocks
            coarse = graph.module.graph
            block_of = {
                n: graph.node_block.get(n.name, _INPUTS) for n in coarse.nodes if n.op != "output"
            }
        stage_of_block = [s for s, count in enumerate(plan.balance) for _ in range(count)]
        stage = {n: (_INPUTS if b == _INPUTS else stage_of_block[b]) for n, b in block_of.items()}
        blocks = [st.blocks for st in plan.stages]
        for s, names in enumerate(blocks):
            covered = {graph.block_names[b] for n, b in block_of.items() if b >= 0 and stage[n] == s}
            if covered != set(names):
                raise CodegenError(
                    f"stage {s}'s code covers blocks {sorted(covered)}, but the plan gives it "
                    f"{list(names)}: the coarse trace of {graph.model_name} cannot be matched "
                    "to its blocks; run the plan with autosplit.partition(model, plan=plan) instead"
                )
        for node, s in stage.items():
            for arg in node.all_input_nodes:
                if stage[arg] > s:
                    raise CodegenError(
                        f"{node.name} (stage {s}) reads {arg.name} from the later stage "
                        f"{stage[arg]}: the coarse graph cannot be matched to the plan's blocks"
                    )
        _fold_sequentials(model, coarse, stage)
        targets = [str(n.target) for n in coarse.nodes if n.op in ("call_module", "get_attr")]
        split = cls(model, coarse, stage, {}, blocks, _short_names(model, targets))
        split.names = split._choose_names()
        return split

    def _choose_names(self) -> dict[fx.Node, str]:
        """Value names: a module call is named by its module (``layer3_1``, ``denselayer5``)."""
        taken = set(_GLOBALS) | {f"Stage{s}" for s in range(len(self.blocks))}
        taken |= set(dir(builtins)) - {"input", "filter", "format", "type", "id", "hash"}
        names: dict[fx.Node, str] = {}
        for node in self.graph.nodes:
            if node.op == "output":
                continue
            avoid = taken | _FORWARD_LOCALS if node.op == "placeholder" else taken
            name = self.short[str(node.target)] if node.op == "call_module" else node.name
            names[node] = _fresh(name, avoid)
            taken.add(names[node])
        return names

    def nodes_of(self, s: int) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op != "output" and self.stage[n] == s]

    def inputs_of(self, s: int) -> list[fx.Node]:
        """Values stage s reads from the model's inputs or from earlier stages, in order."""
        found: list[fx.Node] = []
        for node in self.nodes_of(s):
            for arg in node.all_input_nodes:
                if self.stage[arg] != s and arg not in found:
                    found.append(arg)
        return found

    def outputs_of(self, s: int) -> list[fx.Node]:
        """Values of stage s that a later stage or the model's output reads, in order."""
        return [
            n for n in self.nodes_of(s)
            if any(u.op == "output" or self.stage[u] > s for u in n.users)
        ]

    def last_reader(self, node: fx.Node) -> int | None:
        """The last stage reading ``node``; ``None`` when the model's output includes it."""
        if any(u.op == "output" for u in node.users):
            return None
        return max(self.stage[u] for u in node.users)

    def output(self) -> Any:
        return next(n for n in self.graph.nodes if n.op == "output").args[0]

    def weights(self) -> dict[int, tuple[torch.Tensor, str, set[int]]]:
        """Every parameter and buffer the stages hold: id → (tensor, a holder, stages)."""
        found: dict[int, tuple[torch.Tensor, str, set[int]]] = {}
        for node in self.graph.nodes:
            if node.op in ("call_module", "get_attr") and self.stage[node] >= 0:
                obj = _resolve(self.model, str(node.target))
                if isinstance(obj, nn.Module):
                    tensors = [*obj.parameters(), *obj.buffers()]
                else:
                    tensors = [obj] if isinstance(obj, torch.Tensor) else []
                for t in tensors:
                    entry = found.setdefault(id(t), (t, str(node.target), set()))
                    entry[2].add(self.stage[node])
        return found

    def tied_stages(self) -> set[int]:
        """Stages that use a parameter an earlier stage uses too (tied weights)."""
        return {
            s for t, _, stages in self.weights().values() if isinstance(t, nn.Parameter)
            for s in sorted(stages)[1:]
        }

    def check_devices(self, devices: Sequence[str]) -> None:
        """Refuse buffers shared by stages on different devices (a parameter shared so is
        read through ``.to()``; a buffer updated in place cannot be)."""
        for t, holder, stages in self.weights().values():
            places = {devices[s] for s in stages}
            if len(places) > 1 and not isinstance(t, nn.Parameter):
                raise CodegenError(
                    f"{holder} holds buffers that stages {sorted(stages)} share on different "
                    f"devices ({', '.join(sorted(places))}); shared buffers must stay on one "
                    "device: give those stages the same device, or plan them onto one stage"
                )

    def parameter_count(self) -> int:
        """Number of parameter elements the stages hold (each shared parameter once)."""
        return sum(
            t.numel() for t, _, _ in self.weights().values() if isinstance(t, nn.Parameter)
        )


def _coarse_trace(
    model: nn.Module, graph: BlockGraph, leaf_modules: tuple[type[nn.Module] | str, ...]
) -> tuple[fx.Graph, dict[fx.Node, int]]:
    """Trace ``model`` with every block module as a leaf; map each node to its block."""
    leaf_types = tuple(x for x in leaf_modules if isinstance(x, type))
    leaf_names = {x for x in leaf_modules if isinstance(x, str)}
    leaves: set[str] = set()

    class _BlockTracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            leaf = (
                qualname in leaf_names
                or bool(leaf_types and isinstance(m, leaf_types))
                or _is_block_module(model, m, qualname)
                or super().is_leaf_module(m, qualname)
            )
            if leaf:
                leaves.add(qualname)
            return leaf

    try:
        coarse = _BlockTracer().trace(model)
    except Exception as exc:  # fx raises many kinds of errors from user code
        raise CodegenError(
            f"tracing {graph.model_name} with its blocks as leaves failed "
            f"({type(exc).__name__}: {exc}); run the plan with autosplit.partition(model, "
            "plan=plan) instead"
        ) from exc

    # The fine graph as units: consecutive nodes inside one call of a block module, or one
    # root-level operation. The coarse graph has one node per unit, in the same order.
    units: list[tuple[str | None, list[fx.Node]]] = []
    for node in graph.module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        key = next((k for k, (path, _) in stack.items() if path in leaves), None)
        if key is not None and units and units[-1][0] == key:
            units[-1][1].append(node)
        else:
            units.append((key, [node]))
    remaining = {key for key, _ in units if key is not None}

    block_of: dict[fx.Node, int] = {}
    calls: dict[str, int] = {}
    j, previous = 0, 0
    for node in coarse.nodes:
        if node.op == "placeholder":
            block_of[node] = _INPUTS
            continue
        if node.op == "output":
            continue
        if node.op == "call_module":
            target = str(node.target)
            n = calls.get(target, 0)
            calls[target] = n + 1
            key = target if n == 0 else f"{target}@{n}"
            if j < len(units) and units[j][0] == key:
                fine = units[j][1]
            elif key not in remaining:  # a module whose forward makes no operation
                block_of[node] = previous
                continue
            else:
                raise _unmatched(node, units[j][1] if j < len(units) else None)
        else:
            fine = units[j][1] if j < len(units) else []
            if not (
                fine
                and units[j][0] is None
                and len(fine) == 1
                and (fine[0].op, fine[0].target) == (node.op, node.target)
            ):
                raise _unmatched(node, fine or None)
        j += 1
        found = {graph.node_block[f.name] for f in fine}
        if len(found) != 1:
            names = sorted(graph.block_names[b] for b in found)
            raise CodegenError(
                f"{node.name} spans the blocks {names}; run the plan with "
                "autosplit.partition(model, plan=plan) instead"
            )
        block_of[node] = previous = found.pop()
    if j != len(units):
        raise _unmatched(None, units[j][1])
    return coarse, block_of


def _unmatched(node: fx.Node | None, fine: list[fx.Node] | None) -> CodegenError:
    here = f"{node.op} {node.target}" if node is not None else "the end of the coarse graph"
    there = f"{fine[0].op} {fine[0].target}" if fine else "the end of the model's graph"
    return CodegenError(
        f"the coarse trace does not follow the model's graph ({here} where the blocks have "
        f"{there}); run the plan with autosplit.partition(model, plan=plan) instead"
    )


def _is_block_module(model: nn.Module, m: nn.Module, qualname: str) -> bool:
    """A block module: not a container itself, and only containers above it."""
    if not qualname or isinstance(m, _CONTAINERS):
        return False
    parts = qualname.split(".")
    return all(
        isinstance(model.get_submodule(".".join(parts[:i])), _CONTAINERS)
        for i in range(1, len(parts))
    )


def _fold_sequentials(model: nn.Module, graph: fx.Graph, stage: dict[fx.Node, int]) -> None:
    """Replace the calls of all of a plain nn.Sequential's children, in order, by one call.

    Only when every child is called once, one after the other on the previous child's output
    alone, on one stage, and the intermediate values are used by nothing else. Inner
    containers fold first, so ``features.0.0 … features.3.1`` can become ``features``.
    """
    while True:
        calls: dict[str, list[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                calls.setdefault(str(node.target), []).append(node)
        parents = {t.rpartition(".")[0] for t in calls if "." in t}
        for parent in sorted(parents, key=lambda t: (-t.count("."), t)):
            seq = model.get_submodule(parent)
            if type(seq).forward is not nn.Sequential.forward or not isinstance(seq, nn.Sequential):
                continue
            runs = [calls.get(f"{parent}.{k}", []) for k in seq._modules]
            if not runs or any(len(r) != 1 for r in runs):
                continue
            chain = [r[0] for r in runs]
            if not _is_chain(chain, stage):
                continue
            with graph.inserting_before(chain[0]):
                folded = graph.call_module(parent, chain[0].args)
            stage[folded] = stage[chain[0]]
            chain[-1].replace_all_uses_with(folded)
            for node in reversed(chain):
                graph.erase_node(node)
                del stage[node]
            break
        else:
            return


def _is_chain(nodes: list[fx.Node], stage: dict[fx.Node, int]) -> bool:
    """Each node calls a module on the previous node's output alone, nothing in between."""
    first = nodes[0]
    if len(first.args) != 1 or first.kwargs:
        return False
    for prev, node in itertools.pairwise(nodes):
        if prev.next is not node or node.args != (prev,) or node.kwargs:
            return False
        if set(prev.users) != {node} or stage[prev] != stage[node]:
            return False
    return True


def _short_names(model: nn.Module, paths: Sequence[str]) -> dict[str, str]:
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
            kind = re.sub(r"(?<!^)(?=[A-Z])", "_", type(_resolve(model, path)).__name__).lower()
            name = f"{kind}_" + "".join(c if c.isalnum() else "_" for c in name)
        if hasattr(nn.Module, name) or name in _GLOBALS:
            name += "_"
        short[path] = name
    return short


def _resolve(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _fresh(name: str, taken: set[str]) -> str:
    if name not in taken and not keyword.iskeyword(name):
        return name
    k = 1
    while f"{name}_{k}" in taken:
        k += 1
    return f"{name}_{k}"


# -------------------------------------------------------------------------------- the writer


def _q(text: str) -> str:
    """A double-quoted Python string literal (the quotes ruff format keeps)."""
    return json.dumps(text, ensure_ascii=False)


def _doc(text: str) -> str:
    """Text that is safe inside a triple-quoted docstring."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _call_lines(indent: int, head: str, args: Sequence[str], tail: str = "") -> list[str]:
    """``head(args)tail`` on one line, or one argument per line with a trailing comma."""
    pad = " " * indent
    one = f"{pad}{head}({', '.join(args)}){tail}"
    if len(one) <= LINE_LENGTH or not args:
        return [one]
    lines = [f"{pad}{head}("]
    for arg in args:
        inner = arg[1:-1]
        flat = not any(c in inner for c in "()[]{}\"'")
        if len(arg) + indent + 5 > LINE_LENGTH and arg[:1] + arg[-1:] in ("[]", "()") and flat:
            items = [i.strip() for i in inner.split(",") if i.strip()]  # a long list of names
            lines += [f"{pad}    {arg[0]}", *(f"{pad}        {i}," for i in items)]
            lines.append(f"{pad}    {arg[-1]},")
        else:
            lines.append(f"{pad}    {arg},")
    return [*lines, f"{pad}){tail}"]


def _join(*lines: str) -> str:
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _span(blocks: Sequence[str]) -> str:
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]} … {blocks[-1]}"


class _Writer:
    """Renders the generated module from a plan and its stage split."""

    def __init__(
        self,
        plan: Plan,
        source: _ModelSource,
        split: _StageSplit,
        devices: list[str],
        class_name: str,
        command: str | None,
    ) -> None:
        self.plan = plan
        self.source = source
        self.split = split
        self.devices = devices
        self.class_name = class_name
        self.command = command
        self.imports: set[str] = set()  # extra modules the stage code calls into
        self.needs_move = False
        self.needs_concat = False
        self.model_name = type(split.model).__name__

    # ---------------------------------------------------------------------------- pieces

    def render(self) -> str:
        p = len(self.plan.stages)
        stages = [self._stage(s) for s in range(p)]  # fills imports and helper flags
        pipelined = self._pipelined_class(stages)
        main = self._main()
        parts = [
            self._header(),
            self._imports(),
            self._constants(),
            self._loader(),
            *self._helpers(),
            *(code for _, code in stages if code),
            pipelined,
            main,
        ]
        head, imports, *rest = [part.rstrip("\n") for part in parts if part]
        return f"{head}\n\n{imports}\n\n" + "\n\n\n".join(rest) + "\n"

    def _header(self) -> str:
        plan = self.plan
        p = len(plan.stages)
        b, m = plan.split_size, plan.microbatches
        cuts = ", ".join(plan.split_points) or "none (one stage)"
        ref = self.source.given + (f":{self.source.attr}")
        lines = [
            f'"""{self.model_name} split into {p} pipeline stages, written by autosplit.',
            "",
            f"Edit freely. The layers are built by {ref}:",
            "this file holds no weights.",
            "",
            f"Plan for {plan.model} (fingerprint {plan.fingerprint}):",
            f"  cut points    {cuts} · balance {' + '.join(map(str, plan.balance))} blocks",
            (
                f"  split_size    {b}: batch {plan.batch_size} → {m} micro-batches · "
                f"schedule {plan.schedule}"
            ),
            (
                f"  step          predicted {format_ms(plan.predicted_step_ms)} · one device "
                f"{format_ms(plan.single_device_ms)} (×{plan.speedup:.2f})"
            ),
        ]
        for st in plan.stages:
            lines.append(
                f"  stage {st.index}  {st.device:<6} {_span(st.blocks)}: "
                f"{format_ms(st.compute_ms)} per micro-batch, {format_bytes(st.memory_bytes)}"
            )
        lines.append(f"  profile       {plan.profile} · solver {plan.solver}")
        if plan.schedule != "gpipe":
            lines.append(
                f"  note          forward runs in fill-drain order; {plan.schedule} shaped the "
                "memory estimate"
            )
        from autosplit import __version__

        lines += ["", f"Made with autosplit {__version__}: {self._command()}", '"""']
        return "\n".join(_doc(line) if 0 < i < len(lines) - 1 else line for i, line in enumerate(lines))

    def _command(self) -> str:
        if self.command:
            return self.command
        src = self.source
        words = ["autosplit plan", src.given]
        if src.attr not in MODEL_NAMES or src.path is None:
            words.append(f"--entry {src.given}:{src.attr}")
        words.append(f"--gpus {len(self.plan.stages)} --split-size {self.plan.split_size}")
        if self.plan.schedule != "gpipe":
            words.append(f"--schedule {self.plan.schedule}")
        stem = Path(src.given).stem if src.path else src.given.rpartition(".")[2]
        words.append(f"--emit pipelined_{stem}.py")
        return " ".join(words)

    def _imports(self) -> str:
        std = {"importlib"} | ({"functools", "importlib.util", "os", "sys"} if self.source.path else set())
        std |= {m for m in self.imports if m.split(".")[0] in sys.stdlib_module_names}
        other = {m for m in self.imports if m.split(".")[0] not in sys.stdlib_module_names}
        if self.source.path:
            std.discard("importlib")
        lines = [f"import {m}" for m in sorted(std)] + [""]
        lines += [f"import {m}" for m in sorted(other | {"torch"})]
        lines.append("from torch import nn")
        if self.needs_move or self.needs_concat:
            lines.append("from torch.utils import _pytree as pytree")
        return "\n".join(lines)

    def _constants(self) -> str:
        lines = []
        src = self.source
        if src.path is not None:
            lines.append("# The model file where it was when this was written, else as it was given")
            lines.append(f"MODEL_PATH = {_q(str(src.path))}")
            lines.append(f"MODEL_FILE = {_q(src.given)}  # from the working directory")
        else:
            lines.append(f"MODEL_MODULE = {_q(src.given)}")
        devices = ", ".join(_q(d) for d in self.devices)
        lines.append(f"DEVICES = ({devices}{',' if len(self.devices) == 1 else ''})")
        lines.append(f"SPLIT_SIZE = {self.plan.split_size}  # micro-batch size")
        count = self.split.parameter_count()
        lines.append(f"PARAMETERS = {count:_}  # held by the stages: a check of the model")
        return "\n".join(lines)

    def _loader(self) -> str:
        src = self.source
        if src.path is None:
            return _join(
                "def model_module():",
                '    """The module that builds the model."""',
                "    return importlib.import_module(MODEL_MODULE)",
            )
        return _join(
            "@functools.cache",
            "def model_module():",
            '    """Import the model file: from MODEL_PATH, or else MODEL_FILE."""',
            "    path = MODEL_PATH if os.path.isfile(MODEL_PATH) else os.path.abspath(MODEL_FILE)",
            "    if not os.path.isfile(path):",
            '        raise FileNotFoundError(f"model file not found: {MODEL_PATH} nor {path}")',
            *_call_lines(
                4,
                "spec = importlib.util.spec_from_file_location",
                [_q("autosplit_model_" + src.path.stem), "path"],
            ),
            "    module = importlib.util.module_from_spec(spec)",
            "    sys.modules[spec.name] = module",
            "    sys.path.insert(0, os.path.dirname(path))  # so that it imports its neighbours",
            "    spec.loader.exec_module(module)",
            "    return module",
        )

    def _helpers(self) -> list[str]:
        out = []
        if self.split.tied_stages():
            out.append(_join(
                "def tied_weights(stages, devices):",
                '    """Weights several stages share (tied): each stays on the device of the first',
                "    stage using it; returns, per later stage on another device, its names there.",
                '    """',
                "    home, borrowed = {}, {}",
                "    for s, stage in enumerate(stages):",
                "        for name, p in stage.named_parameters(remove_duplicate=False):",
                "            first = home.setdefault(id(p), s)",
                "            if devices[first] != devices[s]:",
                "                borrowed.setdefault(s, {})[name] = p",
                "                with torch.no_grad():",
                "                    p.data = p.data.to(devices[first])",
                "    return borrowed",
            ))
        if self.needs_move:
            out.append(_join(
                "def move(value, device):",
                '    """Move the tensors in value (a tensor, a tuple of them, a shape …) to device."""',
                "    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)",
            ))
        if self.needs_concat:
            out.append(_join(
                "def concat(outputs):",
                '    """Join the micro-batches\' outputs (tensors, tuples, dicts) along dim 0."""',
                "    flat = [pytree.tree_flatten(out) for out in outputs]",
                "    leaves = [",
                "        torch.cat(ls) if isinstance(ls[0], torch.Tensor) else ls[0]",
                "        for ls in zip(*(leaves for leaves, _ in flat))",
                "    ]",
                "    return pytree.tree_unflatten(leaves, flat[0][1])",
            ))
        return out

    # ---------------------------------------------------------------------------- stages

    def _stage(self, s: int) -> tuple[list[str] | str, str]:
        """How ``__init__`` builds stage s, and the code of its class ('' for none).

        A plain chain is built from the list of its modules' expressions (``model.fc``);
        any other stage by the expression ``StageN(model)`` of its generated class.
        """
        split = self.split
        nodes = split.nodes_of(s)
        inputs, outputs = split.inputs_of(s), split.outputs_of(s)
        chain = (
            len(inputs) == 1
            and outputs == nodes[-1:]
            and all(n.op == "call_module" for n in nodes)
            and nodes[0].args == (inputs[0],)
            and not nodes[0].kwargs
            and _is_chain(nodes, split.stage)
        )
        if chain:
            return [self._path_expr(str(n.target)) for n in nodes], ""
        attrs: dict[str, str] = {}  # model path -> attribute of the stage module
        body: list[str] = []  # forward's statements, indented
        for node in nodes:
            body += self._statement(node, attrs)
        returned = [self.split.names[n] for n in outputs]
        if returned:
            line = "        return " + ", ".join(returned)
            body += [line] if len(line) <= LINE_LENGTH else _call_lines(8, "return ", returned)
        blocks = split.blocks[s]
        params = ["self", *(self.split.names[n] for n in inputs)]
        summary = f"Stage {s}: {_doc(_span(blocks))} ({_count(len(blocks), 'block')})"
        lines = [
            f"class Stage{s}(nn.Module):",
            f'    """{summary}, the model\'s own modules."""',
            "",
            "    def __init__(self, model):",
            "        super().__init__()",
            *("        " + self._attr_line(path, attr) for path, attr in attrs.items()),
            "",
            *_call_lines(4, "def forward", params, ":"),
            *body,
        ]
        return f"Stage{s}(model)", "\n".join(lines)

    def _attr_line(self, path: str, attr: str) -> str:
        owner_path, _, leaf = path.rpartition(".")
        owner = self.split.model.get_submodule(owner_path)
        expr = self._path_expr(path)
        if leaf in owner._buffers:
            return f"self.register_buffer({_q(attr)}, {expr})"
        return f"self.{attr} = {expr}"

    def _path_expr(self, path: str) -> str:
        """``model.layer3[0]``-style expression for a submodule, parameter or buffer."""
        expr, obj = "model", self.split.model
        for part in path.split("."):
            children = getattr(obj, "_modules", {})
            if isinstance(obj, (nn.Sequential, nn.ModuleList)) and part.isdigit() and (
                isinstance(obj, nn.ModuleList) or list(children).index(part) == int(part)
            ):
                expr += f"[{part}]"
            elif part.isidentifier() and not keyword.iskeyword(part):
                expr += f".{part}"
            elif isinstance(obj, nn.ModuleDict):
                expr += f"[{_q(part)}]"
            else:
                owner, _, leaf = path.rpartition(".")
                if isinstance(_resolve(self.split.model, path), nn.Module):
                    return f"model.get_submodule({_q(path)})"
                return f"getattr(model.get_submodule({_q(owner)}), {_q(leaf)})"
            obj = getattr(obj, part)
        return expr

    def _attr(self, target: str, attrs: dict[str, str]) -> str:
        if target not in attrs:
            attrs[target] = _fresh(self.split.short[target], set(attrs.values()))
        return attrs[target]

    def _statement(self, node: fx.Node, attrs: dict[str, str]) -> list[str]:
        head, args = self._expression(node, attrs)
        target = "" if not node.users else f"{self.split.names[node]} = "
        if args is None:
            return [f"        {target}{head}"]
        return _call_lines(8, target + head, args)

    def _expression(self, node: fx.Node, attrs: dict[str, str]) -> tuple[str, list[str] | None]:
        """(head, arguments) of a call, or (expression, None)."""
        args = list(node.args)
        kwargs = [f"{k}={self._arg(v)}" for k, v in node.kwargs.items()]
        if node.op == "call_module":
            if str(node.target).startswith("_tensor_constant"):
                raise CodegenError(f"{node.target} is a tensor made during tracing, not a module")
            return f"self.{self._attr(str(node.target), attrs)}", [*map(self._arg, args), *kwargs]
        if node.op == "get_attr":
            target = str(node.target)
            if target.rpartition(".")[2].startswith("_tensor_constant"):
                raise CodegenError(
                    f"{node.name} reads a tensor constant that tracing created ({target}); "
                    "make it a buffer of the model (register_buffer) to emit code for it"
                )
            return f"self.{self._attr(target, attrs)}", None
        if node.op == "call_method":
            receiver, *rest = args
            return f"{self._atom(receiver)}.{node.target}", [*map(self._arg, rest), *kwargs]
        fn = node.target
        if fn in _BINARY and len(args) == 2 and not kwargs:
            return f"{self._atom(args[0])} {_BINARY[fn]} {self._atom(args[1])}", None
        if fn in _UNARY and len(args) == 1 and not kwargs:
            return f"{_UNARY[fn]}{self._atom(args[0])}", None
        if fn is operator.getitem and len(args) == 2 and not kwargs:
            return f"{self._atom(args[0])}[{self._index(args[1])}]", None
        if (
            fn is builtins.getattr
            and len(args) == 2
            and isinstance(args[1], str)
            and args[1].isidentifier()
            and not kwargs
        ):
            return f"{self._atom(args[0])}.{args[1]}", None
        return self._function(fn), [*map(self._arg, args), *kwargs]

    def _function(self, fn: Any) -> str:
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
        if module == self.source.module_name:
            return f"model_module().{attr}"
        try:
            found = _resolve(importlib.import_module(module), attr)  # type: ignore[arg-type]
        except (ImportError, AttributeError):
            found = None
        if found is not fn:
            raise CodegenError(
                f"the model calls {qualified}, which generated code cannot import; make it "
                "part of a block module's forward (a submodule) instead of the top level"
            )
        self.imports.add(module)
        return qualified

    def _atom(self, value: Any) -> str:
        text = self._arg(value)
        if isinstance(value, fx.Node) or text[0] in "([{\"'" or text.replace("_", "").isalnum():
            return text
        return f"({text})"

    def _index(self, index: Any) -> str:
        if isinstance(index, tuple) and not isinstance(index, torch.Size):
            parts = [self._slice(i) for i in index]
            return ", ".join(parts) + ("," if len(parts) == 1 else "") if parts else "()"
        return self._slice(index)

    def _slice(self, value: Any) -> str:
        if isinstance(value, slice):
            lo, hi, step = (
                "" if v is None else self._arg(v) for v in (value.start, value.stop, value.step)
            )
            return f"{lo}:{hi}" + (f":{step}" if step else "")
        return self._arg(value)

    def _arg(self, value: Any) -> str:
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
            return _q(value)
        if value is Ellipsis:
            return "..."
        if isinstance(value, torch.Size):
            return f"torch.Size([{', '.join(map(self._arg, value))}])"
        if isinstance(value, tuple):
            items = [self._arg(v) for v in value]
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if isinstance(value, list):
            return "[" + ", ".join(self._arg(v) for v in value) + "]"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{self._arg(k)}: {self._arg(v)}" for k, v in value.items()) + "}"
        if isinstance(value, slice):
            return f"slice({self._arg(value.start)}, {self._arg(value.stop)}, {self._arg(value.step)})"
        if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            return str(value)
        if isinstance(value, torch.device):
            return f"torch.device({_q(str(value))})"
        raise CodegenError(
            f"cannot write the constant {value!r} (a {type(value).__name__}) into generated "
            "code: tensors and other objects are not written out; make it a parameter or "
            "buffer of a submodule"
        )

    # -------------------------------------------------------------------- pipelined class

    def _is_tensor(self, node: fx.Node) -> bool:
        """Whether ``node`` surely holds one tensor (else it is moved with move())."""
        if node.op in ("placeholder", "get_attr"):
            return True
        if node.op == "call_module":
            return not any(u.target is operator.getitem for u in node.users)
        if node.op == "call_method":
            return node.target not in _NON_TENSOR_METHODS
        fn = node.target
        if fn is builtins.getattr:
            return node.args[1] not in _NON_TENSOR_ATTRS and isinstance(node.args[0], fx.Node)
        if fn is operator.getitem:
            src = node.args[0]
            return isinstance(src, fx.Node) and self._is_tensor(src)
        if fn in _NON_TENSOR_FUNCTIONS:
            return False
        if getattr(fn, "__module__", None) in ("torch", "torch.functional", "torch.nn.functional"):
            return True
        return any(self._is_tensor(a) for a in node.all_input_nodes)

    def _moved(self, node: fx.Node, device: str, pop: bool) -> str:
        read = f"v.pop({_q(self.split.names[node])})" if pop else f"v[{_q(self.split.names[node])}]"
        if self._is_tensor(node):
            return f"{read}.to({device})"
        self.needs_move = True
        return f"move({read}, {device})"

    def _pipelined_class(self, stages: list[tuple[list[str] | str, str]]) -> str:
        split = self.split
        p = len(stages)
        name = self.class_name
        inputs = [n for n in split.graph.nodes if n.op == "placeholder"]
        params = [split.names[n] for n in inputs]
        need = _count(p, "device")
        lines = [
            f"class {name}(nn.Module):",
            f'    """{self.model_name} pipelined over {need} in micro-batches (the plan above).',
            "",
            "    The stages hold the model's own modules, moved to their devices (no copies): load",
            "    weights into the model first; an optimizer on parameters() trains the model.",
            '    """',
            "",
            "    def __init__(self, model=None, devices=DEVICES, split_size=SPLIT_SIZE):",
            "        super().__init__()",
            f"        model = {self.source.build_call()} if model is None else model",
            f"        if len(devices) != {p}:",
            f'            raise ValueError(f"give {need}, one per stage: got {{devices}}")',
            "        self.devices = [torch.device(d) for d in devices]",
            "        self.split_size = split_size",
        ]
        check = [
            "        held = sum(q.numel() for q in self.parameters())",
            "        if held != PARAMETERS:",
            "            raise ValueError(",
            '                f"the stages hold {held:_} parameters, the planned model {PARAMETERS:_}"',
            "            )",
        ]
        for s, (build, _) in enumerate(stages):
            tail = f".to(self.devices[{s}])"
            if isinstance(build, list) and len(build) > 1:  # a chain of the model's modules
                lines += _call_lines(8, f"self.stage{s} = nn.Sequential", build, tail)
            else:
                module = build[0] if isinstance(build, list) else build
                lines.append(f"        self.stage{s} = {module}{tail}")
        tied = sorted(split.tied_stages())
        if tied:
            stage_list = ", ".join(f"self.stage{s}" for s in range(p))
            lines += [
                "        # tied weights live once; stages elsewhere read them through .to()",
                f"        self.borrowed = tied_weights([{stage_list}], self.devices)",
            ]
        lines += check + [""]
        lines += _call_lines(4, "def forward", ["self", *params], ":")
        lines += [
            '        """Pipelined forward: stage s runs micro-batch i at tick i + s, later first.',
            "",
            "        As in the tutorial: while stage s + 1 works on micro-batch i, stage s starts",
            "        on micro-batch i + 1 (CUDA's asynchronous launches let them overlap).",
            '        """',
        ]
        if len(params) == 1:
            x = params[0]
            lines.append(f"        micro = [{{{_q(x)}: mb}} for mb in {x}.split(self.split_size)]")
        else:
            names = "(" + ", ".join(_q(x) for x in params) + ")"
            splits = ", ".join(f"{x}.split(b)" for x in params)
            lines.append("        b = self.split_size")
            lines += _call_lines(8, "micro = [dict(zip", [names, "mb"], f") for mb in zip({splits})]")
        lines += [
            f"        m, p = len(micro), {p}",
            "        for tick in range(m + p - 1):",
            "            for s in reversed(range(p)):",
            "                if 0 <= tick - s < m:",
            "                    self.run_stage(s, micro[tick - s])",
        ]
        lines += self._return_lines()
        lines += [
            "",
            "    def run_stage(self, s, v):",
            '        """Run stage s on the values v of one micro-batch, on its device."""',
            "        dev = self.devices[s]",
        ]
        for s in range(p):
            keyword_ = "if" if s == 0 else ("elif" if s < p - 1 else "else")
            lines.append(f"        {keyword_} s == {s}:" if keyword_ != "else" else "        else:")
            args = [
                self._moved(n, "dev", pop=split.last_reader(n) == s) for n in split.inputs_of(s)
            ]
            outs = [f"v[{_q(split.names[n])}]" for n in split.outputs_of(s)]
            lhs = ", ".join(outs) + " = " if outs else ""
            call = f"self.stage{s}"
            if s in tied:
                call, args = "self.call", [str(s), *args]
            if len(f"            {lhs}{call}(") <= LINE_LENGTH:
                lines += _call_lines(12, f"{lhs}{call}", args)
            else:  # many values: the targets one per line, as ruff format writes them
                lines += ["            (", *(f"                {o}," for o in outs)]
                lines += _call_lines(12, f") = {call}", args)
        if tied:
            lines += self._tied_call()
        return "\n".join(lines)

    def _tied_call(self) -> list[str]:
        return [
            "",
            "    def call(self, s, *args):",
            '        """Stage s on args, reading tied weights that live on another device',
            "        through a differentiable .to(): their gradient reaches the one parameter.",
            '        """',
            '        stage = getattr(self, f"stage{s}")',
            "        if s not in self.borrowed:",
            "            return stage(*args)",
            "        dev = self.devices[s]",
            "        moved = {n: w.to(dev) for n, w in self.borrowed[s].items()}",
            "        return torch.func.functional_call(stage, moved, args)",
        ]

    def _return_lines(self) -> list[str]:
        split = self.split
        p = len(self.plan.stages)
        structure = self.split.output()
        moved = False

        def fmt(value: Any) -> str:
            nonlocal moved
            if isinstance(value, fx.Node):
                read = f"v[{_q(split.names[value])}]"
                if split.stage[value] != p - 1 and self._is_tensor(value):
                    moved = True
                    return f"{read}.to(last)"
                return read
            if isinstance(value, (tuple, list)):
                items = [fmt(v) for v in value]
                close = "," if len(items) == 1 and isinstance(value, tuple) else ""
                return ("(" if isinstance(value, tuple) else "[") + ", ".join(items) + close + (
                    ")" if isinstance(value, tuple) else "]"
                )
            if isinstance(value, dict):
                return "{" + ", ".join(f"{self._arg(k)}: {fmt(v)}" for k, v in value.items()) + "}"
            return self._arg(value)

        per_mb = fmt(structure)
        single = isinstance(structure, fx.Node) and self._is_tensor(structure)
        lines = ["        last = self.devices[-1]"] if moved else []
        join = "torch.cat" if single else "concat"
        self.needs_concat |= not single
        line = f"        return {join}([{per_mb} for v in micro])"
        if len(line) <= LINE_LENGTH:
            return [*lines, line]
        collect = f"        outputs = [{per_mb} for v in micro]"
        if len(collect) > LINE_LENGTH:
            collect = f"        outputs = [\n            {per_mb}\n            for v in micro\n        ]"
        return [*lines, collect, f"        return {join}(outputs)"]

    def _main(self) -> str:
        if self.source.example_inputs is None:
            return ""
        structure = self.split.output()
        single = isinstance(structure, fx.Node) and self._is_tensor(structure)
        shape = (
            ["    shape = tuple(output.shape)"]
            if single
            else ["    shape = [tuple(t.shape) for t in pytree.tree_leaves(output)]"]
        )
        return _join(
            'if __name__ == "__main__":',
            "    # One batch of the model file's example inputs (CPU stand-ins without GPUs).",
            "    enough = torch.cuda.device_count() >= len(DEVICES)",
            f'    pipelined = {self.class_name}(devices=DEVICES if enough else ["cpu"] * len(DEVICES))',
            "    inputs = model_module().example_inputs()",
            "    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs",
            "    output = pipelined(*(x.to(pipelined.devices[0]) for x in inputs))",
            *shape,
            '    print(f"{type(pipelined).__name__} output: {shape}")',
        )
