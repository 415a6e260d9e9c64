"""Every public function names its bad arguments: a wrong type is an ArgumentTypeError (also a
TypeError), a wrong value an InvalidInputError (also a ValueError), and the message names the
argument. Tiny models and synthetic profiles only: each call fails before any real work."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import ToyModel
from synthetic import make_profile

import autosplit
from autosplit import (
    PartitionOptions,
    PlanOptions,
    ProfileOptions,
    comparison,
    planner,
    simulator,
    solve,
    specs,
)
from autosplit.errors import ArgumentTypeError, InvalidInputError
from autosplit.estimate import analytic
from autosplit.estimate.options import EstimateOptions
from autosplit.launch import RankSettings
from autosplit.specs import get_spec
from autosplit.units import parse_bytes
from autosplit.verify.options import TimingOptions

PROF = make_profile([1, 2], [[1.0, 1.0]] * 4, batch_size=4)
PLAN = autosplit.plan(PROF, gpus=2)
X = torch.randn(4, 10)
SPEC = get_spec("cpu-core")
NAN, INF, HUGE = math.nan, math.inf, 10**30

TYPE, VALUE = "type", "value"

# (label, call, kind, the argument's name as the message must show it)
def plan_with(**options: Any) -> autosplit.Plan:
    """``autosplit.plan`` of ``PROF`` on 2 devices with these options."""
    return autosplit.plan(PROF, 2, PlanOptions(**options))


CASES: list[tuple[str, Callable[[], Any], str, str]] = [
    # -- plan ------------------------------------------------------------------------------------
    ("plan gpus str", lambda: autosplit.plan(PROF, gpus="2"), TYPE, "gpus"),
    ("plan gpus float", lambda: autosplit.plan(PROF, gpus=2.0), TYPE, "gpus"),
    ("plan gpus bool", lambda: autosplit.plan(PROF, gpus=True), TYPE, "gpus"),
    ("plan gpus None", lambda: autosplit.plan(PROF, gpus=None), TYPE, "gpus"),
    ("plan gpus 0", lambda: autosplit.plan(PROF, gpus=0), VALUE, "gpus"),
    ("plan gpus -1", lambda: autosplit.plan(PROF, gpus=-1), VALUE, "gpus"),
    ("plan gpus huge", lambda: autosplit.plan(PROF, gpus=HUGE), VALUE, "gpus"),
    ("plan profile", lambda: autosplit.plan({"blocks": []}, gpus=2), TYPE, "profile"),
    ("plan batch str", lambda: plan_with(batch_size="4"), TYPE, "batch_size"),
    ("plan batch 0", lambda: plan_with(batch_size=0), VALUE, "batch_size"),
    *[
        (f"plan bandwidth {v!r}", lambda v=v: plan_with(bandwidth_bytes_per_s=v),
         VALUE, "bandwidth_bytes_per_s")
        for v in (0, -1.0, NAN, INF)
    ],
    ("plan bandwidth str", lambda: plan_with(bandwidth_bytes_per_s="fast"), TYPE,
     "bandwidth_bytes_per_s"),
    *[
        (f"plan memory {v!r}", lambda v=v: plan_with(memory_per_gpu=v), VALUE,
         "memory_per_gpu")
        for v in (0, -1, NAN, INF, "inf", "0.5")
    ],
    ("plan memory bool", lambda: plan_with(memory_per_gpu=True), TYPE,
     "memory_per_gpu"),
    ("plan memory list of None", lambda: plan_with(memory_per_gpu=[None, 1]), TYPE,
     "memory_per_gpu[0]"),
    ("plan memory lengths", lambda: plan_with(memory_per_gpu=[1e9]), VALUE,
     "memory_per_gpu"),
    ("plan devices str", lambda: plan_with(devices="cpu"), TYPE, "devices"),
    ("plan devices ints", lambda: plan_with(devices=[0, 1]), TYPE, "devices[0]"),
    ("plan devices lengths", lambda: plan_with(devices=["cpu"]), VALUE, "devices"),
    ("plan devices empty", lambda: plan_with(devices=[]), VALUE, "devices"),
    ("plan schedule int", lambda: plan_with(schedule=1), TYPE, "schedule"),
    ("plan schedule name", lambda: plan_with(schedule="zigzag"), VALUE, "schedule"),
    ("plan optimizer None", lambda: plan_with(optimizer=None), TYPE, "optimizer"),
    ("plan solver name", lambda: plan_with(solver="gurobi"), VALUE, "solver"),
    ("plan split_size str", lambda: plan_with(split_size="2"), TYPE, "split_size"),
    ("plan split_size 0", lambda: plan_with(split_size=0), VALUE, "split_size"),
    ("plan time limit nan", lambda: plan_with(time_limit_s=NAN), VALUE,
     "time_limit_s"),
    ("plan speeds nan", lambda: plan_with(speeds=[1.0, NAN]), VALUE, "speeds[1]"),
    ("plan speeds 0", lambda: plan_with(speeds=[0, 1]), VALUE, "speeds[0]"),
    ("plan speeds str", lambda: plan_with(speeds="fast"), TYPE, "speeds"),
    ("plan speeds lengths", lambda: plan_with(speeds=[1.0]), VALUE, "speeds"),
    ("plan device_profiles", lambda: plan_with(device_profiles=[PROF, "x"]), TYPE,
     "device_profiles[1]"),
    # -- plan_with_balance -----------------------------------------------------------------------
    ("balance floats", lambda: planner.plan_with_balance(PROF, [1.5, 0.5], 2), TYPE,
     "balance[0]"),
    ("balance integral floats", lambda: planner.plan_with_balance(PROF, [2.0, 2.0], 2), TYPE,
     "balance[0]"),
    ("balance bools", lambda: planner.plan_with_balance(PROF, [True, 3], 2), TYPE,
     "balance[0]"),
    ("balance zero", lambda: planner.plan_with_balance(PROF, [4, 0], 2), VALUE, "balance[1]"),
    ("balance negative", lambda: planner.plan_with_balance(PROF, [5, -1], 2), VALUE,
     "balance[1]"),
    ("balance sum", lambda: planner.plan_with_balance(PROF, [1, 2], 2), VALUE, "balance"),
    ("balance empty", lambda: planner.plan_with_balance(PROF, [], 2), VALUE, "balance"),
    ("balance str", lambda: planner.plan_with_balance(PROF, "22", 2), TYPE, "balance"),
    ("balance split None", lambda: planner.plan_with_balance(PROF, [2, 2], None), TYPE,
     "split_size"),
    ("balance options dict", lambda: planner.plan_with_balance(PROF, [2, 2], 2, {"gpu": 2}),
     TYPE, "options"),
    ("plan options dict", lambda: autosplit.plan(PROF, 2, {"schedule": "1f1b"}), TYPE,
     "options"),
    ("balance bandwidth 0",
     lambda: planner.plan_with_balance(PROF, [2, 2], 2, PlanOptions(bandwidth_bytes_per_s=0)),
     VALUE,
     "bandwidth_bytes_per_s"),
    # -- comparison ------------------------------------------------------------------------------
    ("baselines gpus str", lambda: comparison.baseline_plans(PROF, "2"), TYPE, "gpus"),
    ("baselines gpus 0", lambda: comparison.baseline_plans(PROF, 0), VALUE, "gpus"),
    ("baselines batch 0", lambda: comparison.baseline_plans(PROF, 2, PlanOptions(batch_size=0)),
     VALUE,
     "batch_size"),
    ("manual split str", lambda: comparison.manual_plan(PROF, "block2"), TYPE, "split_points"),
    ("manual split ints", lambda: comparison.manual_plan(PROF, [2]), TYPE, "split_points[0]"),
    ("manual split_size float", lambda: comparison.manual_plan(PROF, ["block2"], 2.0), TYPE,
     "split_size"),
    ("manual batch str", lambda: comparison.manual_plan(PROF, ["block2"], None,
                                                        PlanOptions(batch_size="x")), TYPE,
     "batch_size"),
    ("compare plans list", lambda: comparison.compare(PROF, [PLAN]), TYPE, "plans"),
    ("compare plans entry", lambda: comparison.compare(PROF, {"a": "plan"}), TYPE, "plans['a']"),
    ("compare measured nan", lambda: comparison.compare(PROF, {"a": PLAN}, {"a": NAN}), VALUE,
     "measured_ms['a']"),
    ("compare profile", lambda: comparison.compare(None, {"a": PLAN}), TYPE, "profile"),
    # -- simulator -------------------------------------------------------------------------------
    ("simulate m float", lambda: simulator.simulate([1.0], [1.0], 2.0), TYPE, "m"),
    ("simulate m 0", lambda: simulator.simulate([1.0], [1.0], 0), VALUE, "m"),
    ("simulate fwd None", lambda: simulator.simulate(None, [1.0], 2), TYPE, "fwd_ms"),
    ("simulate fwd inf", lambda: simulator.simulate([INF], [1.0], 2), VALUE, "fwd_ms[0]"),
    ("simulate lengths", lambda: simulator.simulate([1.0, 1.0], [1.0], 2), VALUE, "bwd_ms"),
    ("simulate schedule", lambda: simulator.simulate([1.0], [1.0], 2, schedule=None), TYPE,
     "schedule"),
    ("simulate_plan dict", lambda: simulator.simulate_plan({"stages": []}), TYPE, "plan"),
    # -- solve -----------------------------------------------------------------------------------
    ("balance parts float", lambda: solve.balance([1.0, 2.0], 2.0), TYPE, "parts"),
    ("balance parts bool", lambda: solve.balance([1.0, 2.0], True), TYPE, "parts"),
    ("balance costs str", lambda: solve.balance("12", 1), TYPE, "costs"),
    ("balance costs None entry", lambda: solve.balance([1.0, None], 1), TYPE, "costs[1]"),
    ("balance costs nan", lambda: solve.balance([1.0, NAN], 1), VALUE, "costs[1]"),
    ("balance costs empty", lambda: solve.balance([], 1), VALUE, "costs"),
    ("balance comm lengths", lambda: solve.balance([1.0, 1.0], 1, comm=[1.0, 2.0]), VALUE,
     "comm"),
    ("balance capacity nan",
     lambda: solve.balance([1.0, 1.0], 1, memory=[1.0, 1.0], capacity=NAN), VALUE, "capacity"),
    ("solve_dp list", lambda: solve.solve_dp([1.0, 2.0]), TYPE, "problem"),
    ("min_capacity list", lambda: solve.min_capacity([1.0, 2.0]), TYPE, "problem"),
    ("evaluate floats",
     lambda: solve.evaluate(solve.PartitionProblem.build([1.0, 1.0], 2), [1.0, 1.0]), TYPE,
     "balance[0]"),
    ("uniform n str", lambda: solve.uniform("4", 2), TYPE, "n (blocks)"),
    ("uniform p 0", lambda: solve.uniform(4, 0), VALUE, "p (stages)"),
    ("block_partition p huge", lambda: solve.block_partition([1.0, 1.0], HUGE), VALUE,
     "stages"),
    ("by_parameters None", lambda: solve.by_parameters(None, 2), TYPE, "param_bytes"),
    ("manual names str", lambda: solve.manual("ab", ["b"]), TYPE, "block_names"),
    ("solve_milp limit str",
     lambda: solve.solve_milp(solve.PartitionProblem.build([1.0], 1), time_limit_s="1"), TYPE,
     "time_limit_s"),
    # -- units -----------------------------------------------------------------------------------
    ("parse_bytes None", lambda: parse_bytes(None), TYPE, "memory size"),
    ("parse_bytes list", lambda: parse_bytes([1]), TYPE, "memory size"),
    ("parse_bytes bool", lambda: parse_bytes(True), TYPE, "memory size"),
    ("parse_bytes 0", lambda: parse_bytes(0), VALUE, "memory size"),
    ("parse_bytes inf", lambda: parse_bytes(INF), VALUE, "memory size"),
    ("parse_bytes '1e400'", lambda: parse_bytes("1e400"), VALUE, "memory size"),
    ("parse_bytes 10**400", lambda: parse_bytes(10**400), VALUE, "memory size"),
    ("parse_bytes named", lambda: parse_bytes("lots", "memory_per_gpu"), VALUE, "memory_per_gpu"),
    # -- trace, profile, partition (ToyModel; every call fails before it is run) ---------------
    ("trace model", lambda: autosplit.trace("model"), TYPE, "model"),
    ("trace granularity", lambda: autosplit.trace(ToyModel(), granularity="op"), VALUE,
     "granularity"),
    ("trace leaf str", lambda: autosplit.trace(ToyModel(), leaf_modules="net1"), TYPE,
     "leaf_modules"),
    ("trace leaf int", lambda: autosplit.trace(ToyModel(), leaf_modules=[1]), TYPE,
     "leaf_modules[0]"),
    ("profile inputs", lambda: autosplit.profile(ToyModel(), [X, "x"]), TYPE, "example input 1"),
    ("profile inputs empty", lambda: autosplit.profile(ToyModel(), ()), VALUE, "example_inputs"),
    ("profile repeats 0", lambda: ProfileOptions(repeats=0), VALUE, "repeats"),
    ("profile repeats float", lambda: ProfileOptions(repeats=2.0), TYPE,
     "repeats"),
    ("profile warmup -1", lambda: ProfileOptions(warmup=-1), VALUE, "warmup"),
    ("profile threads bool", lambda: ProfileOptions(threads=True), TYPE,
     "threads"),
    ("profile budget nan", lambda: ProfileOptions(budget_s=NAN), VALUE,
     "budget_s"),
    ("profile budget -1", lambda: ProfileOptions(budget_s=-1), VALUE,
     "budget_s"),
    ("profile stages str", lambda: ProfileOptions(stages="2"), TYPE, "stages"),
    ("profile sizes floats", lambda: ProfileOptions(microbatch_sizes=[2.0]),
     TYPE, "microbatch_sizes[0]"),
    ("profile sizes empty", lambda: ProfileOptions(microbatch_sizes=[]),
     VALUE, "microbatch_sizes"),
    ("profile sizes huge",
     lambda: autosplit.profile(ToyModel(), X, options=ProfileOptions(microbatch_sizes=[HUGE])),
     VALUE, "microbatch_sizes"),
    ("profile include str", lambda: ProfileOptions(include="2"), TYPE,
     "include"),
    ("profile options dict", lambda: autosplit.profile(ToyModel(), X, options={"repeats": 1}),
     TYPE, "options"),
    ("profile device int", lambda: autosplit.profile(ToyModel(), X, device=0), TYPE, "device"),
    ("profile progress", lambda: autosplit.profile(ToyModel(), X, progress=1), TYPE, "progress"),
    ("partition model", lambda: autosplit.partition(None), TYPE, "model"),
    ("partition gpus str", lambda: autosplit.partition(ToyModel(), gpus="2"), TYPE, "gpus"),
    ("partition gpus 0", lambda: autosplit.partition(ToyModel(), gpus=0), VALUE, "gpus"),
    ("partition devices str", lambda: autosplit.partition(ToyModel(), devices="cpu"), TYPE,
     "devices"),
    ("partition plan dict", lambda: autosplit.partition(ToyModel(), plan={}), TYPE, "plan"),
    ("partition split bool", lambda: PartitionOptions(split_size=True), TYPE,
     "split_size"),
    ("partition bandwidth 0", lambda: PartitionOptions(bandwidth_bytes_per_s=0), VALUE,
     "bandwidth_bytes_per_s"),
    ("partition memory 0", lambda: PartitionOptions(memory_per_gpu=0), VALUE, "memory_per_gpu"),
    ("partition schedule", lambda: PartitionOptions(schedule="zz"), VALUE, "schedule"),
    ("profile sizes 0", lambda: ProfileOptions(microbatch_sizes=[0]), VALUE,
     "microbatch_sizes[0]"),
    ("partition options", lambda: autosplit.partition(ToyModel(), gpus=2, options={"verify": 1}),
     TYPE, "options"),
    ("partition profile options", lambda: PartitionOptions(profile={"repeats": 1}), TYPE,
     "profile"),
    ("partition verify", lambda: PartitionOptions(verify=1), TYPE, "verify"),
    # -- emit ------------------------------------------------------------------------------------
    ("emit plan", lambda: autosplit.emit("plan.json", "m.py"), TYPE, "plan"),
    ("emit model_ref", lambda: autosplit.emit(PLAN, None), TYPE, "model_ref"),
    ("emit devices str", lambda: autosplit.emit(PLAN, "m.py", devices="cpu"), TYPE, "devices"),
    ("emit class_name", lambda: autosplit.emit(PLAN, "m.py", class_name=3), TYPE, "class_name"),
    ("emit granularity", lambda: autosplit.emit(PLAN, "m.py", granularity=None), TYPE,
     "granularity"),
    # -- analytic and device specs --------------------------------------------------------------
    ("analytic spec", lambda: analytic.analytic_profile(ToyModel(), X, "h100-80gb"), TYPE,
     "spec"),
    ("analytic stages", lambda: EstimateOptions(stages=0), VALUE, "stages"),
    ("analytic attention", lambda: EstimateOptions(attention="fast"), VALUE, "attention"),
    ("analytic dtype", lambda: EstimateOptions(dtype="bf16"), TYPE, "dtype"),
    ("analytic sizes", lambda: analytic.analytic_profile(
        ToyModel(), X, SPEC, options=EstimateOptions(microbatch_sizes=[5])), VALUE,
     "microbatch_sizes"),
    ("analytic options dict", lambda: analytic.analytic_profile(ToyModel(), X, SPEC,
                                                                options={"stages": 2}), TYPE,
     "options"),
    ("build_on_meta factory", lambda: analytic.build_on_meta("ToyModel"), TYPE, "factory"),
    ("get_spec int", lambda: specs.get_spec(100), TYPE, "name"),
    ("get_spec unknown", lambda: specs.get_spec("tpu"), VALUE, "device"),
    ("load_spec None", lambda: specs.load_spec(None), TYPE, "path"),
    ("DeviceSpec str figure",
     lambda: specs.DeviceSpec("x", "1e12", 1e12, 1e12, 10**9, 1e9, "l", 1e9, "s"), TYPE,
     "peak_bf16_flops_per_s"),
    ("DeviceSpec memory 0",
     lambda: specs.DeviceSpec("x", 1e12, 1e12, 1e12, 0, 1e9, "l", 1e9, "s"), VALUE,
     "memory_bytes"),
    ("DeviceSpec bandwidth inf",
     lambda: specs.DeviceSpec("x", 1e12, 1e12, 1e12, 10**9, INF, "l", 1e9, "s"), VALUE,
     "memory_bandwidth_bytes_per_s"),
    ("calibrate measured", lambda: specs.calibrate(SPEC, "prof", PROF), TYPE, "measured"),
    ("calibrate spec", lambda: specs.calibrate("cpu-core", PROF, PROF), TYPE, "spec"),
    ("calibrate analytic", lambda: specs.calibrate(SPEC, PROF, 3), TYPE, "analytic"),
    ("calibrate sizes", lambda: specs.calibrate(SPEC, PROF, PROF, sizes="1"), TYPE,
     "sizes"),
]


@pytest.mark.parametrize(
    ("call", "kind", "name"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_argument_is_named(call: Callable[[], Any], kind: str, name: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        call()
    error = info.value
    assert isinstance(error, autosplit.AutosplitError) and isinstance(error, ValueError)
    if kind == TYPE:
        assert isinstance(error, ArgumentTypeError) and isinstance(error, TypeError), error
    else:
        assert not isinstance(error, TypeError), f"{type(error).__name__}: {error}"
    assert name in str(error), str(error)


def test_messages_quote_the_value_and_the_rule() -> None:
    with pytest.raises(InvalidInputError) as info:
        plan_with(bandwidth_bytes_per_s=0)
    assert str(info.value) == "bandwidth_bytes_per_s must be a finite number > 0 (bytes/s), got 0"
    with pytest.raises(ArgumentTypeError) as info:
        autosplit.plan(PROF, gpus="2")
    assert str(info.value) == "gpus must be an integer, got '2'"
    with pytest.raises(InvalidInputError, match=r"sums to 3 blocks, but the model has 4"):
        planner.plan_with_balance(PROF, [1, 2], 2)


def test_documented_defaults_still_work() -> None:
    # None keeps meaning "default" where documented, and numpy integers are integers
    import numpy as np

    plan = autosplit.plan(
        PROF, gpus=np.int64(2), options=PlanOptions(
            batch_size=None, memory_per_gpu=None, bandwidth_bytes_per_s=None, speeds=None,
            devices=("cpu", torch.device("cpu"))),
    )
    assert plan.balance == autosplit.plan(PROF, gpus=2).balance
    scored = planner.plan_with_balance(PROF, (np.int64(2), 2), 2)
    assert scored.balance == (2, 2)


@pytest.mark.parametrize("record", [PartitionOptions, PlanOptions, ProfileOptions,
                                    EstimateOptions, TimingOptions, RankSettings],
                         ids=lambda r: r.__name__)
def test_an_options_record_names_an_unknown_option_and_the_nearest(record: type) -> None:
    import dataclasses

    first = dataclasses.fields(record)[0].name
    typo = first[:-1]  # one letter short of the record's first field
    with pytest.raises(ArgumentTypeError) as info:
        record(**{typo: None})
    assert isinstance(info.value, TypeError)  # as Python's own refusal is
    assert str(info.value).startswith(
        f"{record.__name__} has no option {typo!r}: did you mean {first}? its options are ")
    with pytest.raises(ArgumentTypeError, match=f"{record.__name__} has no option 'zzz'"):
        dataclasses.replace(record(), zzz=1)
    count = len(dataclasses.fields(record))
    with pytest.raises(ArgumentTypeError, match=f"takes at most {count} values"):
        record(*([None] * (count + 1)))
    record()  # the defaults still build (a refusal would fail the test)
