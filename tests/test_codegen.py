"""codegen.emit(): the generated module imports, holds the model's own modules, equals the model."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import assert_equivalent, loss_of, reference_run
from torch import nn

import autosplit
import autosplit.stages
from autosplit import PlanOptions, ProfileOptions
from autosplit.codegen import emit
from autosplit.errors import CodegenError, InvalidInputError, PlanMismatchError
from autosplit.modelfile import ModelFileError, load_model_file
from autosplit.records import Plan
from autosplit.stages import CutValueError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

SKIP_MODEL = '''
import torch
from torch import nn


class Skip(nn.Module):
    """h skips the middle stage; x is read again by the last; a dict output made early."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)
        self.side = nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        y = torch.tanh(self.mid(h))
        z = self.norm(y) + h
        return {"out": self.out(z) + self.side(x), "early": (h,)}


def build_model():
    return Skip()


def example_inputs(batch_size=8):
    return (torch.randn(batch_size, 6),)
'''

SHAPES_MODEL = '''
from torch import nn


class Shapes(nn.Module):
    """Sizes read from the input on the first stage are used on the last (ints cross)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 4)

    def forward(self, x):
        n, t = x.shape[0], x.shape[1]
        h = self.b(self.a(x.reshape(n * t, 4)))
        return self.c(h).reshape(n, t, 4)


def build_model():
    return Shapes()
'''

MEAN_MODEL = '''
from torch import nn


class Mean(nn.Module):
    """Returns its output and, as a second leaf, a 0-d mean of it (a loss inside the model)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        y = self.b(self.a(x))
        return y, y.mean()


def build_model():
    return Mean()
'''

TIED_MODEL = '''
from torch import nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.mid(self.emb(ids)))


def build_model():
    return Tied()
