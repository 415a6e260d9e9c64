"""Peak tensor memory on a CPU (torch's profiler) and the profile's memory figures built on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autosplit
from autosplit import ProfileOptions
from autosplit.cost import block_transient_bytes
from autosplit.errors import InvalidInputError
from autosplit.measure.peak_memory import change_during, rise_during, tensor_bytes

MB = 10**6


def test_the_highest_level_above_the_start_and_what_is_left() -> None:
    def work() -> torch.Tensor:
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del a  # 2 MB now
        c = torch.empty(8 * MB, dtype=torch.uint8)  # 10 MB: the peak
        del b
        return c  # 8 MB left

    result, (peak, net) = change_during(work)
    assert result.numel() == 8 * MB
    assert peak == 10 * MB
    assert net == 8 * MB
    # two float32 ones (4 MB each) and their sum (4 MB) at once
    assert rise_during(lambda: torch.ones(MB) + torch.ones(MB))[1] == 12 * MB


def test_memory_allocated_before_is_not_counted() -> None:
    held = torch.empty(5 * MB, dtype=torch.uint8)
    _, rise = rise_during(lambda: held.add_(1))  # in place: nothing new but a scalar
    assert rise < 1000


def test_tensor_bytes_counts_each_storage_once() -> None:
    w = torch.zeros(1000)
    assert tensor_bytes([w, w[:10], None, w.view(10, 100)]) == 4000
    assert tensor_bytes([w, torch.zeros(10, dtype=torch.float64)]) == 4080


def test_an_unsupported_device_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="device"):
        rise_during(lambda: None, "meta")


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_the_profile_measures_each_blocks_peak_and_what_a_split_backward_holds() -> None:
    torch.manual_seed(0)
    profile = autosplit.profile(_Mlp(), torch.randn(16, 256),
                                options=ProfileOptions(microbatch_sizes=[4, 8], warmup=1,
                                                       repeats=3))
    assert profile.backward_split
    for k, _ in enumerate(profile.microbatch_sizes):
        for block in profile.blocks:
            assert block.peak_bytes is not None and block.split_held_bytes is not None
            # the gradients are held: a new weight gradient (256 × 256 floats) is allocated
            # before it is added to them
            assert block.peak_bytes[k] >= 256 * 256 * 4
            assert block_transient_bytes(block, k) == max(
                block.output_bytes[k], block.peak_bytes[k] - block.saved_bytes[k])
        # the weight pass of b and c reads their inputs and the gradient of their outputs
        for block in profile.blocks[1:]:
            assert block.split_held_bytes[k] >= block.output_bytes[k]


def test_without_a_measured_peak_the_transient_is_the_blocks_outputs() -> None:
    from synthetic import make_profile

    profile = make_profile([1, 2], [[1.0, 1.0]] * 3, batch_size=4)
    for block in profile.blocks:
        assert block.peak_bytes is None
        assert block_transient_bytes(block, 1) == block.output_bytes[1]


def test_a_stage_needs_a_blocks_peak_less_what_the_blocks_after_it_save() -> None:
    import dataclasses

    from synthetic import make_profile

    from autosplit.planner.problems import stage_transient_bytes, transient_bytes

    profile = make_profile([1], [[1.0]] * 3, batch_size=1)
    saved, peak = (10, 20, 30), (100, 25, 40)  # each block needs 90, 5, 10 beyond its own
    profile = dataclasses.replace(profile, blocks=tuple(
        dataclasses.replace(b, saved_bytes=(s,), peak_bytes=(q,), output_bytes=(1,))
        for b, s, q in zip(profile.blocks, saved, peak)))
    # block 0 runs while blocks 1 and 2 hold nothing of its micro-batch: 90 − (20 + 30)
    assert stage_transient_bytes(profile, 0, 0, 3) == 40
    assert stage_transient_bytes(profile, 0, 1, 3) == 10  # block 2's, with nothing after it
    assert stage_transient_bytes(profile, 0, 0, 1) == 90
    assert transient_bytes(profile, 0) == 90  # whatever the cuts: the most any block needs
