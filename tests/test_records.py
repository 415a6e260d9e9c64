"""Profile and Plan files are checked field by field on load: a corrupt file is a PlanFileError
naming the file and the field, never another exception, and in the CLI one line and exit 2."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic import make_profile

import autosplit
from autosplit import PlanOptions, cost, simulator
from autosplit.capture.trace import trace
from autosplit.cli import main
from autosplit.errors import AutosplitError, InvalidInputError, PlanFileError, PlanMismatchError
from autosplit.records import PLAN_GROUPS, Plan, Profile, Stage
from autosplit.validation import KNOWN_OPTIMIZERS, KNOWN_SCHEDULES, RecordError

ROOT = Path(__file__).resolve().parent.parent
TOY = str(ROOT / "examples" / "toy.py")


def _profile() -> Profile:
    prof = make_profile([1, 2, 4], [[1, 1, 1], [2, 2, 2], [1, 1, 1], [3, 3, 3]], batch_size=8,
                        param_bytes=[40, 80, 40, 120], saved_bytes_per_sample=[4, 8, 4, 8],
                        cut_bytes_per_sample=[16, 16, 16])
    first = dataclasses.replace(prof.blocks[0], peak_bytes=(10, 20, 40),
                                saved_shared_bytes=(0, 0, 0))
    return dataclasses.replace(prof, blocks=(first, *prof.blocks[1:]))


PROFILE = _profile()
PLAN = autosplit.plan(PROFILE, gpus=3, options=PlanOptions(schedule="1f1b"))


def _json(record: Profile | Plan) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.json"
        record.save(path)
        return json.loads(path.read_text())


PROFILE_JSON = _json(PROFILE)
PLAN_FILE = _json(PLAN)  # format 2, as saved
PLAN_JSON = json.loads(json.dumps(  # format 1: every field at the top level
    {"kind": "plan", "format_version": 1, **dataclasses.asdict(PLAN)}))


def _load_text(cls: type[Profile | Plan], text: str) -> Profile | Plan:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bad.json"
        path.write_text(text)
        return cls.load(path)


def _mutated(data: dict[str, Any], change: Callable[[dict[str, Any]], Any]) -> str:
    data = copy.deepcopy(data)
    change(data)
    return json.dumps(data)  # NaN and ±Infinity are written as JSON's non-standard literals


def test_valid_records_load_unchanged() -> None:
    assert PLAN.balance == (2, 1, 1) and PLAN.split_size == 1 and PLAN.microbatches == 8
    assert _load_text(Profile, json.dumps(PROFILE_JSON)) == PROFILE
    assert _load_text(Plan, json.dumps(PLAN_JSON)) == PLAN


def test_a_plan_is_saved_in_groups_and_format_1_still_loads() -> None:
    assert PLAN_FILE["format_version"] == 2
    assert list(PLAN_FILE) == ["kind", "format_version", "layout", "prediction", "provenance"]
    assert PLAN_FILE["layout"]["split_size"] == 1 and PLAN_FILE["layout"]["schedule"] == "1f1b"
    assert PLAN_FILE["prediction"]["predicted_step_ms"] == PLAN.predicted_step_ms
    assert PLAN_FILE["provenance"]["fingerprint"] == PLAN.fingerprint
    assert _load_text(Plan, json.dumps(PLAN_FILE)) == PLAN
    assert _load_text(Plan, json.dumps(PLAN_JSON)) == PLAN  # format 1: the fields at the top


def test_every_plan_field_is_in_exactly_one_group() -> None:
    grouped = [name for names in PLAN_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(Plan))


def test_a_plan_saved_before_the_one_device_split_loads_without_it() -> None:
    data = dict(PLAN_JSON)
    data.pop("single_device_split", None)
    assert _load_text(Plan, json.dumps(data)).single_device_split is None
    assert _load_text(Plan, json.dumps({**data, "single_device_split": 4})
                      ).single_device_split == 4


def test_known_names_are_those_the_cost_model_and_runtimes_know() -> None:
    assert set(KNOWN_OPTIMIZERS) == set(cost.OPTIMIZER_STATE)
    assert KNOWN_SCHEDULES == cost.SCHEDULES == simulator.SCHEDULES


# ------------------------------------------------------------------ one entry per corrupt kind


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change that sets the value at ``a.b[2].c`` (dots and indices) to ``value``."""
    keys: list[str | int] = []
    for part in path.replace("[", ".[").split("."):
        keys.append(int(part[1:-1]) if part.startswith("[") else part)

    def change(data: dict[str, Any]) -> None:
        target: Any = data
        for key in keys[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value

    return change


_DELETE = object()
NAN, INF = float("nan"), float("inf")


def _reverse_stages(d: dict[str, Any]) -> None:
    d["stages"].reverse()


def _duplicate_block(d: dict[str, Any]) -> None:
    d["stages"][1]["blocks"].append(d["stages"][0]["blocks"][0])


def _drop_last_cut(d: dict[str, Any]) -> None:
    d["cuts"].pop()


def _no_blocks(d: dict[str, Any]) -> None:
    d["blocks"], d["cuts"] = [], []


PLAN_CASES = {
    "duplicated block": (_duplicate_block, "stages[1].blocks[1] 'block0' is repeated"),
    "no stages": (_set("stages", []), "stages is empty"),
    "empty stage": (_set("stages[1].blocks", []), "stages[1].blocks is empty"),
    "reordered stages": (_reverse_stages, "stages[0].index is 2"),
    "stage number": (_set("stages[1].index", 5), "stages[1].index is 5"),
    "split size 0": (_set("split_size", 0), "split_size is 0"),
    "-1 micro-batches": (_set("microbatches", -1), "microbatches is -1"),
    "micro-batch count": (_set("microbatches", 7), "microbatches is 7"),
    "batch size 0": (_set("batch_size", 0), "batch_size is 0"),
    "split larger than batch": (_set("split_size", 64), "split_size is 64, larger"),
    "unknown schedule": (_set("schedule", "zigzag"), "schedule is 'zigzag': use one of"),
    "unknown optimizer": (_set("optimizer", "lion"), "optimizer is 'lion'"),
    "no candidates": (_set("candidates", []), "candidates is empty"),
    "candidate 0": (_set("candidates", [0, 4]), "candidates[0] is 0"),
    "chosen size not a candidate": (_set("candidates", [2]), "candidates is [2]"),
    "negative memory limit": (_set("memory_limit_bytes", -1), "memory_limit_bytes is -1"),
    "negative stage memory": (_set("stages[0].memory_bytes", -2**40),
                              "stages[0].memory_bytes is -1099511627776"),
    "nan step": (_set("predicted_step_ms", NAN), "predicted_step_ms is nan"),
    "infinite stage time": (_set("stages[2].compute_ms", INF), "stages[2].compute_ms is inf"),
    "negative send": (_set("stages[0].send_ms", -1.0), "stages[0].send_ms is -1.0"),
    "forward above compute": (_set("stages[0].forward_ms", 1e6), "stages[0].forward_ms is"),
    "empty device": (_set("stages[0].device", ""), "stages[0].device is empty"),
    "missing field": (_set("schedule", _DELETE), "schedule is missing"),
    "missing stage field": (_set("stages[1].blocks", _DELETE), "stages[1].blocks is missing"),
    "unknown field": (_set("colour", "red"), "colour is not a field of a Plan"),
    "string for a size": (_set("split_size", "4"), "split_size is '4': expected an integer"),
    "bool for a size": (_set("split_size", True), "split_size is True: expected an integer"),
    "float for bytes": (_set("stages[0].send_bytes", 1.5), "stages[0].send_bytes is 1.5"),
    "huge int": (_set("split_size", 2**70), "split_size is too large"),
    "huge int for a time": (_set("predicted_step_ms", 10**400), "predicted_step_ms is too large"),
    "stage not an object": (_set("stages[0]", 3), "stages[0] is 3: expected an object"),
    "blocks a string": (_set("stages[0].blocks", "block0"), "stages[0].blocks is 'block0'"),
    "nested list": (_set("stages[0].blocks", [[["block0"]]]), "stages[0].blocks[0] is"),
    "negative action cost": (_set("action_ms", -1.0), "action_ms is -1.0"),
    "one device's split 0": (_set("single_device_split", 0), "single_device_split is 0"),
    "one device's split above the batch": (_set("single_device_split", 9),
                                           "single_device_split is 9: above batch_size 8"),
}

PROFILE_CASES = {
    "nan time": (_set("blocks[3].fwd_ms[0]", NAN),
                 "blocks[3].fwd_ms[0] is nan: times must be finite and ≥ 0"),
    "infinite time": (_set("blocks[1].bwd_ms[2]", INF), "blocks[1].bwd_ms[2] is inf"),
    "negative time": (_set("blocks[0].fwd_ms[1]", -1.5), "blocks[0].fwd_ms[1] is -1.5"),
    "negative bytes": (_set("blocks[2].saved_bytes[0]", -5),
                       "blocks[2].saved_bytes[0] is -5: byte counts must be integers ≥ 0"),
    "negative parameters": (_set("blocks[1].param_bytes", -1), "blocks[1].param_bytes is -1"),
    "fractional bytes": (_set("blocks[1].output_bytes[0]", 1.5),
                         "blocks[1].output_bytes[0] is 1.5: expected an integer"),
    "negative cut bytes": (_set("cuts[1].bytes[2]", -64), "cuts[1].bytes[2] is -64"),
    "dropped size in a row": (_set("blocks[1].bwd_ms", [0.1, 0.2]),
                              "blocks[1].bwd_ms has 2 values for 3"),
    "dropped size in peaks": (_set("blocks[0].peak_bytes", [10]), "blocks[0].peak_bytes has 1"),
    "dropped size in a cut": (_set("cuts[0].bytes", [1, 2]), "cuts[0].bytes has 2 values for 3"),
    "micro-batch size 0": (_set("microbatch_sizes[0]", 0), "microbatch_sizes[0] is 0"),
    "negative micro-batch size": (_set("microbatch_sizes[0]", -1), "microbatch_sizes[0] is -1"),
    "sizes out of order": (_set("microbatch_sizes", [4, 2, 1]), "microbatch_sizes is [4, 2, 1]"),
    "repeated size": (_set("microbatch_sizes", [1, 2, 2]), "microbatch_sizes is [1, 2, 2]"),
    "no sizes": (_set("microbatch_sizes", []), "microbatch_sizes is empty"),
    "batch size 0": (_set("batch_size", 0), "batch_size is 0"),
    "unknown schedule's action cost": (_set("action_ms", [["zigzag", 1.0]]),
                                       "action_ms[0][0] is 'zigzag'"),
    "negative action cost": (_set("action_ms", [["gpipe", -1.0]]), "action_ms[0][1] is -1.0"),
    "action cost twice": (_set("action_ms", [["gpipe", 1.0], ["gpipe", 2.0]]),
                          "action_ms[1][0] is 'gpipe' again"),
    "action cost not a pair": (_set("action_ms", [["gpipe", 1.0, 2.0]]),
                               "action_ms[0] has 3 items: expected 2"),
    "negative action spread": (_set("action_spread", [["1f1b", -0.1]]),
                               "action_spread[0][1] is -0.1: spreads must be finite and ≥ 0"),
    "action spread not a number": (_set("action_spread", [["1f1b", "wide"]]),
                                   "action_spread[0][1] is 'wide'"),
    "action spread twice": (_set("action_spread", [["1f1b", 0.1], ["1f1b", 0.2]]),
                            "action_spread[1][0] is '1f1b' again"),
    "missing cut": (_drop_last_cut, "cuts has 2 entries for 4 blocks"),
    "cut number": (_set("cuts[1].index", 5), "cuts[1].index is 5"),
    "repeated block name": (_set("blocks[2].name", "block0"),
                            "blocks[2].name 'block0' is repeated"),
    "no blocks": (_no_blocks, "blocks is empty"),
    "zero threads": (_set("device.threads", 0), "device.threads is 0"),
    "nan seconds": (_set("seconds", NAN), "seconds is nan"),
    "dtypes for shapes": (_set("input_dtypes", []), "input_dtypes has 0 values for 1"),
    "negative dimension": (_set("input_shapes[0][1]", -3), "input_shapes[0][1] is -3"),
    "huge int for a time": (_set("blocks[0].fwd_ms[0]", 10**400),
                            "blocks[0].fwd_ms[0] is too large"),
    "missing field": (_set("blocks[2].fwd_ms", _DELETE), "blocks[2].fwd_ms is missing"),
    "device not an object": (_set("device", "cpu"), "device is 'cpu': expected an object"),
}


CORRUPT = [("plan", case) for case in PLAN_CASES] + [("profile", case) for case in PROFILE_CASES]


@pytest.mark.parametrize("kind, case", CORRUPT)
def test_each_corrupt_kind_names_the_file_and_the_field(kind: str, case: str) -> None:
    cls, cases, data = (Plan, PLAN_CASES, PLAN_JSON) if kind == "plan" else (
        Profile, PROFILE_CASES, PROFILE_JSON)
    change, field = cases[case]
    with pytest.raises(PlanFileError) as info:
        _load_text(cls, _mutated(data, change))
    assert str(info.value).startswith(f"{kind} file '") and "bad.json': " in str(info.value)
    assert field in str(info.value)


def _nested(depth: int) -> str:
    return '{"kind": "plan", "format_version": 1, "stages": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (_nested(100_000), "nested too deeply"),
        (_nested(500), "stages[0] is [[[...]]]: expected an object"),
        ('{"kind": "plan", "format_version": 1, "split_size": ' + "9" * 5000 + "}",
         "not valid JSON"),
        ("[1, 2]", "not an autosplit plan file (kind: a list)"),
        ("null", "not an autosplit plan file (kind: a NoneType)"),
        ('{"kind": ["plan"], "format_version": 1}', "(kind: ['plan'])"),
        ('{"kind": "plan", "format_version": true}', "format version True"),
        ('{"kind": "plan", "format_version": 1.0}', "format version 1.0"),
        ("\ufeff{}", "not valid JSON"),
    ],
)
def test_unreadable_files_are_plan_file_errors(text: str, message: str) -> None:
    with pytest.raises(PlanFileError, match="bad.json") as info:
        _load_text(Plan, text)
    assert message in str(info.value)