'''


# ----------------------------------------------------------------------------------- helpers


def make_plan(model: nn.Module, inputs: tuple[torch.Tensor, ...], stages: int, split: int) -> Plan:
    prof = autosplit.profile(model, inputs,
                             options=ProfileOptions(microbatch_sizes=[split], warmup=0, repeats=1))
    return autosplit.plan(prof, gpus=stages, options=PlanOptions(split_size=split))


def cut_at(plan: Plan, first_blocks: list[str]) -> Plan:
    """``plan`` with its stages replaced: a new stage starts at each of ``first_blocks``."""
    names = [b for s in plan.stages for b in s.blocks]
    cuts = [names.index(n) for n in first_blocks]
    bounds = zip([0, *cuts], [*cuts, len(names)])
    stages = tuple(
        dataclasses.replace(plan.stages[0], index=s, device="cpu", blocks=tuple(names[a:b]))
        for s, (a, b) in enumerate(bounds)
    )
    return dataclasses.replace(plan, stages=stages, solver="manual")


def load(source: str, path: Path) -> ModuleType:
    """Write ``source`` to ``path`` and import it."""
    path.write_text(source)
    name = f"generated_{path.parent.name}_{path.stem}".replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pipelined_class(module: ModuleType) -> type[nn.Module]:
    found = [v for k, v in vars(module).items() if k.startswith("Pipelined")]
    assert len(found) == 1, f"expected one Pipelined… class, found {found}"
    return found[0]


def emit_and_check(
    tmp_path: Path,
    model_ref: str,
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    plan: Plan,
) -> tuple[str, nn.Module, nn.Module]:
    """Emit, import, build on CPUs from the model and check outputs and gradients.

    Returns the source, the pipelined module, and the model it was built from.
    """
    source = emit(plan, model_ref, model=model)
    module = load(source, tmp_path / "pipelined.py")
    ref = copy.deepcopy(model)
    pm = pipelined_class(module)(model=model, devices=["cpu"] * len(plan.stages))
    assert pm.split_size == plan.split_size
    assert_equivalent(model, pm, ref, inputs, plan.split_size)
    return source, pm, model


def stage_call(source: str, s: int) -> list[str]:
    """The arguments run_stage passes to stage s in the generated source."""
    start = source.index(f"self.stage{s}(") + len(f"self.stage{s}(")
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        end += 1
    return [a.strip() for a in source[start : end - 1].split(",") if a.strip()]


def held_parameters(pm: nn.Module) -> set[int]:
    return {id(p) for name, child in pm.named_children() if name.startswith("stage") for p in child.parameters()}


def ruff() -> list[str] | None:
    if shutil.which("ruff"):
        return ["ruff"]
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    return None


def assert_ruff_clean(path: Path) -> None:
    """``ruff check`` and ``ruff format --check`` pass. ruff is in the test extras; where it is
    missing the test is skipped, saying so, rather than passed unchecked."""
    cmd = ruff()
    if cmd is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]'): the emitted file's "
                    "ruff check is not run")
    for args in (["check", "--isolated", "--no-cache"], ["format", "--isolated", "--check", "--diff", "--no-cache"]):
        done = subprocess.run([*cmd, *args, str(path)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"ruff {args[0]} on {path.name}:\n{done.stdout}{done.stderr}"


# ------------------------------------------------------------------------------------ models


@pytest.fixture(scope="module")
def resnet() -> tuple[Any, nn.Module, tuple[torch.Tensor, ...], dict[int, Plan]]:
    """ResNet50 from examples/resnet50.py at 32×32, batch 4, planned for 2 and 3 stages."""
    torch.manual_seed(0)
    mf = load_model_file(str(EXAMPLES / "resnet50.py"))
    model = mf.build()
    inputs = (torch.randn(4, 3, 32, 32),)
    prof = autosplit.profile(model, inputs,
                             options=ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1))
    plans = {p: autosplit.plan(prof, gpus=p, options=PlanOptions(split_size=2)) for p in (2, 3)}
    return mf, model, inputs, plans


def test_toy_two_stages(tmp_path: Path) -> None:
    mf = load_model_file(str(EXAMPLES / "toy.py"))
    model = mf.build()
    inputs = (torch.randn(8, 10),)
    plan = make_plan(model, inputs, 2, 4)
    source, pm, model = emit_and_check(tmp_path, mf.ref, model, inputs, plan)
    # the tutorial's ToyModel split: net1 (+ its ReLU) on stage 0, net2 on stage 1
    assert list(pm.stage0) == [model.net1, model.relu]
    assert pm.stage1 is model.net2
    assert "self.stage1 = model.net2.to(self.devices[1])" in source
    assert 'v["net2"] = self.stage1(v.pop("relu").to(dev))' in source
    assert_ruff_clean(tmp_path / "pipelined.py")


@pytest.mark.parametrize("length", [70, 78, 84, 120])
def test_a_model_file_under_a_long_path_is_emitted_ruff_clean(length: int) -> None:
    # `MODEL_PATH = "…"` within ruff's 88 columns (70), over them with the string fitting on a
    # line of its own (78, 84: ruff format wants it in parentheses), or not even so (120);
    # a folder of its own with a short name (pytest's tmp_path can be 70 characters long)
    with tempfile.TemporaryDirectory(prefix="as-") as folder:
        _emit_under_a_path_of(Path(folder), length)


def _emit_under_a_path_of(tmp_path: Path, length: int) -> None:
    name = "m" * (length - len(str(tmp_path)) - 4) + ".py"
    assert len(str(tmp_path / name)) == length
    shutil.copy(EXAMPLES / "toy.py", tmp_path / name)
    mf = load_model_file(str(tmp_path / name))
    model = mf.build()
    inputs = (torch.randn(8, 10),)
    out = tmp_path / "out"
    out.mkdir()
    source, _, _ = emit_and_check(out, mf.ref, model, inputs, make_plan(model, inputs, 2, 4))
    assert str(tmp_path / name) in source
    assert_ruff_clean(out / "pipelined.py")


@pytest.mark.parametrize("stages", [2, 3])
def test_resnet50(tmp_path: Path, resnet: Any, stages: int) -> None:
    mf, model, inputs, plans = resnet
    model = copy.deepcopy(model)
    _, pm, model = emit_and_check(tmp_path, mf.ref, model, inputs, plans[stages])
    assert held_parameters(pm) == {id(p) for p in model.parameters()}
    assert_ruff_clean(tmp_path / "pipelined.py")


def test_resnet50_file_is_short_readable_and_holds_no_weights(tmp_path: Path, resnet: Any) -> None:
    mf, model, _, plans = resnet
    plan = plans[2]
    source = emit(plan, mf.ref, model=model)
    lines = source.splitlines()
    assert len(lines) < 150, f"{len(lines)} lines"
    assert len(source) < 8000  # ResNet50's weights would be ~100 MB
    assert not re.search(r"tensor\(|Parameter\(|\d+\.\d{6,}", source)
    # one line per block module at most: no leaf-level ops of the Bottlenecks
    assert "conv2" not in source and "downsample" not in source
    # header: the plan, how it was made, the model fingerprint
    header = source.split('"""')[1]
    assert f"cut points    {', '.join(plan.split_points)}" in header
    assert f"split_size    {plan.split_size}: batch 4 → {plan.microbatches} micro-batches" in header
    assert plan.fingerprint in header and plan.profile in header
    assert f"autosplit {autosplit.__version__}" in header and "--emit" in header
    for stage in plan.stages:
        assert f"stage {stage.index}  cpu" in header
    assert f"SPLIT_SIZE = {plan.split_size}" in source
    assert "class PipelinedResNet(nn.Module):" in source
    assert "build_model()" in source and str(EXAMPLES / "resnet50.py") in source


def test_partly_used_container_is_not_moved_whole(tmp_path: Path, resnet: Any) -> None:
    mf, model, inputs, plans = resnet
    plan = cut_at(plans[2], ["layer3.1"])  # the layer3 container is split between stages
    model = copy.deepcopy(model)
    source, pm, model = emit_and_check(tmp_path, mf.ref, model, inputs, plan)
    stage0 = set(map(id, pm.stage0.modules()))
    stage1 = set(map(id, pm.stage1.modules()))
    assert id(model.layer3[0]) in stage0 and id(model.layer3[0]) not in stage1
    assert id(model.layer3[1]) in stage1 and id(model.layer3[1]) not in stage0
    assert id(model.layer3) not in stage0 | stage1
    # whole containers on one stage are folded: layer1/layer2 on stage 0, layer4 on stage 1
    assert "model.layer2," in source and "model.layer3[0]," in source
    assert "self.layer4 = model.layer4" in source and "self.layer3_1 = model.layer3[1]" in source
    assert id(model.layer4) in stage1
    assert held_parameters(pm) == {id(p) for p in model.parameters()}


def test_gpt_tiny_three_stages(tmp_path: Path) -> None:
    mf = load_model_file(str(EXAMPLES / "gpt.py"))
    gpt = sys.modules[mf.module_name]
    model = gpt.build_model("tiny")
    inputs = gpt.example_inputs(4, "tiny")
    plan = make_plan(model, inputs, 3, 2)
    source, pm, model = emit_and_check(tmp_path, mf.ref, model, inputs, plan)
    assert held_parameters(pm) == {id(p) for p in model.parameters()}
    assert_ruff_clean(tmp_path / "pipelined.py")
    # built without a model, the file's factory makes the "small" GPT: the check refuses it
    module = load(source, tmp_path / "again.py")
    with pytest.raises(ValueError, match="parameters"):
        pipelined_class(module)(devices=["cpu"] * 3)


def test_skip_over_a_whole_stage_and_structured_outputs(tmp_path: Path) -> None:
    (tmp_path / "skip.py").write_text(SKIP_MODEL)
    mf = load_model_file(str(tmp_path / "skip.py"))
    model = mf.build()
    inputs = (torch.randn(8, 6),)
    plan = cut_at(make_plan(model, inputs, 2, 4), ["mid", "norm"])
    assert plan.balance == (1, 1, 3)
    source, pm, model = emit_and_check(tmp_path, mf.ref, model, inputs, plan)
    graph = autosplit.trace(model)
    h = next(n.name for n in graph.module.graph.nodes if n.target == "inp")
    # h goes from stage 0 straight to stage 2 (and to the output), x from the input to stage 2
    assert stage_call(source, 0) == ['v["x"].to(dev)']  # not popped: stage 2 reads x again
    assert stage_call(source, 1) == [f'v["{h}"].to(dev)']
    assert f'v["{h}"].to(dev)' in stage_call(source, 2)  # kept for the output
    assert 'v.pop("x").to(dev)' in stage_call(source, 2)
    assert set(pm.stage1.parameters()) == set(model.mid.parameters())
    assert f'"early": (v["{h}"].to(last),)' in source and "def concat(" in source
    # built without a model: the file's own factory, found by its absolute path
    module = load(source, tmp_path / "again.py")
    fresh = pipelined_class(module)(devices=["cpu"] * 3)
    out = fresh(torch.randn(6, 6))  # micro-batches of 4 and 2
    assert out["out"].shape == (6, 3) and out["early"][0].shape == (6, 8)
    assert_ruff_clean(tmp_path / "pipelined.py")


def test_sizes_crossing_a_cut_are_refused_by_emit(tmp_path: Path) -> None:
    """An int read from the input's shape on stage 0 and used on the last stage: partition()
    and distributed compute it again on the last stage; the emitted code does not, and emit
    says so and what to run instead."""
    (tmp_path / "shapes.py").write_text(SHAPES_MODEL)
    mf = load_model_file(str(tmp_path / "shapes.py"))
    model = mf.build()
    inputs = (torch.randn(6, 5, 4),)
    plan = cut_at(make_plan(model, inputs, 2, 2), ["b", "c"])
    with pytest.raises(CodegenError, match=r"autosplit\.partition\(model, plan=plan\)"):
        emit(plan, mf.ref, model=model)
    assert issubclass(CutValueError, InvalidInputError)
    one = cut_at(plan, [])  # one stage: nothing crosses, the file is written
    source, _, _ = emit_and_check(tmp_path, mf.ref, model, inputs, one)
    assert "def move(" not in source
    assert "__main__" not in source  # the file defines no example_inputs
    assert_ruff_clean(tmp_path / "pipelined.py")


def test_a_loss_inside_the_model_is_joined_as_in_partition(tmp_path: Path) -> None:
    """A 0-d floating output (a loss the model computes) is, as in partition(), the mean of
    the micro-batches' values weighted by their rows: micro-batches of 4 and 2 rows give the
    whole batch's mean, and its gradient is the unsplit model's."""
    (tmp_path / "mean.py").write_text(MEAN_MODEL)
    mf = load_model_file(str(tmp_path / "mean.py"))
    model = mf.build()
    inputs = (torch.randn(6, 6),)
    plan = cut_at(make_plan(model, (torch.randn(8, 6),), 2, 4), ["b"])
    source = emit(plan, mf.ref, model=model)
    module = load(source, tmp_path / "mean_pipelined.py")
    ref = copy.deepcopy(model)
    pm = pipelined_class(module)(model=model, devices=["cpu", "cpu"])
    (y, loss), (want_y, want_loss) = pm(*inputs), ref(*inputs)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(loss, autosplit.partition(copy.deepcopy(ref), plan=plan)(*inputs)[1])
    loss.backward()
    want_loss.backward()
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad)
    with pytest.raises(InvalidInputError, match="0-dimensional"):
        autosplit.stages.concat([model(inputs[0][:4]), model(inputs[0][4:])])  # rows unknown
    assert_ruff_clean(tmp_path / "mean_pipelined.py")


def test_devices_and_class_name(tmp_path: Path) -> None:
    mf = load_model_file(str(EXAMPLES / "toy.py"))
    model = mf.build()
    plan = make_plan(model, (torch.randn(8, 10),), 2, 4)
    source = emit(plan, mf.ref, devices=["cuda:0", "cuda:1"], class_name="TwoGpuToy", model=model)
    assert 'DEVICES = ("cuda:0", "cuda:1")' in source
    module = load(source, tmp_path / "named.py")
    pm = module.TwoGpuToy(model=model, devices=["cpu", "cpu"])
    assert pm.devices == [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match="give 2 devices, one per stage"):
        module.TwoGpuToy(model=model, devices=["cpu"])


def test_tied_weights_across_devices_are_read_through_to(tmp_path: Path) -> None:
    (tmp_path / "tied.py").write_text(TIED_MODEL)
    mf = load_model_file(str(tmp_path / "tied.py"))
    model = mf.build()
    inputs = (torch.randint(0, 10, (4, 3)),)
    plan = cut_at(make_plan(model, inputs, 2, 2), ["mid"])
    source = emit(plan, mf.ref, model=model, devices=["cuda:0", "cuda:1"])
    assert "self.borrowed = tied_weights([self.stage0, self.stage1], self.devices)" in source
    assert "self.call(1, " in source
    emit_and_check(tmp_path, mf.ref, model, inputs, plan)  # one device: nothing borrowed
    # "cpu:0" is not "cpu" for torch.device equality: stage 1 counts as another device and
    # reads the embedding's weight through .to(), the path GPUs take
    module = load(source, tmp_path / "borrowed.py")
    model = mf.build()  # fresh: no gradients yet
    ref = copy.deepcopy(model)
    pm = pipelined_class(module)(model=model, devices=["cpu", "cpu:0"])
    assert list(pm.borrowed) == [1] and list(pm.borrowed[1].values()) == [model.emb.weight]
    assert_equivalent(model, pm, ref, inputs, plan.split_size)
    assert_ruff_clean(tmp_path / "borrowed.py")


def test_main_block_runs_the_example_inputs(tmp_path: Path) -> None:
    mf = load_model_file(str(EXAMPLES / "toy.py"))
    model = mf.build()
    plan = make_plan(model, (torch.randn(8, 10),), 2, 4)
    path = tmp_path / "pipelined_toy.py"
    path.write_text(emit(plan, mf.ref, model=model))
    done = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "PipelinedToyModel output: (20, 5)" in done.stdout


def test_model_file_found_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The absolute path is tried first; once it is gone, the path as given, from the cwd."""
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "models").mkdir(parents=True)
    (old / "models" / "toy.py").write_text((EXAMPLES / "toy.py").read_text())
    monkeypatch.chdir(old)
    mf = load_model_file("models/toy.py")
    model = mf.build()
    plan = make_plan(model, (torch.randn(8, 10),), 2, 4)
    source = emit(plan, mf.ref, model=model)
    assert 'MODEL_FILE = "models/toy.py"' in source
    shutil.move(old, new)
    monkeypatch.chdir(new)
    module = load(source, new / "pipelined.py")
    pm = pipelined_class(module)()
    assert pm(torch.randn(6, 10)).shape == (6, 5)
    monkeypatch.chdir(tmp_path)
    module.model_module.cache_clear()
    with pytest.raises(FileNotFoundError, match="models/toy.py"):
        module.model_module()


def test_module_reference(tmp_path: Path) -> None:
    """'package.module:factory' is imported by name in the generated code."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    (tmp_path / "netpkg").mkdir()
    (tmp_path / "netpkg" / "__init__.py").write_text("")
    (tmp_path / "netpkg" / "nets.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def small():
                return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        plan = make_plan(model, (torch.randn(4, 4),), 2, 2)
        source = emit(plan, "netpkg.nets:small", model=model)
        assert 'MODEL_MODULE = "netpkg.nets"' in source and "model_module().small()" in source
        emit_and_check(tmp_path, "netpkg.nets:small", model, (torch.randn(4, 4),), plan)
        fresh = pipelined_class(load(source, tmp_path / "fresh.py"))()  # built by netpkg.nets.small
        assert fresh(torch.randn(3, 4)).shape == (3, 2)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == "netpkg" or n.startswith("netpkg.")]:
            del sys.modules[name]


# --------------------------------------------------------------------------------- bad input


def test_plan_for_another_model_is_refused() -> None:
    toy = load_model_file(str(EXAMPLES / "toy.py"))
    plan = make_plan(toy.build(), (torch.randn(8, 10),), 2, 4)
    with pytest.raises(PlanMismatchError, match=plan.fingerprint):  # a model file, another model
        emit(plan, f"{EXAMPLES / 'resnet50.py'}:build_model")


def test_unknown_model_ref_is_a_clear_error(tmp_path: Path) -> None:
    toy = load_model_file(str(EXAMPLES / "toy.py"))
    plan = make_plan(toy.build(), (torch.randn(8, 10),), 2, 4)
    missing = tmp_path / "nowhere.py"
    with pytest.raises(ModelFileError, match="nowhere.py.*does not exist"):
        emit(plan, f"{missing}:build_model")
    with pytest.raises(ModelFileError, match="defines no model: looked for make_it"):
        emit(plan, f"{EXAMPLES / 'toy.py'}:make_it")
    with pytest.raises(ModelFileError, match="cannot import module 'no_such_package_xyz.models'"):
        emit(plan, "no_such_package_xyz.models:build")
    with pytest.raises(InvalidInputError, match="model_ref must be"):
        emit(plan, "")


def test_bad_arguments(tmp_path: Path) -> None:
    toy = load_model_file(str(EXAMPLES / "toy.py"))
    model = toy.build()
    plan = make_plan(model, (torch.randn(8, 10),), 2, 4)
    with pytest.raises(InvalidInputError, match="one device per stage"):
        emit(plan, toy.ref, model=model, devices=["cpu"])
    with pytest.raises(InvalidInputError, match="class_name 'not valid'"):
        emit(plan, toy.ref, model=model, class_name="not valid")
    with pytest.raises(InvalidInputError, match="class_name 'Stage0'"):
        emit(plan, toy.ref, model=model, class_name="Stage0")
    with pytest.raises(InvalidInputError, match="plan must be an autosplit Plan"):
        emit(str(plan), toy.ref, model=model)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="model must be a torch.nn.Module"):
        emit(plan, toy.ref, model="net")  # type: ignore[arg-type]


def test_emitting_leaves_the_model_unchanged() -> None:
    toy = load_model_file(str(EXAMPLES / "toy.py"))
    model = toy.build()
    plan = make_plan(model, (torch.randn(8, 10),), 2, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    emit(plan, toy.ref, model=model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v)
    assert model.training


def test_leaf_granularity(tmp_path: Path) -> None:
    """A plan made at granularity='layer' (toy model on 3 stages: net1 | relu | net2)."""
    mf = load_model_file(str(EXAMPLES / "toy.py"))
    model = mf.build()
    inputs = (torch.randn(8, 10),)
    prof = autosplit.profile(
        model, inputs, granularity="layer", options=ProfileOptions(microbatch_sizes=[4], warmup=0,
                                                                   repeats=1)
    )
    plan = autosplit.plan(prof, gpus=3, options=PlanOptions(split_size=4))
    source = emit(plan, mf.ref, model=model, granularity="layer")
    module = load(source, tmp_path / "layers.py")
    ref = copy.deepcopy(model)
    pm = pipelined_class(module)(model=model, devices=["cpu"] * 3)
    assert [pm.stage0, pm.stage1, pm.stage2] == [model.net1, model.relu, model.net2]
    assert_equivalent(model, pm, ref, inputs, 4)
    with pytest.raises(PlanMismatchError):  # the plan's blocks are not the default ones
        emit(plan, mf.ref, model=model)


UNTRACEABLE_MODEL = '''
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: torch.fx cannot trace it
            return self.lin(x)
        return self.lin(-x)


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.gate = Gate()
        self.last = nn.Linear(6, 2)

    def forward(self, x):
        return self.last(self.gate(self.first(x)))


