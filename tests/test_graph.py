"""Tracing into blocks, crossing tensors, and the fallback for untraceable models."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from conftest import partition_and_check
from models import Branching, DataDependent, InOrder, TwoInOut
from torch import nn

import autosplit
from autosplit.errors import InvalidInputError, TraceError


def test_resnet50_blocks_are_stem_bottlenecks_and_head() -> None:
    graph = autosplit.trace(torchvision.models.resnet50())
    names = graph.block_names
    assert names[:2] == ("conv1", "bn1")
    assert names[-1] == "fc"
    bottlenecks = [n for n in names if n.startswith("layer")]
    assert len(bottlenecks) == 16 and len(names) == 19
    assert len(graph.cuts) == 18
    # the finer granularity gives one block per leaf module
    assert len(autosplit.trace(torchvision.models.resnet50(), granularity="layer").blocks) > 100


def test_every_parameter_is_owned_by_exactly_one_block() -> None:
    model = torchvision.models.resnet18()
    graph = autosplit.trace(model)
    owned = [name for block in graph.blocks for name, _ in block.params]
    assert sorted(owned) == sorted(name for name, _ in model.named_parameters())


def test_cut_tensors_include_model_inputs_and_early_outputs() -> None:
    graph = autosplit.trace(TwoInOut())
    # y (second input) is read by the last block, so it crosses every cut; ha is returned
    assert all("y" in cut.tensors for cut in graph.cuts)
    assert all("a" in cut.tensors for cut in graph.cuts)


def test_networkx_view_has_block_indices() -> None:
    graph = autosplit.trace(TwoInOut())
    g = graph.to_networkx()
    assert g.nodes["x"]["block"] == -1
    assert g.nodes["output"]["block"] == len(graph.blocks)
    assert g.has_edge("a", "add")


def test_segments_share_modules() -> None:
    model = torchvision.models.resnet18()
    seg = autosplit.trace(model).extract(0, 3)
    assert seg.module.conv1 is model.conv1
    assert seg.inputs == ("x",)


def test_trace_does_not_change_the_model() -> None:
    model = torchvision.models.resnet18()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    autosplit.trace(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_sequential_with_untraceable_child_falls_back_with_a_warning() -> None:
    model = nn.Sequential(nn.Linear(6, 6), DataDependent(), nn.Linear(6, 2))
    with pytest.warns(UserWarning, match="top-level children"):
        graph = autosplit.trace(model)
    assert graph.block_names == ("0", "1", "2") and not graph.traced
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        partition_and_check(model, (torch.randn(6, 6),), 3, 2)


def test_children_called_in_order_fall_back() -> None:
    x = torch.randn(4, 6)
    with pytest.warns(UserWarning, match="top-level children"):
        graph = autosplit.trace(InOrder(), example_inputs=(x,))
    assert graph.block_names == ("first", "middle", "last")


def test_untraceable_branching_model_raises_trace_error_with_a_fix() -> None:
    with pytest.raises(TraceError, match="leaf_modules") as info:
        autosplit.trace(Branching(), example_inputs=(torch.randn(4, 6),))
    assert "Branching" in str(info.value)


def test_a_model_neither_front_end_captures_gets_one_line(capfd: pytest.CaptureFixture[str]
                                                         ) -> None:
    """Both torch.fx and torch.export fail on a data-dependent branch: one message that names
    both and an option the command line has; torch prints nothing of its own."""
    with pytest.raises(TraceError) as info:
        autosplit.trace(Branching(), example_inputs=(torch.randn(4, 6),))
    message = str(info.value)
    assert "torch.export cannot capture Branching" in message and "torch.fx" in message
    assert "--leaf-modules NAME" in message and "\n" not in message
    assert "def forward" not in capfd.readouterr().err


class LossOnData(nn.Module):
    """Computes its loss only over the labels that are set (DeBERTa's ``nonzero`` branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.layers(x)
        if labels is None:
            return logits
        chosen = (labels >= 0).nonzero()
        if chosen.size(0) > 0:
            return nn.functional.cross_entropy(logits[chosen[:, 0]], labels[chosen[:, 0]])
        return logits.sum() * 0


def test_a_branch_on_data_in_the_models_loss_is_named_with_what_to_do() -> None:
    """torch.export cannot capture a branch on data: the message shows the line, and, where
    it is the loss the labels ask for, says to leave them out and plan with --loss mse."""
    call = {"x": torch.randn(4, 6), "labels": torch.tensor([0, 1, -1, 2])}
    with pytest.raises(TraceError) as info:
        autosplit.trace(LossOnData(), example_kwargs=call)
    message = str(info.value)
    assert "`if chosen.size(0) > 0:`" in message and "\n" not in message
    assert "leave labels out" in message and "--loss mse" in message
    assert len(autosplit.trace(LossOnData(), example_kwargs={"x": call["x"]}).blocks) == 2


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Siamese(nn.Module):
    """One backbone called on two inputs: its layers are blocks for each call."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*(Layer() for _ in range(3)))
        self.head = nn.Linear(12, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.backbone(a), self.backbone(b)], 1))


@pytest.mark.parametrize("keywords", [False, True])
def test_a_backbone_called_twice_keeps_its_layers_as_blocks(keywords: bool) -> None:
    """A layer called again (ALBERT's) is a block per call, but a module called again that
    holds a layer stack (a siamese backbone) keeps its layers as blocks, for each call."""
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    graph = (autosplit.trace(Siamese(), example_kwargs={"a": a, "b": b}) if keywords
             else autosplit.trace(Siamese(), example_inputs=(a, b)))
    assert graph.block_names == ("backbone.0", "backbone.1", "backbone.2", "backbone.0#2",
                                 "backbone.1#2", "backbone.2#2", "head")


class NumberedStage(nn.Module):
    """Holds its layers as attributes ``b1``, ``b2``, ``b3`` (timm's RegStage), and a pair of
    branches (ShuffleNet's ``branch1``, ``branch2``: containers) that are not a stack."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(1, 4):
            self.add_module(f"b{i}", Layer())


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branch1 = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.branch2 = nn.Sequential(nn.Linear(6, 6), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.branch1(x) + self.branch2(x)


class Numbered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.s1, self.mix, self.head = Layer(), NumberedStage(), Branches(), Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.s1.b1, self.s1.b2, self.s1.b3):
            x = layer(x)
        return self.head(self.mix(self.stem(x)))


def test_layers_numbered_under_one_name_are_a_stack() -> None:
    graph = autosplit.trace(Numbered(), example_inputs=(torch.randn(4, 6),))
    assert graph.block_names == ("s1.b1", "s1.b2", "s1.b3", "stem", "mix", "head")


class Contrastive(nn.Module):
    """A loss over the whole batch whose targets are ``arange(len(logits))`` (CLIP's):
    torch.export fixes the batch size there."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.embed = nn.BatchNorm1d(6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, return_loss: bool = False) -> torch.Tensor:
        z = self.embed(self.norm(x))
        logits = z @ z.T
        if not return_loss:
            return logits
        return nn.functional.cross_entropy(logits, torch.arange(len(logits)))


def test_a_batch_size_export_fixes_is_refused_with_its_line() -> None:
    """The capture runs once on other rows: a graph that only runs on the captured batch is
    refused (naming the line and what to leave out), and the model's buffers stay as they
    were (BatchNorm's running statistics)."""
    model = Contrastive()
    before = model.norm.running_mean.clone()
    with pytest.raises(TraceError) as info:
        autosplit.trace(model, example_kwargs={"x": torch.randn(4, 6), "return_loss": True})
    message = str(info.value)
    assert "on 4 rows fails on 2" in message and "arange(len(logits))" in message
    assert "leave out the input that asks for it" in message and "\n" not in message
    torch.testing.assert_close(model.norm.running_mean, before)
    graph = autosplit.trace(model, example_kwargs={"x": torch.randn(4, 6)})
    torch.testing.assert_close(model.norm.running_mean, before)
    assert len(graph.blocks) == 2


class ThroughNumpy(nn.Module):
    """Leaves torch for numpy halfway: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        middle = torch.from_numpy(self.first(x).detach().numpy())
        return self.second(middle) * scale


def test_a_keyword_call_export_cannot_capture_points_to_a_positional_one() -> None:
    """torch.fx takes positional calls only: the message says so, and names --leaf-modules."""
    call = {"x": torch.randn(2, 4), "scale": torch.ones(2, 1)}
    with pytest.raises(TraceError) as info:
        autosplit.trace(ThroughNumpy(), example_kwargs=call)
    message = str(info.value)
    assert "torch.export cannot capture ThroughNumpy" in message and "\n" not in message
    assert "called with positional inputs only" in message and "--leaf-modules NAME" in message


def test_leaf_modules_make_an_untraceable_model_traceable() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph = autosplit.trace(Branching(), leaf_modules=[DataDependent])
    assert graph.traced and graph.block_names == ("left", "right")


def test_empty_model_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="empty model"):
        autosplit.trace(nn.Sequential())


def test_non_module_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="torch.nn.Module"):
        autosplit.trace(lambda x: x)  # type: ignore[arg-type]