def test_records_built_in_python_are_checked_too() -> None:
    stage = PLAN.stages[0]
    with pytest.raises(InvalidInputError, match=r"^Stage: blocks is empty$"):
        dataclasses.replace(stage, blocks=())
    with pytest.raises(InvalidInputError, match=r"^Plan: stages\[1\]\.index is 0"):
        dataclasses.replace(PLAN, stages=(stage, stage))
    with pytest.raises(InvalidInputError, match=r"^Plan: microbatches is 3: a batch of 8"):
        dataclasses.replace(PLAN, microbatches=3)
    with pytest.raises(InvalidInputError, match=r"^BlockProfile: fwd_ms\[0\] is nan"):
        dataclasses.replace(PROFILE.blocks[0], fwd_ms=(NAN, 1.0, 1.0))
    with pytest.raises(InvalidInputError, match=r"^Profile: blocks\[1\]\.fwd_ms has 2 values"):
        block = PROFILE.blocks[1]
        shorter = dataclasses.replace(block, fwd_ms=block.fwd_ms[:2], bwd_ms=block.bwd_ms[:2],
                                      saved_bytes=block.saved_bytes[:2],
                                      output_bytes=block.output_bytes[:2])
        dataclasses.replace(PROFILE, blocks=(PROFILE.blocks[0], shorter, *PROFILE.blocks[2:]))


