"""Write a plan as a readable, standalone Python module in the tutorial's style.

``emit(plan, "examples/resnet50.py:build_model")`` returns the source of a module that builds
the model with the model file's own factory (no weights are written into it), gathers the
model's own submodules into one stage per device — an ``nn.Sequential`` where the stage is a
plain chain, else a small generated ``nn.Module`` whose ``forward`` is the stage's code — moves
each stage with ``.to(device)``, and runs them as the tutorial's ``PipelineParallelResNet50``
does, generalised to p stages. A weight that several stages share (tied embeddings) stays
once, on the first such stage's device; stages on other devices read it through a
differentiable ``.to()`` (``torch.func.functional_call``), so its gradient reaches it.

The package, in the order the code is written:

- :mod:`~autosplit.codegen.model_source`: where the generated module finds the model;
- :mod:`~autosplit.codegen.structure`: the coarse trace (block modules as leaves), each node
  on its stage, the names of the values;
- :mod:`~autosplit.codegen.expressions`: an fx node as a Python statement;
- :mod:`~autosplit.codegen.stage_classes`: each stage as a chain of modules or a class;
- :mod:`~autosplit.codegen.pipelined`: the pipelined class and the ``__main__`` block;
- :mod:`~autosplit.codegen.template`: the whole module (header, imports, constants, helpers);
- :mod:`~autosplit.codegen.text`: string literals and wrapped lines.
"""

from __future__ import annotations

import keyword
from collections.abc import Sequence

import torch
from torch import nn

from autosplit import checks
from autosplit.capture.signature import example_call
from autosplit.capture.trace import trace
from autosplit.codegen.model_source import ModelSource
from autosplit.codegen.names import GLOBALS
from autosplit.codegen.structure import StageSplit
from autosplit.codegen.template import ModuleWriter
from autosplit.codegen.text import LINE_LENGTH
from autosplit.errors import CodegenError, InvalidInputError
from autosplit.graph import Granularity, leaf_module_list
from autosplit.one_process import require_pipeline_only
from autosplit.records import Plan

__all__ = ["LINE_LENGTH", "CodegenError", "emit"]


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
        InvalidInputError: bad arguments, a plan with data-parallel replicas (it needs
            ``autosplit run``), or a ``model_ref`` that cannot be imported or names no model
            (:class:`autosplit.modelfile.ModelFileError`).
        PlanMismatchError: the plan was made for another model than ``model_ref`` builds.
        CodegenError: a stage's code cannot be written (an unsupported construct, or the
            coarse graph cannot be matched to the plan's blocks).
    """
    checks.instance_of("plan", plan, Plan, "an autosplit Plan")
    require_pipeline_only(plan, "emit()")
    checks.instance_of(
        "model_ref", model_ref, str, "'path/to/file.py:factory' or 'package.module:factory'"
    )
    checks.optional(checks.sequence_of, "devices", devices, checks.device_name)
    checks.optional(checks.text, "class_name", class_name)
    checks.optional(checks.instance_of, "model", model, nn.Module, "a torch.nn.Module")
    checks.optional(checks.text, "command", command)
    checks.one_of("granularity", granularity, ("block", "layer"))
    leaf_modules = leaf_module_list(leaf_modules)
    source = ModelSource.load(model_ref)
    if model is None:
        model = source.build()
    if source.example_inputs is None:
        graph = trace(model, granularity=granularity, leaf_modules=tuple(leaf_modules))
    else:  # captured from the example call (positional inputs, keyword inputs, or both, as
        # a model file's example_inputs gives them): the output's own type is known then
        call_args, call_kwargs = example_call(source.example_inputs(None))
        graph = trace(
            model,
            granularity=granularity,
            leaf_modules=tuple(leaf_modules),
            example_inputs=call_args,
            example_kwargs=call_kwargs,
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
    if not name.isidentifier() or keyword.iskeyword(name) or name in GLOBALS or (
        name.startswith("Stage") and name[5:].isdigit()
    ):
        raise InvalidInputError(
            f"class_name {name!r} is not usable as the generated class's name: give a Python "
            "identifier such as 'PipelinedNet' (not a keyword, nor StageN)"
        )
    split = StageSplit.build(model, graph, plan, granularity, tuple(leaf_modules))
    split.check_devices(devs)
    return ModuleWriter(plan, source, split, devs, name, command).render()

