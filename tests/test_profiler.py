"""The profiler measures without changing the model, and its Profile round-trips exactly."""

from __future__ import annotations

import pytest
import torch
import torchvision
from models import LongSkip, TokenModel, ToyModel
from torch import nn

import autosplit
from autosplit import ProfileOptions
from autosplit.errors import InvalidInputError, PlanFileError
from autosplit.measure.budget import bracketing_count, default_microbatch_sizes


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.bn(self.lin(x))))


def _snapshot(model: nn.Module) -> dict[str, object]:
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "grads": {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()},
        "training": {k: m.training for k, m in model.named_modules()},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["training"] == b["training"]
    for kind in ("params", "buffers", "grads"):
        assert a[kind].keys() == b[kind].keys()
        for k in a[kind]:
            x, y = a[kind][k], b[kind][k]
            assert (x is None and y is None) or torch.equal(x, y), f"{kind} {k} changed"


@pytest.mark.parametrize("training", [True, False])
def test_profiling_leaves_the_model_bit_identical(training: bool) -> None:
    model = WithDropout()
    model(torch.randn(4, 6)).sum().backward()  # existing .grad must survive
    model.lin.weight.grad = None  # and a missing one must stay missing
    model.train(training)
    x = torch.randn(8, 6)
    before = _snapshot(model)
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    autosplit.profile(model, x,
                      options=ProfileOptions(microbatch_sizes=[2, 4], warmup=1, repeats=2))
    _assert_same(before, _snapshot(model))
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.get_num_threads() == threads


def test_profiling_resnet_keeps_batchnorm_statistics() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    before = _snapshot(model)
    autosplit.profile(model, torch.randn(4, 3, 32, 32),
                      options=ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1))
    _assert_same(before, _snapshot(model))


def test_profile_fields() -> None:
    model = LongSkip()
    prof = autosplit.profile(model, torch.randn(8, 6),
                             options=ProfileOptions(microbatch_sizes=[4, 2], warmup=0, repeats=1))
    assert prof.microbatch_sizes == (2, 4)
    assert prof.batch_size == 8 and prof.input_shapes == ((8, 6),)
    assert prof.device.kind == "cpu" and prof.device.threads == 1
    assert "1 thread" in prof.describe()
    assert prof.block_names == autosplit.trace(model).block_names
    inp = prof.blocks[0]
    assert inp.param_bytes == (8 * 6 + 8) * 4
    assert all(t >= 0 for b in prof.blocks for t in b.fwd_ms + b.bwd_ms)
    # outputs and crossing bytes are exact: the skip (8 floats/sample) crosses cuts 0–3
    assert inp.output_bytes == (2 * 8 * 4, 4 * 8 * 4)
    assert prof.cuts[0].bytes == (2 * 8 * 4, 4 * 8 * 4)
    assert prof.cuts[1].bytes == (2 * 2 * 8 * 4, 2 * 4 * 8 * 4)  # skip + current activation
    # saved-for-backward bytes grow with the micro-batch
    assert prof.blocks[1].saved_bytes[1] > prof.blocks[1].saved_bytes[0] > 0


def test_profile_json_round_trip_is_exact(tmp_path) -> None:
    prof = autosplit.profile(TokenModel(), torch.randint(0, 17, (4, 5)),
                             options=ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1))
    path = tmp_path / "profile.json"
    prof.save(path)
    assert autosplit.Profile.load(path) == prof


def test_profile_load_errors(tmp_path) -> None:
    with pytest.raises(PlanFileError, match="does not exist"):
        autosplit.Profile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        autosplit.Profile.load(bad)


def test_default_sizes_give_whole_micro_batches() -> None:
    sizes = default_microbatch_sizes(120, stages=2)
    assert all(120 % b == 0 for b in sizes)
    assert sizes[0] == 20  # m = 3·p first
    assert set(sizes) == {120, 60, 40, 30, 24, 20, 15}


def test_no_budget_keeps_the_sizes_nearest_3p_on_both_sides() -> None:
    """With nothing left of the budget, the size of m = 3·p micro-batches and the first sizes of
    fewer and of more are measured: the planner weighs the bubble from both sides."""
    assert default_microbatch_sizes(24, stages=2)[:4] == [4, 3, 6, 8]  # m = 6, 8, 4, 3
    assert bracketing_count([4, 3, 6, 8], 24, 2) == 3
    prof = autosplit.profile(ToyModel(), torch.randn(24, 10),
                             options=ProfileOptions(budget_s=0.0, warmup=0, repeats=1))
    assert list(prof.microbatch_sizes) == [3, 4, 6]
    # m = 3·p comes first; without it, the two sides; with one side only, that side
    assert bracketing_count([20, 24, 15, 30], 120, 2) == 3
    assert bracketing_count([8, 16, 32], 64, 2) == 2
    assert bracketing_count([24, 30, 15], 120, 2) == 3
    assert bracketing_count([60, 120], 120, 2) == 1
    assert bracketing_count([1], 1, 2) == 1


