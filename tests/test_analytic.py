"""Analytic profiles: meta-device counting, the roofline, device specs and calibration."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torchvision
from models import LongSkip, TokenModel, ToyModel, TwoInOut
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.errors import InvalidInputError, ModelMismatchError, RecordFileError
from autosplit.estimate.analytic import (
    analytic_profile,
    block_flops,
    build_on_meta,
    count_costs,
    profile_from_costs,
    to_meta,
)
from autosplit.estimate.options import EstimateOptions
from autosplit.records import Profile
from autosplit.specs import (
    KNOWN_DEVICES,
    DeviceSpec,
    calibrate,
    get_spec,
    load_spec,
    op_time_s,
)

ROOT = Path(__file__).resolve().parents[1]
GPT_FILE = ROOT / "examples" / "gpt.py"
GPT_7B = (32, 4096, 32, 128256, 2048)  # layers, width, heads, vocabulary, context


def _gpt_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_gpt_example", GPT_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------- FLOPs


def test_resnet50_forward_flops_match_the_published_count() -> None:
    # torchvision's model table: ResNet50 at 224×224 is 4.09 G multiply-adds = 8.18 GFLOP;
    # FlopCounterMode counts a multiply-add as 2 FLOPs.
    model = torchvision.models.resnet50()
    per_block = block_flops(model, torch.randn(1, 3, 224, 224))
    assert len(per_block) > 10
    assert sum(per_block) == pytest.approx(8.18e9, rel=0.02)
    # backward is about twice forward (block 0 also computes the input's gradient, as the
    # measured profiler does)
    backward = block_flops(model, torch.randn(1, 3, 224, 224), backward=True)
    assert 1.9 <= sum(backward) / sum(per_block) <= 2.1


def test_block_flops_sum_to_the_whole_model_count() -> None:
    gpt = _gpt_module()
    model = gpt.build_model("small")
    (ids,) = gpt.example_inputs(4)
    meta = to_meta(model)
    # the whole model at once, as it runs on meta (math attention)
    with FlopCounterMode(display=False) as whole:
        meta(ids.to("meta"))
    for attention in ("math", "flash"):
        costs = count_costs(model, (ids,),
                            options=EstimateOptions(microbatch_sizes=[4], attention=attention))
        assert sum(f for f, _ in costs.flops(4)) == whole.get_total_flops()
    # the model itself is untouched: still on the CPU, still real values
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_flops_and_bytes_scale_with_the_microbatch() -> None:
    costs = count_costs(LongSkip(), torch.randn(8, 6),
                        options=EstimateOptions(microbatch_sizes=[2, 8]))
    for (f2, b2), (f8, b8) in zip(costs.flops(2), costs.flops(8)):
        assert f8 == 4 * f2 and b8 == 4 * b2
    for c2, c8 in zip(costs.at(2), costs.at(8)):
        assert c8.output_bytes == 4 * c2.output_bytes
        assert c8.fwd_bytes > c2.fwd_bytes  # activations grow, parameter reads do not


@pytest.mark.parametrize(
    "model, inputs",
    [
        (ToyModel(), (torch.randn(8, 10),)),
        (LongSkip(), (torch.randn(8, 6),)),
        (TwoInOut(), (torch.randn(8, 4), torch.randn(8, 3))),
        (TokenModel(), (torch.randint(0, 17, (8, 5)),)),
        (torchvision.models.resnet18(), (torch.randn(4, 3, 32, 32),)),
    ],
    ids=["toy", "long-skip", "two-in-out", "tokens", "resnet18"],
)
def test_memory_figures_equal_the_measured_profile(model: nn.Module, inputs: tuple) -> None:
    # bytes from shapes alone are the bytes the profiler measures on the CPU. Saved bytes are
    # compared as the block's total (own + shared with the producer of its inputs): the
    # measured profiler recognises shared storages by address, which a freed storage's
    # successor can reuse, so its split between the two can vary from run to run.
    measured = autosplit.profile(model, inputs,
                                 options=ProfileOptions(microbatch_sizes=[2, 4], warmup=0,
                                                        repeats=1))
    costs = count_costs(model, inputs, options=EstimateOptions(microbatch_sizes=[2, 4]))
    assert costs.fingerprint == measured.fingerprint
    assert costs.block_names == measured.block_names
    assert list(costs.param_bytes) == [b.param_bytes for b in measured.blocks]
    assert list(costs.buffer_bytes) == [b.buffer_bytes for b in measured.blocks]
    for k, b in enumerate((2, 4)):
        for blk, cost in zip(measured.blocks, costs.at(b)):
            shared = (blk.saved_shared_bytes or (0,) * 2)[k]
            total = cost.saved_bytes + cost.saved_shared_bytes
            assert total == blk.saved_bytes[k] + shared, blk.name
            assert cost.output_bytes == blk.output_bytes[k], blk.name
        assert [c[k] for c in costs.cut_bytes] == [cut.bytes[k] for cut in measured.cuts]


def test_fused_attention_keeps_no_attention_matrix() -> None:
    gpt = _gpt_module()
    model = gpt.GPT(1, 32, 8, 100, 512)
    ids = torch.zeros(2, 512, dtype=torch.long)
    flash = count_costs(model, (ids,),
                        options=EstimateOptions(microbatch_sizes=[2], attention="flash"))
    math_ = count_costs(model, (ids,),
                        options=EstimateOptions(microbatch_sizes=[2], attention="math"))
    i = flash.block_names.index("blocks.0")
    matrix = 2 * 8 * 512 * 512 * 4  # b · h · t² float32
    assert math_.at(2)[i].saved_bytes - flash.at(2)[i].saved_bytes >= 0.9 * matrix
    assert flash.at(2)[i].saved_bytes < matrix / 4
    assert flash.at(2)[i].fwd_flops == math_.at(2)[i].fwd_flops


# ----------------------------------------------------------------------- meta construction


def test_build_on_meta_allocates_nothing_and_moves_explicit_devices() -> None:
    model = build_on_meta(lambda: nn.Sequential(nn.Linear(4, 4, device="cpu"), nn.BatchNorm1d(4)))
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    gpt = build_on_meta(_gpt_module().GPT, 2, 32, 2, 64, 16)
    assert all(p.is_meta for p in gpt.parameters())
    with pytest.raises(InvalidInputError, match="not a torch.nn.Module"):
        build_on_meta(lambda: 3)
    with pytest.raises(InvalidInputError, match="meta device failed"):
        build_on_meta(lambda: (_ for _ in ()).throw(FileNotFoundError("weights.pt")))


def test_to_meta_shares_tied_weights_and_casts() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids))

    model = Tied()
    meta = to_meta(model, torch.bfloat16)
    assert meta.head.weight is meta.emb.weight and meta.emb.weight.dtype == torch.bfloat16
    assert model.emb.weight.dtype == torch.float32 and not model.emb.weight.is_meta


def test_data_dependent_block_names_itself() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.out = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return self.out(h[h > 0].reshape(-1, 4))

    with pytest.raises(InvalidInputError, match="cannot run on the meta device"):
        count_costs(Masked(), torch.randn(4, 4), options=EstimateOptions(microbatch_sizes=[4]))


# ------------------------------------------------------------------------ analytic profile


def test_analytic_profile_is_an_ordinary_profile(tmp_path: Path) -> None:
    spec = get_spec("h100-80gb")
    prof = analytic_profile(LongSkip(), torch.randn(8, 6), spec,
                            options=EstimateOptions(microbatch_sizes=[2, 4, 8]))
    assert prof.source == "analytic"
    assert prof.describe().startswith("analytic on h100-80gb (efficiency 0.50")
    assert prof.device.kind == "cuda" and prof.device.memory_bytes == spec.memory_bytes
    assert all(b.fwd_ms[k] > 0 and b.bwd_ms[k] > 0 for b in prof.blocks for k in range(3))
    path = tmp_path / "analytic.json"
    prof.save(path)
    assert Profile.load(path) == prof
    plan = autosplit.plan(prof, 2)
    assert plan.profile.startswith("analytic on h100-80gb")
    assert [s.device for s in plan.stages] == ["cuda:0", "cuda:1"]


def test_roofline_and_dtype() -> None:
    spec = get_spec("a100-80gb")
    # compute-bound: time is FLOPs over the efficient peak; memory-bound: bytes over bandwidth
    assert op_time_s(312e12, 1, spec, "bf16") == pytest.approx(1 / spec.efficiency)
    memory_bound = op_time_s(1, 2039e9, spec, "torch.bfloat16")
    assert memory_bound == pytest.approx(1 / spec.bandwidth_efficiency)
    assert op_time_s(19.5e12, 1, spec, "torch.float32") == pytest.approx(1 / spec.efficiency)
    model = TokenModel(vocab=50, width=256, depth=2)
    ids = torch.randint(0, 50, (64, 32))
    fp32 = count_costs(model, ids, options=EstimateOptions(microbatch_sizes=[64]))
    bf16 = count_costs(model, ids,
                       options=EstimateOptions(microbatch_sizes=[64], dtype=torch.bfloat16))
    assert fp32.dtype == "torch.float32" and bf16.dtype == "torch.bfloat16"
    assert [2 * b for b in bf16.param_bytes] == list(fp32.param_bytes)
    assert fp32.flops(64) == bf16.flops(64)
    t32 = sum(b.fwd_ms[0] for b in profile_from_costs(fp32, spec).blocks)
    t16 = sum(b.fwd_ms[0] for b in profile_from_costs(bf16, spec).blocks)
    assert t16 < t32 / 2  # Tensor Cores (16× the fp32 peak) and half the bytes


_SEVEN_B = textwrap.dedent(
    """
    import dataclasses, importlib.util, json, resource, sys, time
    import torch
    import autosplit
    from autosplit.estimate.analytic import analytic_profile, build_on_meta
    from autosplit.estimate.options import EstimateOptions
    from autosplit.specs import get_spec
    spec_ = importlib.util.spec_from_file_location("gpt", sys.argv[1])
    gpt = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(gpt)
    def rss_kib():  # resident now (the high-water mark would hide growth below import peaks)
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    base = rss_kib()
    start = time.perf_counter()
    model = build_on_meta(gpt.GPT, *json.loads(sys.argv[2]))
    params = sum(p.numel() for p in model.parameters())
    spec = get_spec("h100-80gb")
    ids = torch.zeros(8, 2048, dtype=torch.long)
    prof = analytic_profile(model, ids, spec, options=EstimateOptions(stages=8))
    options = autosplit.PlanOptions(memory_per_gpu=spec.memory_bytes, optimizer="adam")
    plan = autosplit.plan(prof, 8, dataclasses.replace(
        options, devices=[f"h100-80gb:{s}" for s in range(8)],
        bandwidth_bytes_per_s=spec.link_bandwidth_bytes_per_s))
    try:
        autosplit.plan(prof, 1, options)
        one = None
    except autosplit.InfeasiblePlanError as exc:
        one = exc.min_capacity_bytes
    print(json.dumps({
        "params": params,
        "seconds": time.perf_counter() - start,
        "rss_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024,
        "stage_memory": [s.memory_bytes for s in plan.stages],
        "param_bytes": sum(b.param_bytes for b in prof.blocks),
        "one_device_bytes": one,
        "profile": plan.profile,
    }))
    """
)


@pytest.mark.long
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_seven_billion_gpt_plans_on_meta_within_two_gib() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SEVEN_B, str(GPT_FILE), json.dumps(GPT_7B)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["params"] >= 7e9
    assert out["rss_growth_bytes"] < 2 * 2**30
    assert out["param_bytes"] == 4 * out["params"]  # fp32 weights, counted from shapes
    # weights + gradients + Adam's two moments: 16 bytes a parameter, spread over the 8 stages
    assert len(out["stage_memory"]) == 8
    assert sum(out["stage_memory"]) >= 16 * out["params"]
    assert max(out["stage_memory"]) <= 80e9
    # one device cannot hold it, and the error says how much it would need
    assert out["one_device_bytes"] is not None
    assert out["one_device_bytes"] > 16 * out["params"] > 80e9
    assert out["profile"].startswith("analytic on h100-80gb")


# ------------------------------------------------------------------------------------ specs


def test_known_devices_and_bad_names() -> None:
    named = {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "rtx-4090", "cpu-core"}
    assert named <= set(KNOWN_DEVICES)
    for spec in KNOWN_DEVICES.values():
        assert spec.peak_bf16_flops_per_s >= spec.peak_fp32_flops_per_s
        assert spec.source
    assert "NOMINAL" in get_spec("cpu-core").source and get_spec("cpu-core").kind == "cpu"
    assert get_spec("H100_80GB") is KNOWN_DEVICES["h100-80gb"]
    with pytest.raises(InvalidInputError) as info:
        get_spec("h100")
    for name in KNOWN_DEVICES:
        assert name in str(info.value)


def test_spec_file_round_trip_and_errors(tmp_path: Path) -> None:
    spec = dataclasses.replace(get_spec("l4"), name="my-l4", efficiency=0.4)
    path = tmp_path / "spec.json"
    spec.save(path)
    assert load_spec(path) == spec

    data = json.loads(path.read_text())
    del data["memory_bandwidth_bytes_per_s"]
    path.write_text(json.dumps(data))
    with pytest.raises(RecordFileError, match="missing the field memory_bandwidth_bytes_per_s"):
        load_spec(path)

    data = spec.to_dict() | {"tflops": 1}
    path.write_text(json.dumps(data))
    with pytest.raises(RecordFileError, match="unknown field tflops"):
        load_spec(path)

    optional = ("source", "efficiency", "bandwidth_efficiency", "kind")
    minimal = {k: v for k, v in spec.to_dict().items() if k not in optional}
    path.write_text(json.dumps(minimal))
    loaded = load_spec(path)
    assert loaded.efficiency == 0.5 and str(path) in loaded.source

    path.write_text(json.dumps(spec.to_dict() | {"memory_bytes": -1}))
    with pytest.raises(InvalidInputError, match="memory_bytes must be a finite number > 0"):
        load_spec(path)
    with pytest.raises(RecordFileError, match="does not exist"):
        load_spec(tmp_path / "absent.json")


# ------------------------------------------------------------------------------ calibration


def _scaled(profile: Profile, times: list[list[float]]) -> Profile:
    """``profile`` with block times replaced by ``times[i][k]`` split as 1 : 2 forward/backward."""
    blocks = tuple(
        dataclasses.replace(
            b, fwd_ms=tuple(t / 3 for t in times[i]), bwd_ms=tuple(2 * t / 3 for t in times[i])
        )
        for i, b in enumerate(profile.blocks)
    )
    return dataclasses.replace(profile, blocks=blocks, source="measured")


def test_calibrate_recovers_known_efficiencies() -> None:
    model = torchvision.models.resnet18()
    costs = count_costs(model, torch.randn(8, 3, 32, 32),
                        options=EstimateOptions(microbatch_sizes=[4, 8]))
    nominal = get_spec("h100-80gb")
    truth = dataclasses.replace(nominal, efficiency=0.3, bandwidth_efficiency=0.55)
    true_prof = profile_from_costs(costs, truth)
    times = [[b.fwd_ms[k] + b.bwd_ms[k] for k in range(2)] for b in true_prof.blocks]
    measured = _scaled(true_prof, times)

    # from the counted costs both efficiencies are identified
    fitted = calibrate(nominal, measured, costs)
    assert fitted.efficiency == pytest.approx(0.3, rel=0.02)
    assert fitted.bandwidth_efficiency == pytest.approx(0.55, rel=0.02)
    assert "calibrated on ResNet" in fitted.source and fitted.name == nominal.name

    # from an analytic profile, one factor: exact when the truth differs by one factor
    measured_2x = _scaled(true_prof, [[2 * t for t in row] for row in times])
    one = calibrate(truth, measured_2x, true_prof)
    assert one.efficiency == pytest.approx(0.15)
    assert one.bandwidth_efficiency == pytest.approx(0.275)
    again = profile_from_costs(costs, one)
    for b, m in zip(again.blocks, measured_2x.blocks):
        assert b.fwd_ms[1] + b.bwd_ms[1] == pytest.approx(m.fwd_ms[1] + m.bwd_ms[1], rel=1e-9)


def test_calibrate_recovers_a_floor_per_operator() -> None:
    """A device that small operators leave idle: every operator takes at least 20 µs. The
    efficiencies alone cannot follow it; fitted with the floor, the blocks come back."""
    model = torchvision.models.resnet18()
    costs = count_costs(model, torch.randn(16, 3, 32, 32),
                        options=EstimateOptions(microbatch_sizes=[2, 8, 16]))
    nominal = get_spec("h200")
    truth = dataclasses.replace(nominal, efficiency=0.3, bandwidth_efficiency=0.4,
                                op_overhead_s=20e-6)
    true_prof = profile_from_costs(costs, truth)
    measured = _scaled(true_prof, [[b.fwd_ms[k] + b.bwd_ms[k] for k in range(3)]
                                   for b in true_prof.blocks])

    def worst(spec: DeviceSpec) -> float:
        again = profile_from_costs(costs, spec)
        return max(abs((a.fwd_ms[k] + a.bwd_ms[k]) / (m.fwd_ms[k] + m.bwd_ms[k]) - 1)
                   for a, m in zip(again.blocks, measured.blocks) for k in range(3))

    floorless = calibrate(nominal, measured, costs, fit_overhead=False)
    assert floorless.op_overhead_s == 0.0 and worst(floorless) > 0.3
    fitted = calibrate(nominal, measured, costs)
    assert fitted.op_overhead_s == pytest.approx(20e-6, rel=0.05)
    assert worst(fitted) < 0.05
    assert "floor of 20" in fitted.source and "at least 20" in fitted.label()
    # a spec's own floor is kept when the fit is told not to touch it
    kept = calibrate(truth, measured, costs, fit_overhead=False)
    assert kept.op_overhead_s == truth.op_overhead_s and worst(kept) < 0.05
    # without a floor in the truth, none is fitted in (the efficiencies alone are exact)
    plain = profile_from_costs(costs, dataclasses.replace(truth, op_overhead_s=0.0))
    exact = calibrate(nominal, _scaled(plain, [[b.fwd_ms[k] + b.bwd_ms[k] for k in range(3)]
                                               for b in plain.blocks]), costs)
    assert exact.op_overhead_s == 0.0 and exact.efficiency == pytest.approx(0.3, rel=0.02)


def test_the_floor_per_operator_is_a_minimum_and_views_cost_nothing() -> None:
    spec = dataclasses.replace(get_spec("h200"), op_overhead_s=5e-6)
    assert op_time_s(0, 0, spec, "fp32") == 0.0  # a view launches no kernel
    assert op_time_s(1000, 1000, spec, "fp32") == 5e-6
    big = 1e15
    assert op_time_s(big, 0, spec, "fp32") == pytest.approx(
        big / (spec.peak_flops_per_s("fp32") * spec.efficiency))
    with pytest.raises(InvalidInputError, match="op_overhead_s"):
        dataclasses.replace(spec, op_overhead_s=-1e-6)


def test_calibrate_rejects_mismatches() -> None:
    spec = get_spec("cpu-core")
    a = analytic_profile(LongSkip(), torch.randn(8, 6), spec,
                         options=EstimateOptions(microbatch_sizes=[4]))
    b = analytic_profile(ToyModel(), torch.randn(8, 10), spec,
                         options=EstimateOptions(microbatch_sizes=[4]))
    with pytest.raises(ModelMismatchError, match="not of the same model"):
        calibrate(spec, b, a)
    c = analytic_profile(LongSkip(), torch.randn(8, 6), spec,
                         options=EstimateOptions(microbatch_sizes=[8]))
    with pytest.raises(InvalidInputError, match="micro-batch sizes"):
        calibrate(spec, c, a)
    with pytest.raises(InvalidInputError, match="not on the spec being calibrated"):
        calibrate(get_spec("l4"), a, a)


class Tower(nn.Module):
    """Matmul-heavy blocks of different sizes, so that block times differ by shape."""

    def __init__(self) -> None:
        super().__init__()
        widths = [512, 1024, 1024, 512, 768, 256]
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(w_in, w_out), nn.GELU())
            for w_in, w_out in zip([512, *widths[:-1]], widths)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_calibrated_cpu_core_predicts_measured_stage_times() -> None:
    # On a CPU the cost per sample jumps between micro-batch sizes, so each size is calibrated
    # on its own measurement; block times then differ only by shape, which the counts know.
    # The measurement is a committed profile of Tower (tests/fixtures/tower_profile.json, one
    # CPU worker of one thread, 7 repeats), so the outcome does not depend on this machine.
    model, x = Tower(), torch.randn(512, 512)
    measured = autosplit.Profile.load(Path(__file__).parent / "fixtures" / "tower_profile.json")
    costs = count_costs(model, x, options=EstimateOptions(microbatch_sizes=[256, 512]))
    nominal = get_spec("cpu-core")
    for k, b in enumerate(measured.microbatch_sizes):
        spec = calibrate(nominal, measured, costs, sizes=[b])
        assert spec.efficiency != nominal.efficiency and f"micro-batch sizes {b}" in spec.source
        analytic = profile_from_costs(costs, spec)
        assert analytic.fingerprint == measured.fingerprint
        meas = [blk.fwd_ms[k] + blk.bwd_ms[k] for blk in measured.blocks]
        pred = [blk.fwd_ms[k] + blk.bwd_ms[k] for blk in analytic.blocks]
        # each stage of the 2-stage plan made from the calibrated analytic profile, within 35 %
        # of the committed measurement (observed: within 15 %)
        plan = autosplit.plan(analytic, 2, options=PlanOptions(split_size=b))
        cut = len(plan.stages[0].blocks)
        for s, (lo, hi) in enumerate(((0, cut), (cut, len(meas)))):
            assert plan.stages[s].compute_ms == pytest.approx(math.fsum(pred[lo:hi]))
            assert math.fsum(pred[lo:hi]) == pytest.approx(math.fsum(meas[lo:hi]), rel=0.35)