def build_model():
    return Untraceable()


def example_inputs(batch_size=4):
    return (torch.randn(batch_size, 6),)
'''


def test_untraceable_model_split_at_its_children(tmp_path: Path) -> None:
    (tmp_path / "untraceable.py").write_text(UNTRACEABLE_MODEL)
    mf = load_model_file(str(tmp_path / "untraceable.py"))
    model = mf.build()
    inputs = mf.example_inputs(8)
    with pytest.warns(UserWarning, match="cannot trace"):
        plan = make_plan(model, inputs, 3, 4)
    with pytest.warns(UserWarning, match="cannot trace"):
        _, pm, model = emit_and_check(tmp_path, mf.ref, model, inputs, plan)
    assert [pm.stage0, pm.stage1, pm.stage2] == [model.first, model.gate, model.last]


@pytest.mark.cuda
def test_cuda_stages_after_a_cpu_stage(tmp_path: Path) -> None:
    """Stage 0 on the CPU, stages 1–2 on cuda:0: inputs, skips and outputs cross devices."""
    (tmp_path / "skip.py").write_text(SKIP_MODEL)
    mf = load_model_file(str(tmp_path / "skip.py"))
    model = mf.build()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 6)
    plan = cut_at(make_plan(model, (x,), 2, 4), ["mid", "norm"])
    devices = ["cpu", "cuda:0", "cuda:0"]
    module = load(emit(plan, mf.ref, model=model, devices=devices), tmp_path / "cuda.py")
    pm = pipelined_class(module)(model=model)
    assert {p.device.type for p in model.mid.parameters()} == {"cuda"}
    assert {p.device.type for p in model.inp.parameters()} == {"cpu"}
    out = pm(x)
    assert out["out"].device.type == "cuda" and out["early"][0].device.type == "cuda"
    expected = reference_run(ref, (x,), plan.split_size)
    got = {"out": out["out"].cpu(), "early": (out["early"][0].cpu(),)}
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    loss_of(got).backward()
    loss_of(expected).backward()
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name].grad.cpu(), p.grad, rtol=1e-4, atol=1e-4)