@pytest.mark.parametrize(
    "inputs, match",
    [
        (("not a tensor",), "not a tensor"),
        ((torch.randn(4, 7),), r"\(4, 7\)"),
        ((torch.tensor(1.0),), "0-dimensional"),
        ((torch.randn(4, 10), torch.randn(3, 10)), r"\[4, 3\]"),
    ],
)
def test_bad_example_inputs(inputs: tuple, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        autosplit.profile(ToyModel(), inputs,
                          options=ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1))


def test_bad_microbatch_size() -> None:
    with pytest.raises(InvalidInputError, match="between 1 and the batch size 4"):
        autosplit.profile(ToyModel(), torch.randn(4, 10),
                          options=ProfileOptions(microbatch_sizes=[8]))


def test_repeated_microbatch_sizes_are_named() -> None:
    with pytest.raises(InvalidInputError, match=r"repeat: \[2, 2\]"):
        autosplit.profile(ToyModel(), torch.randn(4, 10),
                          options=ProfileOptions(microbatch_sizes=[2, 2]))


@pytest.mark.cuda
def test_cuda_profile_uses_events_and_records_peak_memory() -> None:
    """On cuda:0 the model (on the CPU) is copied, timed with CUDA events, and left unchanged;
    every block gets a peak memory, larger for the larger micro-batch."""
    model = torchvision.models.resnet18(num_classes=10)
    before = _snapshot(model)
    prof = autosplit.profile(model, torch.randn(8, 3, 32, 32), device="cuda:0",
                             options=ProfileOptions(microbatch_sizes=[4, 8], warmup=1, repeats=2))
    _assert_same(_snapshot(model), before)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert prof.device.kind == "cuda" and prof.device.memory_bytes and prof.device.memory_bytes > 0
    assert prof.device.name == torch.cuda.get_device_name(0)
    for block in prof.blocks:
        assert block.peak_bytes is not None and all(v >= 0 for v in block.peak_bytes)
        assert all(t > 0 for t in block.fwd_ms)
    peaks = [sum(block.peak_bytes[k] for block in prof.blocks) for k in range(2)]
    assert 0 < peaks[0] < peaks[1]


@pytest.mark.cuda
@pytest.mark.parametrize("src, dst", [("cuda:0", "cuda:0"), ("cpu", "cuda:0"), ("cuda:0", "cpu")])
def test_cuda_link_bandwidth_is_measured(src: str, dst: str) -> None:
    """Copies to, from and within one GPU are timed with CUDA events (two GPUs: peer copies)."""
    from autosplit.devices import measure_link_bandwidth

    bandwidth = measure_link_bandwidth(src, dst, nbytes=2**20, repeats=3)
    assert 0 < bandwidth < float("inf")


def test_the_last_block_is_timed_with_the_loss(monkeypatch) -> None:
    from autosplit.measure import block_timing

    model = LongSkip()
    n = len(autosplit.trace(model).blocks)
    calls: list[tuple[int, bool]] = []
    real = block_timing.timed_run

    def recording(seg, args, dev, hooks=None, loss=None):
        calls.append((seg.first, loss is not None))
        return real(seg, args, dev, hooks, loss)

    monkeypatch.setattr(block_timing, "timed_run", recording)
    prof = autosplit.profile(model, torch.randn(8, 6),
                             options=ProfileOptions(microbatch_sizes=[4], warmup=0, repeats=1))
    assert prof.loss == "mse"
    assert {first for first, with_loss in calls if with_loss} == {n - 1}
    assert {first for first, _ in calls} == set(range(n))
    calls.clear()
    prof = autosplit.profile(model, torch.randn(8, 6),
                             options=ProfileOptions(microbatch_sizes=[4], warmup=0, repeats=1,
                                                    loss="none"))
    assert prof.loss == "none" and not any(with_loss for _, with_loss in calls)
    with pytest.raises(InvalidInputError, match="loss must be one of 'mse', 'none', 'model', got 'l1'"):
        autosplit.profile(model, torch.randn(8, 6), options=ProfileOptions(loss="l1"))
    with pytest.raises(InvalidInputError, match="loss='model', but .* returns no loss"):
        autosplit.profile(model, torch.randn(8, 6), options=ProfileOptions(loss="model"))


def test_the_timed_loss_is_the_tutorial_loss_on_zero_targets() -> None:
    from autosplit.measure.losses import timing_loss, tutorial_loss

    out = (torch.randn(4, 3, requires_grad=True), torch.arange(4), torch.randn(4))
    expected = tutorial_loss(out, (torch.zeros(4, 3), torch.zeros(4)))
    torch.testing.assert_close(timing_loss("mse")(out), expected)
    assert timing_loss("none") is None
