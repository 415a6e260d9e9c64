"""The pipelined class: builds the stages on their devices and runs them in the tutorial's way.

``forward`` splits the batch into micro-batches and runs stage s on micro-batch i at tick
i + s, later stages first, as the tutorial's ``PipelineParallelResNet50`` does, generalised to
p stages; ``run_stage`` moves what a stage reads to its device, and the outputs of all
micro-batches are joined on the last device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx

from autosplit.codegen.expressions import ExpressionWriter, tree_lines, tree_text
from autosplit.codegen.model_source import ModelSource
from autosplit.codegen.stage_classes import StageCode
from autosplit.codegen.structure import StageSplit
from autosplit.codegen.text import LINE_LENGTH, call_lines, counted, joined, quoted
from autosplit.codegen.value_kinds import is_tensor


def crosses_non_tensor(split: StageSplit) -> bool:
    """Whether a stage reads a value that is not surely a tensor (moved with ``move()``)."""
    return any(
        not is_tensor(n) for s in range(len(split.blocks)) for n in split.inputs_of(s)
    )


def single_tensor_output(split: StageSplit) -> bool:
    """Whether the model returns one tensor (else the outputs are joined with ``concat()``)."""
    structure = split.output()
    return isinstance(structure, fx.Node) and is_tensor(structure)


class PipelinedClassWriter:
    """Writes the pipelined class and the ``__main__`` block of the generated module."""

    def __init__(
        self,
        split: StageSplit,
        source: ModelSource,
        class_name: str,
        values: ExpressionWriter,
    ) -> None:
        self.split = split
        self.source = source
        self.class_name = class_name
        self.values = values
        self.model_name = type(split.model).__name__
        self._output_method: list[str] = []  # ``output(self, v)`` where the output needs one

    def source_text(
        self, stages: Sequence[StageCode], checkpointed: Sequence[bool] = ()
    ) -> str:
        """The source of the pipelined class that builds and runs ``stages``; those marked in
        ``checkpointed`` run under activation checkpointing (the ``checkpointed`` helper)."""
        tied = sorted(self.split.tied_stages())
        lines = self._init_lines(stages, tied)
        lines += self._forward_lines(len(stages)) + self._output_method
        lines += self._run_stage_lines(len(stages), tied, {
            s for s, on in enumerate(checkpointed) if on})
        if tied:
            lines += _tied_call_lines()
        return "\n".join(lines)

    def _init_lines(self, stages: Sequence[StageCode], tied: list[int]) -> list[str]:
        p = len(stages)
        need = counted(p, "device")
        lines = [
            f"class {self.class_name}(nn.Module):",
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
        for s, stage in enumerate(stages):
            tail = f".to(self.devices[{s}])"
            if len(stage.modules) > 1:  # a chain of the model's modules
                lines += call_lines(8, f"self.stage{s} = nn.Sequential", stage.modules, tail)
            else:
                module = stage.modules[0] if stage.modules else f"{stage.class_name}(model)"
                lines.append(f"        self.stage{s} = {module}{tail}")
        if tied:
            stage_list = ", ".join(f"self.stage{s}" for s in range(p))
            lines += [
                "        # tied weights live once; stages elsewhere read them through .to()",
                *call_lines(8, "self.borrowed = tied_weights", [f"[{stage_list}]", "self.devices"]),
            ]
        return [
            *lines,
            "        held = sum(q.numel() for q in self.parameters())",
            "        if held != PARAMETERS:",
            "            raise ValueError(",
            "                f\"the stages hold {held:_} parameters, "
            'the planned model {PARAMETERS:_}"',
            "            )",
            "",
        ]

    def _forward_lines(self, p: int) -> list[str]:
        params = [self.split.names[n] for n in self.split.graph.nodes if n.op == "placeholder"]
        lines = call_lines(4, "def forward", ["self", *params], ":")
        lines += [
            '        """Pipelined forward: stage s runs micro-batch i at tick i + s, later first.',
            "",
            "        As in the tutorial: while stage s + 1 works on micro-batch i, stage s starts",
            "        on micro-batch i + 1 (CUDA's asynchronous launches let them overlap).",
            '        """',
        ]
        if len(params) == 1:
            x = params[0]
            lines.append(
                f"        micro = [{{{quoted(x)}: mb}} for mb in {x}.split(self.split_size)]"
            )
        else:
            lines.append("        b = self.split_size")
            lines += call_lines(8, "names = ", [quoted(x) for x in params])
            lines += call_lines(8, "splits = zip", [f"{x}.split(b)" for x in params])
            lines.append("        micro = [dict(zip(names, mb)) for mb in splits]")
        if not single_tensor_output(self.split):  # a loss is weighted by its rows
            lines.append(f"        rows = [len(v[{quoted(params[0])}]) for v in micro]")
        lines += [
            f"        m, p = len(micro), {p}",
            "        for tick in range(m + p - 1):",
            "            for s in reversed(range(p)):",
            "                if 0 <= tick - s < m:",
            "                    self.run_stage(s, micro[tick - s])",
        ]
        return lines + self._return_lines(p)

    def _run_stage_lines(self, p: int, tied: list[int], checkpointed: set[int]) -> list[str]:
        split = self.split
        lines = [
            "",
            "    def run_stage(self, s, v):",
            '        """Run stage s on the values v of one micro-batch, on its device."""',
            "        dev = self.devices[s]",
        ]
        for s in range(p):
            branch = "if" if s == 0 else ("elif" if s < p - 1 else "else")
            lines.append(f"        {branch} s == {s}:" if branch != "else" else "        else:")
            args = [
                _moved_read(split, n, "dev", pop=not split.passes_on(n, s))
                for n in split.inputs_of(s)
            ]
            outs = [f"v[{quoted(split.names[n])}]" for n in split.outputs_of(s)]
            lhs = ", ".join(outs) + " = " if outs else ""
            call = f"self.stage{s}"
            if s in checkpointed:
                run = [f"run=lambda *a: self.call({s}, *a)"] if s in tied else []
                call, args = "checkpointed", [call, *args, *run]
            elif s in tied:
                call, args = "self.call", [str(s), *args]
            if len(f"            {lhs}{call}(") <= LINE_LENGTH:
                lines += call_lines(12, f"{lhs}{call}", args)
            else:  # many values: the targets one per line, as ruff format writes them
                lines += ["            (", *(f"                {o}," for o in outs)]
                lines += call_lines(12, f") = {call}", args)
        return lines

    def _return_lines(self, p: int) -> list[str]:
        """``forward``'s return: every micro-batch's outputs, moved to the last device, joined."""
        split = self.split
        moved = False

        def per_microbatch(value: Any) -> str:
            nonlocal moved
            if isinstance(value, fx.Node):
                read = f"v[{quoted(split.names[value])}]"
                if split.stage[value] != p - 1 and is_tensor(value):
                    moved = True
                    return f"{read}.to(last)"
                return read
            if isinstance(value, (tuple, list)):
                items = [per_microbatch(v) for v in value]
                close = "," if len(items) == 1 and isinstance(value, tuple) else ""
                opening, closing = "()" if isinstance(value, tuple) else "[]"
                return opening + ", ".join(items) + close + closing
            if isinstance(value, dict):
                items = [f"{self.values.value(k)}: {per_microbatch(v)}" for k, v in value.items()]
                return "{" + ", ".join(items) + "}"
            return self.values.value(value)

        out = split.layout.output
        nodes = {name: node for node, name in split.values.items()}
        if all(name is None or name in nodes for name in out.leaves):
            # the leaves, rebuilt in the model's own output type (ModelOutput, OrderedDict …)
            leaves = iter([
                per_microbatch(nodes[name]) if name is not None else self.values.value(const)
                for name, const in zip(out.leaves, out.constants)
            ])
            tree = self.values.tree(out.spec, leaves)
            per_mb = tree_text(tree)
            if len(f"            {per_mb}") > LINE_LENGTH:  # built in a method of its own
                self._output_method = [
                    "",
                    "    def output(self, v):",
                    '        """The model\'s output from the values v of one micro-batch."""',
                    *(["        last = self.devices[-1]"] if moved else []),
                    *tree_lines(tree, 8, "return "),
                ]
                per_mb, moved = "self.output(v)", False
        else:
            per_mb = per_microbatch(split.output())
        lines = ["        last = self.devices[-1]"] if moved else []
        single = single_tensor_output(split)
        join, tail = ("torch.cat", ")") if single else ("concat", ", rows)")
        line = f"        return {join}([{per_mb} for v in micro]{tail}"
        if len(line) <= LINE_LENGTH:
            return [*lines, line]
        collect = f"        outputs = [{per_mb} for v in micro]"
        if len(collect) > LINE_LENGTH:
            collect = joined(
                "        outputs = [",
                f"            {per_mb}",
                "            for v in micro",
                "        ]",
            )
        return [*lines, collect, f"        return {join}(outputs{tail}"]

    def main_block(self) -> str:
        """``if __name__ == "__main__":`` running the model file's example inputs ('' without)."""
        if self.source.example_inputs is None:
            return ""
        shape = (
            "    shape = tuple(output.shape)"
            if single_tensor_output(self.split)
            else "    shape = [tuple(t.shape) for t in pytree.tree_leaves(output)]"
        )
        devices = 'DEVICES if enough else ["cpu"] * len(DEVICES)'
        if self.split.exported:  # positional inputs, keyword inputs, or both
            call = [
                "    inputs = model_module().example_inputs()",
                "    if isinstance(inputs, dict):",
                "        args, kwargs = (), inputs",
                "    elif isinstance(inputs, tuple) and isinstance(inputs[-1], dict):",
                "        args, kwargs = inputs",
                "    else:",
                "        args, kwargs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs, {}",
                "    first = pipelined.devices[0]",
                "    moved = pytree.tree_map_only(torch.Tensor, lambda t: t.to(first), "
                "(args, kwargs))",
                "    output = pipelined(*moved[0], **moved[1])",
            ]
        else:
            call = [
                "    inputs = model_module().example_inputs()",
                "    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs",
                "    output = pipelined(*(x.to(pipelined.devices[0]) for x in inputs))",
            ]
        return joined(
            'if __name__ == "__main__":',
            "    # One batch of the model file's example inputs (CPU stand-ins without GPUs).",
            "    enough = torch.cuda.device_count() >= len(DEVICES)",
            *call_lines(4, f"pipelined = {self.class_name}", [f"devices={devices}"]),
            *call,
            shape,
            '    print(f"{type(pipelined).__name__} output: {shape}")',
        )


def _moved_read(split: StageSplit, node: fx.Node, device: str, pop: bool) -> str:
    """How ``run_stage`` reads ``node`` for a stage on ``device``: popped when it is the last
    reader, moved with ``.to()`` (a tensor) or ``move()`` (anything else)."""
    name = quoted(split.names[node])
    read = f"v.pop({name})" if pop else f"v[{name}]"
    if is_tensor(node):
        return f"{read}.to({device})"
    return f"move({read}, {device})"


def _tied_call_lines() -> list[str]:
    """The pipelined class's ``call``: a stage reading tied weights from another device."""
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
