"""The generated module's text: header, imports, constants, helpers, stages, main.

The header quotes the plan and the command that made it; the constants say where the model
file is, the devices, the micro-batch size and the number of parameters the stages must hold;
the helpers (``tied_weights``, ``move``, ``concat``) appear only when the stages need them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from autosplit.codegen.expressions import ExpressionWriter
from autosplit.codegen.model_source import ModelSource
from autosplit.codegen.pipelined import (
    PipelinedClassWriter,
    crosses_non_tensor,
    single_tensor_output,
)
from autosplit.codegen.stage_classes import stage_code
from autosplit.codegen.structure import StageSplit
from autosplit.codegen.text import (
    assignment,
    block_span,
    call_lines,
    docstring_safe,
    joined,
    quoted,
)
from autosplit.modelfile import MODEL_NAMES
from autosplit.plan_text import one_device_way
from autosplit.records import Plan
from autosplit.units import format_bytes, format_ms


class ModuleWriter:
    """Renders the generated module from a plan and its stage split."""

    def __init__(
        self,
        plan: Plan,
        source: ModelSource,
        split: StageSplit,
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
        self.values = ExpressionWriter(split, source.module_name)
        self.model_name = type(split.model).__name__

    def render(self) -> str:
        """The whole module's source, ending with a newline."""
        p = len(self.plan.stages)
        stages = [stage_code(self.split, self.values, s) for s in range(p)]  # fills imports
        pipelined = PipelinedClassWriter(self.split, self.source, self.class_name, self.values)
        # written before the imports: the output's class may need one
        pipelined_class = pipelined.source_text(stages, [st.checkpoint for st in self.plan.stages])
        parts = [
            self._header(),
            self._imports(),
            self._constants(),
            self._loader(),
            *self._helpers(),
            *(stage.class_source for stage in stages if stage.class_source),
            pipelined_class,
            pipelined.main_block(),
        ]
        head, imports, *rest = [part.rstrip("\n") for part in parts if part]
        return f"{head}\n\n{imports}\n\n" + "\n\n\n".join(rest) + "\n"

    def _header(self) -> str:
        """The module docstring: the plan, and the command that made it."""
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
                f"{format_ms(plan.single_device_ms)}{one_device_way(plan)} (×{plan.speedup:.2f})"
            ),
        ]
        for st in plan.stages:
            lines.append(
                f"  stage {st.index}  {st.device:<6} {block_span(st.blocks)}: "
                f"{format_ms(st.compute_ms)} per micro-batch, {format_bytes(st.memory_bytes)}"
                + (", checkpointed" if st.checkpoint else "")
            )
        lines.append(f"  profile       {plan.profile} · solver {plan.solver}")
        if plan.schedule != "gpipe":
            lines.append(
                f"  note          forward runs in fill-drain order; {plan.schedule} shaped the "
                "memory estimate"
            )
        from autosplit import __version__

        lines += ["", f"Made with autosplit {__version__}: {self._command()}", '"""']
        inner = [docstring_safe(line) for line in lines[1:-1]]
        return "\n".join([lines[0], *inner, lines[-1]])

    def _command(self) -> str:
        """The command line quoted in the header."""
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
        """The import lines: the standard library, then torch and what the stages call."""
        from_file = {"functools", "importlib.util", "os", "sys"} if self.source.path else set()
        std = {"importlib"} | from_file | ({"contextlib"} if self._checkpointed() else set())
        std |= {m for m in self.values.imports if m.split(".")[0] in sys.stdlib_module_names}
        other = {m for m in self.values.imports if m.split(".")[0] not in sys.stdlib_module_names}
        if self.source.path:
            std.discard("importlib")
        lines = [f"import {m}" for m in sorted(std)] + [""]
        lines += [f"import {m}" for m in sorted(other | {"torch"})]
        lines.append("from torch import nn")
        if self._checkpointed():
            lines.append("from torch.utils.checkpoint import checkpoint")
        if crosses_non_tensor(self.split) or not single_tensor_output(self.split) or (
                self.split.exported and self.source.example_inputs is not None):
            lines.append("from torch.utils import _pytree as pytree")
        return "\n".join(lines)

    def _constants(self) -> str:
        """MODEL_PATH/MODEL_FILE or MODEL_MODULE, DEVICES, SPLIT_SIZE, PARAMETERS."""
        lines = []
        src = self.source
        if src.path is not None:
            lines.append(
                "# The model file where it was when this was written, else as it was given"
            )
            lines.append(assignment("MODEL_PATH", quoted(str(src.path))))
            lines.append("# from the working directory")
            lines.append(assignment("MODEL_FILE", quoted(src.given)))
        else:
            lines.append(assignment("MODEL_MODULE", quoted(src.given)))
        devices = ", ".join(quoted(d) for d in self.devices)
        lines.append(f"DEVICES = ({devices}{',' if len(self.devices) == 1 else ''})")
        lines.append(f"SPLIT_SIZE = {self.plan.split_size}  # micro-batch size")
        count = self.split.parameter_count()
        lines.append(f"PARAMETERS = {count:_}  # held by the stages: a check of the model")
        if self.values.aten:
            lines.append("aten = torch.ops.aten  # torch's operators, as torch.export recorded them")
        return "\n".join(lines)

    def _loader(self) -> str:
        """``model_module()``: imports the model file or module."""
        src = self.source
        if src.path is None:
            return joined(
                "def model_module():",
                '    """The module that builds the model."""',
                "    return importlib.import_module(MODEL_MODULE)",
            )
        return joined(
            "@functools.cache",
            "def model_module():",
            '    """Import the model file: from MODEL_PATH, or else MODEL_FILE."""',
            "    path = MODEL_PATH if os.path.isfile(MODEL_PATH) else os.path.abspath(MODEL_FILE)",
            "    if not os.path.isfile(path):",
            '        raise FileNotFoundError(f"model file not found: {MODEL_PATH} nor {path}")',
            *call_lines(
                4,
                "spec = importlib.util.spec_from_file_location",
                [quoted("autosplit_model_" + src.path.stem), "path"],
            ),
            "    module = importlib.util.module_from_spec(spec)",
            "    sys.modules[spec.name] = module",
            "    sys.path.insert(0, os.path.dirname(path))  # so that it imports its neighbours",
            "    spec.loader.exec_module(module)",
            "    return module",
        )

    def _checkpointed(self) -> bool:
        """Whether a stage runs under activation checkpointing."""
        return any(st.checkpoint for st in self.plan.stages)

    def _helpers(self) -> list[str]:
        """The helper functions the pipelined class uses: tied_weights, move, concat,
        checkpointed."""
        out = []
        if self._checkpointed():
            out.append(joined(
                "def checkpointed(stage, *args, run=None):",
                '    """run(*args) (default stage(*args)) under activation checkpointing: only',
                "    args are kept for backward, which first runs the forward again (drawing the",
                "    same random numbers). The stage's buffers (BatchNorm statistics) are put",
                "    back after that rerun, so that they update once per micro-batch.",
                '    """',
                "    return checkpoint(",
                "        run or stage,",
                "        *args,",
                "        use_reentrant=False,",
                "        context_fn=lambda: (contextlib.nullcontext(), buffers_kept(stage)),",
                "    )",
            ))
            out.append(joined(
                "@contextlib.contextmanager",
                "def buffers_kept(module):",
                '    """Put the buffers of module back as they were on entering."""',
                "    saved = [(b, b.detach().clone()) for b in module.buffers()]",
                "    try:",
                "        yield",
                "    finally:",
                "        with torch.no_grad():",
                "            for b, value in saved:",
                "                b.copy_(value)",
            ))
        if self.split.tied_stages():
            out.append(joined(
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
        if crosses_non_tensor(self.split):
            out.append(joined(
                "def move(value, device):",
                '    """Move the tensors in value (a tensor, a tuple of them, a shape …) '
                'to device."""',
                "    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)",
            ))
        if not single_tensor_output(self.split):
            out.append(joined(
                "def concat(outputs, rows):",
                '    """Join the micro-batches\' outputs (tensors, tuples, dicts …) along dim 0.',
                "",
                "    A 0-dimensional floating leaf (the model's own loss, a mean over its rows)",
                "    becomes the mean of the micro-batches' values weighted by their rows; other",
                "    leaves are constants, taken from the first micro-batch.",
                '    """',
                "    flat = [pytree.tree_flatten(out) for out in outputs]",
                "    leaves = []",
                "    for ls in zip(*(leaves for leaves, _ in flat)):",
                "        if not isinstance(ls[0], torch.Tensor):",
                "            leaves.append(ls[0])",
                "        elif ls[0].dim() > 0:",
                "            leaves.append(torch.cat(ls))",
                "        elif ls[0].is_floating_point():",
                "            leaves.append(sum(x * (r / sum(rows)) for x, r in zip(ls, rows)))",
                "        else:",
                "            raise ValueError(",
                '                "a 0-dimensional output that is not a floating loss: pipelined "',
                '                "outputs need a batch dimension 0"',
                "            )",
                "    return pytree.tree_unflatten(leaves, flat[0][1])",
            ))
        return out
