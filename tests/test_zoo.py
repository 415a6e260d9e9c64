"""Models nobody here wrote enter unchanged: keyword inputs, their own output types and losses,
their repeated layers as blocks; split on 2 and 4 stages they equal the unsplit model on the
same micro-batches (outputs in the model's own type, every parameter gradient)."""

from __future__ import annotations

import copy

import pytest
import torch
from synthetic import even_balance, plan_of
from zoo import ZOO, build
from zoo_checks import assert_trains_like, reference

import autosplit
from autosplit import ProfileOptions
from autosplit.capture.exported import hf_defaults
from autosplit.capture.trace import trace
from autosplit.estimate.options import EstimateOptions

pytest.importorskip("transformers")
pytest.importorskip("timm")

ROWS, SPLIT = 4, 2


@pytest.mark.parametrize("name", list(ZOO))
def test_the_repeated_layers_are_the_blocks(name: str) -> None:
    model, call = build(name)
    args, kwargs = call(ROWS)
    graph = trace(model, example_inputs=args, example_kwargs=kwargs)
    layers = {"hf-gpt2": "transformer.h.", "hf-llama": "model.layers.", "hf-bert":
              "bert.encoder.layer.", "hf-albert": "albert.encoder.albert_layer_groups.0",
              "hf-t5": ("encoder.block.", "decoder.block."), "hf-vit": ("vit.layers.", "vit.encoder.layer."),
              "timm-vit": "blocks.", "timm-efficientnet": "blocks.",
              "timm-efficientvit": "stages.", "tv-vit":
              "encoder.layers.encoder_layer_", "tv-segmentation": "backbone."}[name]
    assert sum(b.startswith(layers) for b in graph.block_names) >= 4, graph.block_names
    for cut in graph.cuts:  # only tensors cross: sizes are computed again past a cut
        assert all(graph.kinds[v] == "tensor" for v in cut.tensors), (cut, graph.block_names)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", list(ZOO))
def test_split_equals_the_unsplit_model(name: str, stages: int) -> None:
    model, call = build(name)
    ref_model = copy.deepcopy(model)
    args, kwargs = call(ROWS)
    graph = trace(model, example_inputs=args, example_kwargs=kwargs)
    plan = plan_of(graph, even_balance(len(graph.blocks), stages), SPLIT, ROWS // SPLIT)
    pm = autosplit.partition(model, args, kwargs, plan=plan, devices=["cpu"] * stages)
    assert pm.layout is not None and len(pm.layout.stages) == stages

    assert_trains_like(pm, model, ref_model, args, kwargs, SPLIT)


@pytest.mark.parametrize("name", ["timm-efficientnet", "timm-efficientvit", "hf-llama"])
def test_a_pickled_graph_keeps_its_nodes_and_computes_the_same(name: str) -> None:
    """The timing process receives the graph pickled: the same node names (a GraphModule
    pickled as code is traced again and renamed) and the same outputs, without the model."""
    import pickle

    model, call = build(name)
    args, kwargs = call(ROWS)
    graph = trace(model.eval(), example_inputs=args, example_kwargs=kwargs)
    copied = pickle.loads(pickle.dumps(graph))
    assert [n.name for n in copied.module.graph.nodes] == [n.name for n in graph.module.graph.nodes]
    assert copied.blocks == graph.blocks and copied.cuts == graph.cuts
    assert copied.capture is None or copied.capture.model is None
    flat = graph.signature.flatten(args, {**hf_defaults(model, kwargs), **kwargs})
    with torch.no_grad():
        torch.testing.assert_close(copied.module(*flat), graph.module(*flat))


def test_a_model_that_returns_its_loss_is_profiled_with_it() -> None:
    """Llama called with labels= returns its loss: the profile times that loss, not the MSE."""
    model, call = build("hf-llama")
    args, kwargs = call(ROWS)
    prof = autosplit.profile(model, args, kwargs,
                             options=ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1))
    assert prof.loss == "model"
    unlabelled = {k: v for k, v in kwargs.items() if k != "labels"}
    prof = autosplit.profile(model, args, unlabelled,
                             options=ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1))
    assert prof.loss == "mse"


def test_one_tensor_given_for_two_inputs_is_captured_as_two() -> None:
    """Captured from ``labels=input_ids`` (one tensor), the split Llama still embeds the ids
    and scores the labels when a later call gives them apart (labels masked with -100)."""
    model, call = build("hf-llama")
    ref_model = copy.deepcopy(model)
    args, kwargs = call(ROWS)
    assert kwargs["labels"] is kwargs["input_ids"]
    graph = trace(model, example_inputs=args, example_kwargs=kwargs)
    plan = plan_of(graph, even_balance(len(graph.blocks), 2), SPLIT, ROWS // SPLIT)
    pm = autosplit.partition(model, args, kwargs, plan=plan, devices=["cpu"] * 2)
    labels = (kwargs["input_ids"] + 1) % 64
    labels[:, :3] = -100
    other = {**kwargs, "labels": labels}
    got, want = pm(*args, **other), reference(ref_model, args, other, SPLIT)
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.logits, want.logits)


def test_fsdp2_is_planned_only_where_the_graph_calls_each_blocks_modules() -> None:
    """GPT-2, captured by torch.export, and timm's EfficientNet, whose BatchNormAct2d torch.fx
    traces through, estimated for 4 H100s: their profiles say FSDP2 has no module per block to
    gather in, and every layout's replicas are planned with DDP; torchvision's ResNet18, whose
    graph calls its blocks' modules, keeps FSDP2 among its modes."""
    from autosplit.estimate.analytic import count_costs, profile_from_costs
    from autosplit.planner import plan_layouts
    from autosplit.specs import get_spec

    spec = get_spec("h100-80gb")
    model, call = build("hf-gpt2")
    ids = call(8)[1]["input_ids"]
    exported = profile_from_costs(count_costs(model, (ids,),
                                              options=EstimateOptions(microbatch_sizes=[2])), spec)
    assert exported.fsdp_units is False
    modes = {m.mode for o in plan_layouts(exported, 4).options for m in o.modes}
    assert modes == {"ddp"}
    net, net_call = build("timm-efficientnet")
    (images,) = net_call(8)[0]
    assert not profile_from_costs(count_costs(net, (images,),
                                              options=EstimateOptions(microbatch_sizes=[2])),
                                  spec).fsdp_units
    import torchvision

    resnet = torchvision.models.resnet18(num_classes=10)
    traced = profile_from_costs(count_costs(resnet, (torch.randn(8, 3, 32, 32),),
                                            options=EstimateOptions(microbatch_sizes=[2])), spec)
    assert traced.fsdp_units is True
    assert "fsdp2" in {m.mode for o in plan_layouts(traced, 4).options for m in o.modes}
