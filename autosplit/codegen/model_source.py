"""Where the generated module finds the model: a model file's path or a module's name.

The generated module imports the model file from the absolute path it had when the code was
emitted, and, when nothing is there any more, from the path as it was given, relative to the
working directory. A ``package.module:factory`` reference is imported by name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from autosplit.errors import InvalidInputError
from autosplit.modelfile import load_model_file


@dataclass(frozen=True, slots=True)
class ModelSource:
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
    def load(cls, model_ref: str) -> ModelSource:
        """The model reference ``model_ref`` loaded (see :func:`autosplit.codegen.emit`)."""
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

