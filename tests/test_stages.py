"""autosplit.stages: what each stage receives, sends and passes through; split / concat."""

from __future__ import annotations

import pytest
import torch
from models import LongSkip, TupleAcross, TwoInOut
from torch import nn

import autosplit
from autosplit.errors import InvalidInputError
from autosplit.graph import BlockGraph
from autosplit.stages import CutValueError, concat, run_stage, split, stage_layout


class SizeAcross(nn.Module):
    """``x.size(0)`` is taken in the first block and used in the last: the size is computed
    again on the last stage, from ``x``, which crosses the cuts instead."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        return self.c(self.b(self.a(x))).reshape(n, -1)


TUPLE_MESSAGE = (r"value 'chunk' \(a tuple from a\.chunk\(\)\) produced by block 'a' crosses the "
                 r"cut before stage 1 \(after block 'a'\): only tensors can cross stages")


def run_all(graph: BlockGraph, balance: tuple[int, ...], inputs: tuple) -> object:
    """Chain every stage of the layout in one process and build the output."""
    layout = stage_layout(graph, balance)
    values = inputs
    for spec in layout.stages:
        body = graph.extract(spec.first, spec.end)
        assert (body.inputs, body.outputs) == (spec.reads, spec.makes)
        values = run_stage(layout, spec.index, body.module, values)
    return layout.output.build(values)


def test_skip_crossing_two_cuts_is_passed_through() -> None:
    model = LongSkip()
    graph = autosplit.trace(model)  # inp, layers.0 … layers.3 (+ the add), norm, out
    layout = stage_layout(graph, (1, 2, 2, 2))
    skip = next(n for n in graph.module.graph.nodes if n.target == "inp").name
    # made on stage 0, passed through stage 1, read by the add on stage 2: two cuts
    assert [skip in s.receives for s in layout.stages] == [False, True, True, False]
    assert [skip in s.passes for s in layout.stages] == [False, True, False, False]
    assert [skip in s.sends for s in layout.stages] == [True, True, False, False]
    assert skip in layout.stages[2].reads and layout.stages[2].sources == (0, 1)
    assert layout.stages[3].sources == (2,)
    assert layout.stages[0].receives == graph.inputs and layout.stages[0].sources == (-1,)
    assert layout.balance == (1, 2, 2, 2) and layout.stage_of_block(4) == 2
    x = torch.randn(5, 6)
    model.eval()
    torch.testing.assert_close(run_all(graph, layout.balance, (x,)), model(x))


def test_two_inputs_and_a_tuple_with_a_dict_output() -> None:
    model = TwoInOut()
    graph = autosplit.trace(model, granularity="layer")
    layout = stage_layout(graph, (1, len(graph.blocks) - 1))
    # y is read by the second stage (b, and the sum in the last block): it crosses the cut
    assert layout.stages[0].receives == ("x", "y") and "y" in layout.stages[0].passes
    assert layout.stages[1].sources[layout.stages[1].receives.index("y")] == -1
    # ha, made on stage 0, is part of the output: it is sent all the way
    assert len(layout.output.names) == 3 and layout.output.names[0] in layout.stages[0].makes
    x, y = torch.randn(3, 4), torch.randn(3, 3)
    got, want = run_all(graph, layout.balance, (x, y)), model(x, y)
    torch.testing.assert_close(got, want)


def test_a_size_is_computed_again_past_a_cut() -> None:
    model = SizeAcross()
    graph = autosplit.trace(model)
    layout = stage_layout(graph, (1, 1, 1))
    assert not any("size" in s.sends for s in layout.stages)
    assert [("x" in s.sends) for s in layout.stages] == [True, True, False]  # x.size(0)'s source
    x = torch.randn(2, 4)
    torch.testing.assert_close(run_all(graph, (1, 1, 1), (x,)), model(x))


def test_a_non_tensor_crossing_a_cut_is_refused_naming_it() -> None:
    model = TupleAcross()
    graph = autosplit.trace(model)
    layout = stage_layout(graph, (1, 1, 1))
    assert [("chunk" in s.sends) for s in layout.stages] == [True, True, False]
    with pytest.raises(CutValueError, match=TUPLE_MESSAGE):
        run_all(graph, (1, 1, 1), (torch.randn(2, 4),))
    # with no cut between the tuple and its use, nothing crosses
    torch.testing.assert_close(run_all(graph, (3,), (torch.ones(2, 4),)), model(torch.ones(2, 4)))


def test_bad_balance_is_refused() -> None:
    graph = autosplit.trace(SizeAcross())
    for balance in [(1, 1), (0, 3), (2, 2), ()]:
        with pytest.raises(InvalidInputError, match="positive block counts per stage that sum"):
            stage_layout(graph, balance)


def test_split_and_concat() -> None:
    x, y = torch.arange(10.0).reshape(5, 2), {"t": torch.arange(5)}
    mbs = split((x, y, "flag"), 2)
    assert len(mbs) == 3 and mbs[2][0].shape == (1, 2) and mbs[1][2] == "flag"
    joined = concat([(a, b) for a, b, _ in mbs])
    torch.testing.assert_close(joined, (x, y))
    with pytest.raises(InvalidInputError, match="4 micro-batches of 2 = 8 rows"):
        split((x,), 2, count=4)
    with pytest.raises(InvalidInputError, match="different numbers of rows"):
        split((x, torch.zeros(4)), 2)
    with pytest.raises(InvalidInputError, match="0-dimensional"):
        concat([torch.tensor(1.0), torch.tensor(2.0)])
