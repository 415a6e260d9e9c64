"""codegen.emit() for models torch.fx cannot trace: written from torch.export's operations.

Hugging Face, timm and torchvision models at tiny configurations (tests/zoo.py) are emitted on 2
and 4 stages; the emitted module, run on CPUs, equals the unsplit model on the same
micro-batches: outputs in the model's own type (a ``ModelOutput`` with its loss), and every
parameter gradient, tied weights included.
"""

from __future__ import annotations

import copy
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from synthetic import even_balance, plan_of
from test_codegen import assert_ruff_clean, load, pipelined_class
from zoo import ZOO, build
from zoo_checks import assert_same_output, assert_trains_like, reference

from autosplit.capture.trace import trace
from autosplit.codegen import emit
from autosplit.measure.timing_process import model_files
from autosplit.modelfile import load_model_file

pytest.importorskip("transformers")
pytest.importorskip("timm")

ROWS, SPLIT = 4, 2
TESTS = Path(__file__).resolve().parent



@pytest.fixture(autouse=True)
def _forget_model_files() -> Iterator[None]:
    """The model files a test loads are forgotten after it: every later timing process
    imports the loaded ones first, and these put tests/ on its path (so it could import the
    test modules whose classes some tests need it not to load)."""
    before = set(model_files())
    yield
    for name in set(model_files()) - before:
        sys.modules.pop(name, None)


MODEL_FILE = """\
import sys

sys.path.insert(0, {tests!r})
from zoo import build


def build_model():
    return build({name!r})[0]


def example_inputs(batch_size=4):
    args, kwargs = build({name!r})[1](batch_size)
    return (args, kwargs) if args else kwargs
"""


def model_file(tmp_path: Path, name: str) -> str:
    """A model file that builds zoo model ``name``; its reference for emit()."""
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(MODEL_FILE.format(tests=str(TESTS), name=name))
    return f"{path}:build_model"


# The zoo models torch.export captures (torch.fx cannot trace them); the others trace with
# torch.fx, and the blocks of the two ViTs nest (their stages are written from the block
# graph's own nodes, not from a trace with the blocks as leaves).
EXPORTED = ("hf-gpt2", "hf-llama", "hf-bert", "hf-albert", "hf-t5", "hf-vit", "timm-efficientvit")
CASES = [(name, 2) for name in ZOO] + [("hf-llama", 4), ("tv-vit", 4)]


@pytest.mark.parametrize(("name", "stages"), CASES)
def test_the_emitted_module_equals_the_unsplit_model(
        tmp_path: Path, name: str, stages: int) -> None:
    model, call = build(name)
    ref_model = copy.deepcopy(model)
    args, kwargs = call(ROWS)
    graph = trace(model, example_inputs=args, example_kwargs=kwargs)
    assert (graph.capture is not None and graph.capture.front == "export") == (name in EXPORTED)
    plan = plan_of(graph, even_balance(len(graph.blocks), stages), SPLIT, ROWS // SPLIT)
    source = emit(plan, model_file(tmp_path, name), model=model)
    path = tmp_path / "pipelined.py"
    module = load(source, path)
    assert "autosplit" not in "".join(line for line in source.splitlines()
                                      if line.startswith(("import", "from")))
    pm = pipelined_class(module)(model=model, devices=["cpu"] * stages)

    assert_trains_like(pm, model, ref_model, args, kwargs, SPLIT)
    assert_ruff_clean(path)


def test_an_autocast_region_is_a_with_block_and_another_region_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EfficientViT's attention runs under torch.autocast: the emitted stage enters it with the
    device type of the region's operands. A higher-order operation generated code has no
    writing for is refused by name, never written as a call that would fail."""
    from autosplit.codegen import expressions
    from autosplit.errors import CodegenError

    model, call = build("timm-efficientvit")
    args, kwargs = call(ROWS)
    graph = trace(model, example_inputs=args, example_kwargs=kwargs)
    plan = plan_of(graph, even_balance(len(graph.blocks), 2), SPLIT, ROWS // SPLIT)
    source = emit(plan, model_file(tmp_path, "timm-efficientvit"), model=model)
    flat = " ".join(source.split())
    assert "with torch.autocast( relu.device.type, dtype=torch.bfloat16, enabled=False," in flat
    monkeypatch.setattr(expressions, "CONTEXTS", {})
    with pytest.raises(CodegenError, match="wrap_with_autocast.*autosplit.partition"):
        emit(plan, model_file(tmp_path, "timm-efficientvit"), model=model)


def test_gpt2_tied_embedding_across_devices_is_read_through_to(tmp_path: Path) -> None:
    """GPT-2's lm_head is wte: with the two stages on different devices ("cpu" and "cpu:0"
    differ for torch.device), the last stage reads the embedding through a differentiable
    .to(), and its gradient from both uses reaches the one parameter."""
    model, call = build("hf-gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    ref_model = copy.deepcopy(model)
    args, kwargs = call(ROWS)
    graph = trace(model, example_inputs=args, example_kwargs=kwargs)
    plan = plan_of(graph, even_balance(len(graph.blocks), 2), SPLIT, ROWS // SPLIT)
    source = emit(plan, model_file(tmp_path, "hf-gpt2"), model=model, devices=["cpu", "cpu:0"])
    assert "tied_weights([self.stage0, self.stage1], self.devices)" in source
    module = load(source, tmp_path / "tied.py")
    pm = pipelined_class(module)(model=model, devices=["cpu", "cpu:0"])
    assert list(pm.borrowed) == [1]
    assert list(pm.borrowed[1].values()) == [model.transformer.wte.weight]
    got, want = pm(*args, **kwargs), reference(ref_model, args, kwargs, SPLIT)
    assert_same_output(got, want)
    got.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(model.transformer.wte.weight.grad,
                               ref_model.transformer.wte.weight.grad)
    assert_ruff_clean(tmp_path / "tied.py")


def test_llama_emitted_takes_keyword_inputs_and_runs_its_example(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/llama.py emitted: called with keyword inputs (labels other than the ids, so a
    capture that mixed them up would show), it returns the model's CausalLMOutputWithPast with
    the batch's loss; its ``__main__`` block runs the model file's keyword example inputs."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    ref = str(TESTS.parent / "examples" / "llama.py") + ":build_model"
    torch.manual_seed(0)
    file = sys.modules[load_model_file(ref.rpartition(":")[0]).module_name]
    model = file.build_model()
    ref_model = copy.deepcopy(model)
    inputs = file.example_inputs(ROWS)
    graph = trace(model, example_kwargs=inputs)
    plan = plan_of(graph, even_balance(len(graph.blocks), 2), SPLIT, ROWS // SPLIT)
    source = emit(plan, ref, model=model)
    path = tmp_path / "pipelined_llama.py"
    pm = pipelined_class(load(source, path))(model=model, devices=["cpu", "cpu"])
    labels = (inputs["input_ids"] + 1) % 1024
    labels[:, :4] = -100
    other = {**inputs, "labels": labels}
    got, want = pm(**other), reference(ref_model, (), other, SPLIT)
    assert isinstance(got, CausalLMOutputWithPast) and got.loss.dim() == 0
    assert_same_output(got, want)
    runpy.run_path(str(path), run_name="__main__")
    assert "PipelinedLlamaForCausalLM output: [(), (16, 32, 1024)]" in capsys.readouterr().out