# ------------------------------------------------------------------ the plan against the model


def _toy_plan(*stages: tuple[str, ...]) -> Plan:
    graph = trace(autosplit_toy())
    parts = tuple(Stage(s, "cpu", names, 1.0, 0.5, 0, 0.0, 0) for s, names in enumerate(stages))
    return Plan(graph.model_name, graph.fingerprint, parts,
                4, 2, 8, "gpipe", 1.0, 1.0, "manual", (4,), "test")


def autosplit_toy() -> Any:
    from autosplit.modelfile import load_model_file

    return load_model_file(TOY, None).build()


MODEL_CASES = {
    "made-up block": ((("net1",), ("net3",)), "stage 1 holds block 'net3', which the model"),
    "missing block": ((("net1",),), "block 'net2' of the model ToyModel is in no stage"),
    "missing first block": ((("net2",),), "block 'net1' of the model ToyModel is in no stage"),
    "blocks reordered in a stage": (
        (("net2", "net1"),), "stage 0 holds block 'net2' where the model ToyModel has 'net1'"),
    "blocks swapped across stages": ((("net2",), ("net1",)),
                                     "stage 0 holds block 'net2' where the model ToyModel has"),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_a_plan_whose_blocks_are_not_the_models_is_refused(case: str) -> None:
    stages, message = MODEL_CASES[case]
    plan = _toy_plan(*stages)
    with pytest.raises(PlanMismatchError, match="make a new plan") as info:
        plan.check_blocks(("net1", "net2"), "ToyModel")
    assert message in str(info.value)
    with pytest.raises(PlanMismatchError, match=re.escape(message)):
        autosplit.partition(autosplit_toy(), plan=plan, devices=["cpu"] * len(stages))
    _toy_plan(("net1",), ("net2",)).check_blocks(("net1", "net2"))  # the right plan passes


# ------------------------------------------------------------------------------ the CLI


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], match: str) -> None:
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (argv, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", PLAN_CASES)
def test_cli_show_and_run_refuse_every_corrupt_plan(case: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    change, field = PLAN_CASES[case]
    bad = tmp_path / "bad.json"
    bad.write_text(_mutated(PLAN_JSON, change))
    _one_line_exit_2(capsys, ["show", str(bad)], field)
    _one_line_exit_2(capsys, ["run", TOY, "--plan", str(bad)], field)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


@pytest.mark.parametrize("case", ["nan time", "micro-batch size 0", "dropped size in a row"])
def test_cli_plan_refuses_a_corrupt_profile(case: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    change, field = PROFILE_CASES[case]
    bad = tmp_path / "bad.json"
    bad.write_text(_mutated(PROFILE_JSON, change))
    _one_line_exit_2(capsys, ["plan", TOY, "--gpus", "2", "--profile", str(bad),
                              "-o", str(tmp_path / "out.json")], field)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


@pytest.mark.parametrize("case", MODEL_CASES)
def test_cli_refuses_a_plan_for_other_blocks(case: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    stages, message = MODEL_CASES[case]
    bad = tmp_path / "bad.json"
    _toy_plan(*stages).save(bad)
    before = message.split(" the model")[0]  # the CLI names the model by its file
    _one_line_exit_2(capsys, ["show", str(bad), "--model", TOY], before)
    _one_line_exit_2(capsys, ["run", TOY, "--plan", str(bad)], before)


# --------------------------------------------------------------- property: mutated JSON files

SPECIAL = [None, True, False, "", "x", "gpipe", "block0", 0, -1, 1, 3, 2**63, 10**30, 10**400,
           0.5, -0.5, 1e308, NAN, INF, -INF, [], {}, [1], [[0]], {"a": 1}]
VALUES = st.one_of(st.sampled_from(SPECIAL), st.integers(), st.floats(), st.text(max_size=3))


def _paths(value: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [here] if here else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, here + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _paths(item, here + (i,))
    return found


@st.composite
def corrupted(draw: st.DrawFn, data: dict[str, Any]) -> str:
    data = copy.deepcopy(data)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent: Any = data
        for key in path[:-1]:
            parent = parent[key]
        key, value = path[-1], parent[path[-1]]
        action = draw(st.sampled_from(["set", "delete", "duplicate", "reverse", "nest", "swap"]))
        if action == "set":
            parent[key] = copy.deepcopy(draw(VALUES))  # SPECIAL holds lists and dicts: a
            # drawn one mutated later would change what the strategy draws next time
        elif action == "delete":
            del parent[key]
        elif action == "nest":
            parent[key] = [value] if draw(st.booleans()) else {"x": value}
        elif isinstance(value, list) and value:
            if action == "duplicate":
                value.insert(draw(st.integers(0, len(value))), copy.deepcopy(value[0]))
            elif action == "reverse":
                value.reverse()
            else:
                i = draw(st.integers(0, len(value) - 1))
                value[0], value[i] = value[i], value[0]
        elif isinstance(parent, list) and action == "duplicate":
            parent.append(copy.deepcopy(value))
    return json.dumps(data)


def _numbers(value: Any) -> list[float]:
    if isinstance(value, dict):
        return [n for item in value.values() for n in _numbers(item)]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in _numbers(item)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _loaded_or_refused(cls: type[Profile | Plan], text: str) -> Any:
    """The record read from ``text``, checked to round-trip exactly, or None if refused."""
    try:
        record = _load_text(cls, text)
    except PlanFileError:
        return None
    assert isinstance(record, cls)
    assert all(math.isfinite(n) and n >= 0 for n in _numbers(dataclasses.asdict(record)))
    assert _load_text(cls, json.dumps(_json(record))) == record
    return record


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted(PROFILE_JSON))
def test_mutated_profiles_load_cleanly_or_fail_with_plan_file_error(text: str) -> None:
    prof = _loaded_or_refused(Profile, text)
    if prof is None:
        return
    k, n = len(prof.microbatch_sizes), len(prof.blocks)
    sizes = list(prof.microbatch_sizes)
    assert sizes == sorted(set(sizes)) and sizes[0] >= 1
    assert [c.index for c in prof.cuts] == list(range(n - 1))
    assert all(len(row) == k for b in prof.blocks for row in (b.fwd_ms, b.bwd_ms, b.saved_bytes))
    assert len(set(prof.block_names)) == n >= 1
    try:  # what loads can be planned, or is refused as bad input
        autosplit.plan(prof, gpus=min(2, n))
    except AutosplitError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted(PLAN_JSON))
def test_mutated_plans_load_cleanly_or_fail_with_plan_file_error(text: str) -> None:
    plan = _loaded_or_refused(Plan, text)
    if plan is None:
        return
    assert [s.index for s in plan.stages] == list(range(len(plan.stages))) and plan.stages
    assert all(s.blocks for s in plan.stages)
    names = [name for s in plan.stages for name in s.blocks]
    assert len(set(names)) == len(names)
    assert plan.microbatches == -(-plan.batch_size // plan.split_size)  # ceil, exact
    assert plan.schedule in KNOWN_SCHEDULES and plan.split_size in plan.candidates
    assert "bubble" in str(plan) and 0 <= plan.bubble_fraction <= 1
    try:
        simulator.simulate_plan(plan)
        plan.check_blocks(PROFILE.block_names)
    except AutosplitError:
        pass


# ------------------------------------------------------------------ format 2: fields in groups


def _moved(data: dict[str, Any]) -> None:
    data["layout"]["predicted_step_ms"] = data["prediction"].pop("predicted_step_ms")


@pytest.mark.parametrize("change, message", [
    (_set("layout.stages[1].blocks", []), "layout.stages[1].blocks is empty"),
    (_set("prediction.predicted_step_ms", -1.0), "prediction.predicted_step_ms is -1.0"),
    (_set("provenance.solver", 3), "provenance.solver is 3"),
    (_set("provenance.fingerprint", _DELETE), "provenance.fingerprint is missing"),
    (_set("layout.colour", "red"), "layout.colour is not a field of a Plan"),
    (_moved, "layout.predicted_step_ms belongs in prediction, not in layout"),
    (_set("extras", {}), "extras is not a group of a Plan file (its groups: layout, "
                         "prediction, provenance)"),
    (_set("layout", [1]), "layout is [1]: expected an object of fields"),
    (_set("format_version", 3), "has format version 3; this autosplit reads version 1 or 2"),
])
def test_a_corrupt_grouped_plan_names_the_group_and_the_field(change: Callable[..., Any],
                                                             message: str) -> None:
    with pytest.raises(PlanFileError, match="bad.json") as info:
        _load_text(Plan, _mutated(PLAN_FILE, change))
    assert message in str(info.value)


def test_a_step_of_too_many_micro_batches_is_refused_by_name() -> None:
    """A batch of 10**9 samples (a corrupted file, a typo) would be simulated micro-batch by
    micro-batch: the plan, the profile and the planner refuse it, naming the batch."""
    data = _json(PLAN)
    data["layout"]["batch_size"] = 10**9
    with pytest.raises(PlanFileError, match="batch_size is 1000000000: .* above the 10,000"):
        _load_text(Plan, json.dumps(data))
    with pytest.raises(RecordError, match="batch_size"):
        dataclasses.replace(PROFILE, batch_size=10**9)
    with pytest.raises(InvalidInputError, match="micro-batches a step may have"):
        autosplit.plan(PROFILE, 2, PlanOptions(batch_size=10**9))
