"""partition(): the pipelined module equals the original run micro-batch by micro-batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from conftest import assert_equivalent, partition_and_check
from models import LongSkip, TokenModel, ToyModel, TupleAcross, TwoInOut
from synthetic import plan_of
from test_stages import TUPLE_MESSAGE, SizeAcross

import autosplit
from autosplit import PartitionOptions, PlanOptions, ProfileOptions
from autosplit.pipeline import PipelinedModule
from autosplit.planner import plan_with_balance
from autosplit.stages import CutValueError


@pytest.mark.parametrize("stages", [2, 3])
def test_toy_model(stages: int) -> None:
    # ToyModel has three operations; with the default grouping the ReLU joins net1 (2 blocks),
    # so 3 stages need granularity="layer".
    granularity = "block" if stages == 2 else "layer"
    partition_and_check(ToyModel(), (torch.randn(12, 10),), stages, 4, granularity=granularity)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_resnet50_small_input(stages: int) -> None:
    model = torchvision.models.resnet50(num_classes=10)
    pm = partition_and_check(model, (torch.randn(6, 3, 32, 32),), stages, 3)
    assert pm.plan is not None and sum(pm.plan.balance) == 19


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_long_skip_crossing_every_cut(stages: int) -> None:
    model = LongSkip()
    pm = partition_and_check(model, (torch.randn(9, 6),), stages, 3)
    graph = autosplit.trace(model)
    skip = next(n for n in graph.module.graph.nodes if n.target == "inp").name
    # the skip is live from its block (0) up to the add in block 4
    assert [skip in cut.tensors for cut in graph.cuts] == [True] * 4 + [False] * 2
    assert pm.plan is not None


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_two_inputs_tuple_and_dict_output(stages: int) -> None:
    partition_and_check(TwoInOut(), (torch.randn(8, 4), torch.randn(8, 3)), stages, 2)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_token_ids(stages: int) -> None:
    ids = torch.randint(0, 17, (6, 5))
    partition_and_check(TokenModel(), (ids,), stages, 2)


def test_reuses_the_models_own_parameters() -> None:
    model = LongSkip()
    quick = ProfileOptions(microbatch_sizes=[4], warmup=0, repeats=1)
    pm = autosplit.partition(model, (torch.randn(8, 6),), gpus=2,
                             options=PartitionOptions(profile=quick))
    stage_params = {id(p) for stage in pm.stages for p in stage.parameters()}
    assert stage_params == {id(p) for p in model.parameters()}
    assert [id(p) for p in pm.parameters()] == [id(p) for p in model.parameters()]


@pytest.mark.parametrize("batch", [7, 2])
def test_uneven_and_small_batches(batch: int) -> None:
    model = ToyModel()
    ref = copy.deepcopy(model)
    prof = autosplit.profile(model, torch.randn(8, 10),
                             options=ProfileOptions(microbatch_sizes=[3], warmup=0, repeats=1))
    pm = autosplit.partition(model, plan=autosplit.plan(prof, gpus=2,
                                                        options=PlanOptions(split_size=3)))
    assert_equivalent(model, pm, ref, (torch.randn(batch, 10),), 3)


def test_lazy_partition_plans_on_first_call() -> None:
    model = LongSkip()
    ref = copy.deepcopy(model)
    pm = autosplit.partition(model,
                             options=PartitionOptions(profile=ProfileOptions(warmup=0, repeats=1)))
    assert pm.plan is None
    x = torch.randn(8, 6)
    out = pm(x)
    assert pm.plan is not None and len(pm.plan.stages) == 2
    assert pm.plan.batch_size == 8 and pm.split_size in pm.plan.candidates
    # profiling on the first call left the model as it was: the result equals the original
    torch.testing.assert_close(out, torch.cat([ref(mb) for mb in x.split(pm.split_size)]))


def test_one_call_partition_prints_a_plan() -> None:
    model = ToyModel()
    quick = ProfileOptions(microbatch_sizes=[4, 8], warmup=0, repeats=1)
    pm = autosplit.partition(model, (torch.randn(16, 10),), gpus=2,
                             options=PartitionOptions(profile=quick))
    text = str(pm.plan)
    assert "net1" in text and "net2" in text and "micro-batches of" in text
    assert pm.plan.split_points == ("net2",)
    assert pm.plan.balance == (1, 1)


def test_split_size_override_with_plan() -> None:
    model = ToyModel()
    ref = copy.deepcopy(model)
    prof = autosplit.profile(model, torch.randn(8, 10),
                             options=ProfileOptions(microbatch_sizes=[4], warmup=0, repeats=1))
    pm = autosplit.partition(model, plan=autosplit.plan(prof, gpus=2),
                             options=PartitionOptions(split_size=2))
    assert pm.split_size == 2
    assert_equivalent(model, pm, ref, (torch.randn(8, 10),), 2)


def test_non_tensor_crossing_a_cut_is_refused_naming_it() -> None:
    """The same error (class and message) as in autosplit.distributed: only tensors cross;
    a size is computed again where it is used."""
    model = TupleAcross()
    # from an example call the tuple is seen, and no cut is offered where it is live
    assert autosplit.trace(model, example_inputs=torch.randn(4, 4)).block_names == ("a",)
    graph = autosplit.trace(model)  # without one, a plan cutting there fails when it runs
    pm = autosplit.partition(model, plan=plan_of(graph, (1, 2), split_size=2))
    assert pm.layout is not None and "chunk" in pm.layout.stages[0].sends
    with pytest.raises(CutValueError, match=TUPLE_MESSAGE):
        pm(torch.randn(4, 4))
    sized = SizeAcross()
    prof = autosplit.profile(sized, torch.randn(4, 4),
                             options=ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1))
    pm = autosplit.partition(sized, plan=plan_with_balance(prof, (1, 2), split_size=2))
    x = torch.randn(4, 4)
    torch.testing.assert_close(pm(x), sized(x))


def test_pipelined_module_runs_what_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """PipelinedModule neither traces, profiles nor plans: with a graph and a plan it only
    builds and runs the stages (the policy is partition()'s)."""
    model = ToyModel()
    ref = copy.deepcopy(model)
    graph = autosplit.trace(model)
    prof = autosplit.profile(model, torch.randn(8, 10),
                             options=ProfileOptions(microbatch_sizes=[4], warmup=0, repeats=1))
    plan = autosplit.plan(prof, gpus=2, options=PlanOptions(split_size=4))

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("PipelinedModule called a policy function")

    for target in ("autosplit.capture.trace.trace", "autosplit.measure.profiler.profile_graph",
                   "autosplit.planner.plan", "autosplit.devices.measure_link_bandwidth"):
        monkeypatch.setattr(target, forbidden)
    import autosplit.pipeline as mechanism

    for name in ("trace", "profile_graph", "make_plan", "measure_link_bandwidth"):
        assert not hasattr(mechanism, name), name
    pm = PipelinedModule(model, [torch.device("cpu")] * 2, graph=graph, plan=plan)
    assert pm.plan is plan and pm.layout is not None and pm.layout.balance == plan.balance
    assert_equivalent(model, pm, ref, (torch.randn(8, 10),), 4)


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.mark.cuda
@pytest.mark.parametrize("devices", [
    pytest.param(["cuda:0", "cuda:0"], id="both-stages-on-cuda0"),
    pytest.param(["cpu", "cuda:0"], id="cpu-then-cuda0"),
    pytest.param(["cuda:0", "cuda:1"], id="two-gpus", marks=TWO_GPUS),
])
def test_cuda_equivalence(devices: list[str]) -> None:
    """Profiled and run on CUDA (events, asynchronous launches, copies between devices), the
    pipeline equals the model run on the CPU: outputs, gradients, BatchNorm statistics. In
    float64, where the GPU's and the CPU's kernels agree to ~1e-15, so tight tolerances test
    the pipeline, not the kernels (in float32 conv1's gradient differed past 1e-3 on an H200:
    BatchNorm over micro-batches of 3 amplifies the kernels' rounding)."""
    model = torchvision.models.resnet18(num_classes=10).double()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 3, 32, 32, dtype=torch.float64)
    quick = ProfileOptions(microbatch_sizes=[3], warmup=1, repeats=1)
    pm = autosplit.partition(model, (x,), devices=devices,
                             options=PartitionOptions(profile=quick))
    assert [{str(p.device) for p in stage.parameters()} for stage in pm.stages] == [
        {d} for d in devices
    ]
    assert pm.plan is not None and pm.plan.split_size == 3
    assert_equivalent(model, pm, ref, (x,), 3, rtol=1e-6, atol=1e-8, check_device=False)
