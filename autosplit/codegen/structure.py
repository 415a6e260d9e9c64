"""Which of the model's operations each stage of an emitted module holds (:class:`StageSplit`).

For a model torch.fx traces, the operations are those of a coarse trace with every block
module as a leaf (:mod:`autosplit.codegen.coarse_trace`): one line per block. A model captured
by torch.export, which torch.fx cannot trace even with its blocks as leaves, is written from
the exported operations themselves: one line per operation, on the model's own parameters and
buffers.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autosplit.capture.exported import BODIES
from autosplit.codegen.coarse_trace import INPUTS, coarse_trace, fold_sequentials, values_of
from autosplit.codegen.names import GLOBALS, fresh_name, resolve_path, short_names
from autosplit.codegen.value_kinds import stand_in
from autosplit.errors import CodegenError
from autosplit.graph import BlockGraph, Granularity
from autosplit.records import Plan
from autosplit.stages import StageLayout, stage_layout

CONSTANTS = "_autosplit_constants."  # where the export's tensor constants are held
CONSTANT_ELEMENTS = 64  # the largest tensor constant written into generated code
LONGEST_BELOW = 40  # the longest weight path below a held block module (characters)
# Checks torch.export leaves in its graph (dtype, device, layout): they compute nothing.
EXPORT_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}

# Locals of the pipelined forward: the model's input names must not shadow them either.
_FORWARD_LOCALS = {"micro", "mb", "b", "m", "p", "s", "tick", "v", "last", "dev", "outputs",
                   "rows", "names", "splits"}


@dataclass(slots=True)
class StageSplit:
    """The coarse graph of the model, each node assigned to its stage.

    Attributes:
        model: the model (the generated code refers to its submodules by path).
        graph: the coarse fx graph: one node per block module call or root-level operation.
        stage: stage of every node; the model's inputs have stage -1.
        names: the variable name of every value in the generated code.
        blocks: the plan's block names per stage.
        short: a short name for every module and weight the code uses, by path.
        layout: the stage boundary (:mod:`autosplit.stages`) on the model's block graph: what
            each stage reads, makes and sends; the code's values are matched to its values.
        values: for each node whose value leaves its unit, that value's name in ``layout``.
        exported: the graph is torch.export's operations (a model torch.fx cannot trace): the
            stages are written as those operations on the model's own weights, and the
            output is rebuilt from its pytree structure (``layout.output.spec``).
        again: where the code is the block graph's own nodes (not a coarse trace), the sizes
            each stage computes again from the tensors it reads (an earlier stage made them;
            only tensors cross a cut); ``None`` for a coarse trace.
        sizes: the values of the block graph that are sizes (never sent: computed again).
    """

    model: nn.Module
    graph: fx.Graph
    stage: dict[fx.Node, int]
    names: dict[fx.Node, str]
    blocks: list[tuple[str, ...]]
    short: dict[str, str]
    layout: StageLayout
    values: dict[fx.Node, str]
    exported: bool = False
    again: dict[int, list[fx.Node]] | None = None
    sizes: frozenset[str] = frozenset()

    @classmethod
    def build(
        cls,
        model: nn.Module,
        graph: BlockGraph,
        plan: Plan,
        granularity: Granularity,
        leaf_modules: tuple[type[nn.Module] | str, ...],
    ) -> StageSplit:
        """The stage split of ``model`` for ``plan``.

        Raises:
            CutValueError: a value that is surely not a tensor crosses a cut (the stage
                boundary's rule, as in every runtime).
            CodegenError: the coarse graph cannot be matched to the plan's blocks.
        """
        layout = stage_layout(graph, plan)
        _check_crossings(graph, layout)
        exported = graph.capture is not None and graph.capture.front == "export"
        fine = not graph.traced or granularity != "block" or exported
        if not fine:
            try:
                coarse, block_of, fine_of = coarse_trace(model, graph, leaf_modules)
            except CodegenError:  # blocks inside blocks (torchvision's ViT encoder): the
                fine = True  # stages are written from the block graph's own nodes instead
        if fine:  # one node per block already (fallback), leaf-level blocks, the operations
            # torch.export recorded (nothing coarser can be traced), or nested blocks
            coarse = graph.module.graph
            block_of = {
                n: graph.node_block.get(n.name, INPUTS) for n in coarse.nodes if n.op != "output"
            }
            fine_of = {n: [n] for n in block_of if n.op != "placeholder"}
        stage = {
            n: (INPUTS if b == INPUTS else layout.stage_of_block(b)) for n, b in block_of.items()
        }
        blocks = [st.blocks for st in plan.stages]
        for s, names in enumerate(blocks):
            covered = {
                graph.block_names[b] for n, b in block_of.items() if b >= 0 and stage[n] == s
            }
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
        values = values_of(graph, coarse, fine_of)
        if not fine:  # (the block graph's own nodes are the model's: never rewritten)
            fold_sequentials(model, coarse, stage, values)
        targets = [str(n.target) for n in coarse.nodes if n.op in ("call_module", "get_attr")
                   and not str(n.target).startswith(f"{BODIES}.")]
        split = cls(model, coarse, stage, {}, blocks, {}, layout, values, exported)
        split.short = short_names(model, [split.held(t)[0] for t in targets])
        if fine:
            split.again = {spec.index: graph.recomputed(spec.first, spec.end)
                           for spec in layout.stages}
            split.sizes = frozenset(name for name, kind in graph.kinds.items() if kind == "size")
        split._check_boundary()
        split.names = split._choose_names()
        return split

    def _choose_names(self) -> dict[fx.Node, str]:
        """Value names: a module call is named by its module (``layer3_1``, ``denselayer5``)."""
        taken = set(GLOBALS) | {f"Stage{s}" for s in range(len(self.blocks))}
        taken |= set(dir(builtins)) - {"input", "filter", "format", "type", "id", "hash"}
        names: dict[fx.Node, str] = {}
        for node in self.graph.nodes:
            if node.op == "output":
                continue
            avoid = taken | _FORWARD_LOCALS if node.op == "placeholder" else taken
            name = self.short[str(node.target)] if node.op == "call_module" else node.name
            names[node] = fresh_name(name, avoid)
            taken.add(names[node])
        return names

    def held(self, target: str) -> tuple[str, str]:
        """What a stage holds to read the module or weight ``target``: (its path, the path of
        ``target`` below it).

        A stage holds each module and weight its traced code names. The code of an exported
        model names weights, so its stage holds the innermost block module above a weight
        (``model.layers.0``, read as ``self.layers_0.mlp.up_proj.weight``) where that block
        contains no other block, else the weight itself. Where the weight's path below that
        block is longer than :data:`LONGEST_BELOW` characters, the stage holds the first module
        below the block from which it is not (a line of code reads it whole).
        """
        if not self.exported or target.startswith(CONSTANTS):
            return target, ""
        names = {b for blocks in self.blocks for b in blocks}
        parts = target.split(".")
        for k in range(len(parts) - 1, 0, -1):
            path = ".".join(parts[:k])
            if path in names and not any(b.startswith(path + ".") for b in names):
                try:
                    if not isinstance(resolve_path(self.model, path), nn.Module):
                        continue
                except AttributeError:
                    continue
                deeper = next(d for d in range(k, len(parts))  # the first that leaves a
                              if len(".".join(parts[d:])) <= LONGEST_BELOW  # short path, at
                              or d == len(parts) - 1)  # most the weight's owner
                return ".".join(parts[:deeper]), ".".join(parts[deeper:])
        return target, ""

    def body(self, node: fx.Node) -> fx.Graph:
        """The graph of the higher-order operation's body that ``node`` (a ``get_attr`` of
        :data:`~autosplit.capture.exported.BODIES`) reads."""
        return resolve_path(self.graph.owning_module, str(node.target)).graph

    def constant(self, target: str) -> torch.Tensor:
        """The tensor constant the export made at ``target`` (small enough to write out).

        Raises:
            CodegenError: it has more than :data:`CONSTANT_ELEMENTS` elements.
        """
        value = resolve_path(self.graph.owning_module, target)
        if value.numel() > CONSTANT_ELEMENTS:
            raise CodegenError(
                f"the export made a tensor constant of {value.numel()} elements ({target}); "
                "generated code writes only small ones: run the plan with "
                "autosplit.partition(model, plan=plan) instead"
            )
        return value

    def nodes_of(self, s: int) -> list[fx.Node]:
        """The nodes stage s runs, in order. Of the block graph's own nodes: the sizes it computes
        again first, then its own operations, less those whose values it neither reads nor
        sends (torch.export keeps some, and a size a later stage computes again), and the
        checks of :data:`EXPORT_CHECKS`."""
        own = [n for n in self.graph.nodes if n.op != "output" and self.stage[n] == s]
        if self.again is None:
            return own
        needed = set(self.outputs_of(s))
        live = []
        for node in reversed([*self.again.get(s, ()), *own]):
            if node.target in EXPORT_CHECKS:
                continue
            if node in needed or node.op != "call_function" or node.is_impure():
                live.append(node)
                needed.update(node.all_input_nodes)
        return live[::-1]

    def inputs_of(self, s: int) -> list[fx.Node]:
        """Values stage s reads from the model's inputs or earlier stages (the layout's
        ``reads``, in its order)."""
        return self._nodes_named(s, self.layout.stages[s].reads)

    def outputs_of(self, s: int) -> list[fx.Node]:
        """Values of stage s that a later stage or the model's output reads (``makes``)."""
        return self._nodes_named(s, self.layout.stages[s].makes)

    def passes_on(self, node: fx.Node, s: int) -> bool:
        """Whether stage s sends ``node`` on (a later stage or the output reads it too)."""
        return self.values.get(node) in self.layout.stages[s].sends

    def _nodes_named(self, s: int, names: Sequence[str]) -> list[fx.Node]:
        by_value = {value: node for node, value in self.values.items()}
        missing = [name for name in names if name not in by_value]
        if missing:
            raise CodegenError(
                f"stage {s} exchanges {missing}, which the coarse graph has no value for (a "
                "block module returning several values?); run the plan with "
                "autosplit.partition(model, plan=plan) instead"
            )
        return [by_value[name] for name in names]

    def _check_boundary(self) -> None:
        """The code of each stage reads and makes exactly what the stage boundary says."""
        for s in range(len(self.blocks)):
            nodes = self.nodes_of(s)
            inside = set(nodes)
            read = {a for n in nodes for a in n.all_input_nodes if a not in inside}
            made = {
                n for n in nodes if self.stage[n] == s
                and n.name not in self.sizes  # computed again where it is used
                and any(u.op == "output" or self.stage[u] > s for u in n.users)
            }
            if read != set(self.inputs_of(s)) or made != set(self.outputs_of(s)):
                raise CodegenError(
                    f"stage {s}'s code reads or makes other values than the stage boundary "
                    "says: the coarse graph cannot be matched to the plan's blocks; run the "
                    "plan with autosplit.partition(model, plan=plan) instead"
                )

    def output(self) -> Any:
        """The model's output structure: nodes inside tuples, lists and dicts."""
        return next(n for n in self.graph.nodes if n.op == "output").args[0]

    def weights(self) -> dict[int, tuple[torch.Tensor, str, set[int]]]:
        """Every parameter and buffer the stages hold: id → (tensor, a holder, stages)."""
        found: dict[int, tuple[torch.Tensor, str, set[int]]] = {}
        for node in self.graph.nodes:
            if node.op in ("call_module", "get_attr") and self.stage[node] >= 0:
                if str(node.target).startswith(f"{BODIES}."):  # written out where it runs
                    continue
                holder = self.held(str(node.target))[0]
                if holder.startswith(CONSTANTS):  # not the model's: each stage its own
                    continue
                obj = resolve_path(self.model, holder)
                if isinstance(obj, nn.Module):
                    tensors = [*obj.parameters(), *obj.buffers()]
                else:
                    tensors = [obj] if isinstance(obj, torch.Tensor) else []
                for t in tensors:
                    entry = found.setdefault(id(t), (t, holder, set()))
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


def _check_crossings(graph: BlockGraph, layout: StageLayout) -> None:
    """Refuse, as every runtime does, a value that is surely not a tensor crossing a cut.

    Raises:
        CutValueError: from :meth:`StageLayout.check_sent`, naming the value, the block that
            made it and the cut.
    """
    nodes = {n.name: n for n in graph.module.graph.nodes}
    for spec in layout.stages:
        layout.check_sent(spec.index, [stand_in(nodes[name]) for name in spec.sends])
