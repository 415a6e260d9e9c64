"""Each benchmark's --smoke variant runs from a checkout and writes its results."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision

import autosplit
from autosplit import PlanOptions
from autosplit.errors import InvalidInputError

ROOT = Path(__file__).resolve().parent.parent


SMOKE_TIMEOUT_S = 400
"""A guard against a hung smoke run, not a speed check: the slowest takes 60–80 s on a quiet
2-core machine and went past 120 s beside other work."""


def run_benchmark(script: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out), *extra],
        capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, check=True,
    )


def test_solver_benchmark_smoke(tmp_path) -> None:
    run_benchmark("solvers.py", tmp_path)
    data = json.loads((tmp_path / "solvers_smoke.json").read_text())
    assert data["rows"] and all(abs(r["milp_vs_dp"] - 1.0) < 1e-9 for r in data["rows"])
    assert all(r["uniform_vs_optimum"] >= 1.0 for r in data["rows"])
    assert "| n | p |" in (tmp_path / "solvers_smoke.md").read_text()


def test_planning_benchmark_smoke(tmp_path) -> None:
    run_benchmark("planning.py", tmp_path)
    data = json.loads((tmp_path / "planning_smoke.json").read_text())
    (row,) = data["rows"]
    assert row["model"] == "toy" and row["profile_seconds"] > 0
    assert row["plans"][0]["dp_step_ms"] > 0
    assert abs(row["plans"][0]["milp_step_ms"] - row["plans"][0]["dp_step_ms"]) <= 1e-9 * row["plans"][0]["dp_step_ms"]


@pytest.mark.long
def test_exact_search_benchmark_smoke(tmp_path) -> None:
    run_benchmark("exact_search.py", tmp_path)
    data = json.loads((tmp_path / "exact_search_smoke.json").read_text())
    assert [(r["model"], r["schedule"], r["gpus"]) for r in data["rows"]][-4:] == [
        ("1000 blocks", "gpipe", 8), ("1000 blocks", "1f1b", 8),
        ("resnet50 (auto)", "auto", 2), ("resnet50 (auto)", "auto", 2)]
    assert all(r["proven"] and sum(r["balance"]) in (19, 1000) for r in data["rows"])
    free, limited = data["rows"][-2:]
    assert free["memory_per_gpu"] is None and limited["memory_per_gpu"] > 0
    # the limit binds: the limited plan is slower, or recomputes
    assert (limited["predicted_step_ms"] > free["predicted_step_ms"]
            or limited["checkpointed"] > 0)
    text = (tmp_path / "exact_search_smoke.md").read_text()
    assert "| model | schedule | p |" in text and "## The joint search" in text


def test_analytic_benchmark_smoke(tmp_path) -> None:
    run_benchmark("analytic.py", tmp_path)
    data = json.loads((tmp_path / "analytic_smoke.json").read_text())
    assert [r["b"] for r in data["rows"]] == [16, 32]
    for r in data["rows"]:
        assert len(r["predicted_stage_ms"]) == 2 and all(v > 0 for v in r["measured_A_stage_ms"])
        assert 0 < r["efficiency"] <= 1.5


def test_scale_benchmark_smoke(tmp_path) -> None:
    run_benchmark("scale.py", tmp_path)
    data = json.loads((tmp_path / "scale_smoke.json").read_text())
    (scale,) = data["scales"]
    assert scale["devices"] == 4 and scale["topology"].startswith("2 nodes × 2 devices")
    chosen = scale["chosen"]
    assert chosen["stages"] * chosen["replicas"] == 4 and chosen["fits"]
    steps = [o["step_ms"] for o in scale["options"] if o["fits"]]
    assert chosen["step_ms"] == min(steps)
    assert "| devices | topology |" in (tmp_path / "scale_smoke.md").read_text()


def load_benchmark(name: str):  # type: ignore[no-untyped-def]
    """A benchmark script as a module (it puts benchmarks/ on sys.path for its own imports)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def check_figures(out: Path, names: list[str], count: int) -> None:
    assert len(names) == count
    for name in names:
        size = (out / name).stat().st_size
        assert name.endswith(".png") and 0 < size < 150_000, (name, size)


@pytest.mark.long
def test_tutorial_benchmark_smoke(tmp_path) -> None:
    """Processes mode (CPU): one device, model parallel and the pipelined sweep in one job."""
    run_benchmark("tutorial.py", tmp_path)
    data = json.loads((tmp_path / "tutorial_smoke.json").read_text())
    assert data["settings"]["mode"] == "processes"
    assert set(data["bars"]) == {"one device", "model parallel", "pipelined"}
    assert [r["split_size"] for r in data["sweep"]] == [1, 2]
    for row in data["rows"]:
        assert len(row["seconds"]) == data["settings"]["repeats"] and row["mean"] > 0
    assert data["bars"]["one device"]["speedup_vs_one_device"] == 1.0
    check_figures(tmp_path, data["figures"], 2)
    assert "| configuration |" in (tmp_path / "tutorial_smoke.md").read_text()


@pytest.mark.long
def test_tutorial_benchmark_in_process_smoke(tmp_path) -> None:
    """The tutorial's one-process version (what runs on two GPUs), here on two CPU devices."""
    run_benchmark("tutorial.py", tmp_path, "--mode", "in-process", "--devices", "cpu", "cpu")
    data = json.loads((tmp_path / "tutorial_smoke.json").read_text())
    assert data["settings"]["mode"] == "in-process"
    assert {r["config"] for r in data["rows"]} == {"one device", "model parallel", "split 1", "split 2"}


def test_two_device_resnet_is_the_model() -> None:
    """The tutorial's hand split (whole batch or pipelined) computes what the ResNet computes."""
    tutorial = load_benchmark("tutorial")
    two_devices = load_benchmark("two_devices")
    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(6, 3, 32, 32)
    expected = resnet(x)
    for split in (None, 2, 4):
        split_model = two_devices.TwoDeviceResNet(resnet, ["cpu", "cpu"], split).eval()
        torch.testing.assert_close(split_model(x), expected)
    assert tutorial.nearest_divisors(20, 48) == [16, 24]
    assert tutorial.nearest_divisors(20, 120) == [20]


@pytest.mark.long
def test_compare_benchmark_smoke(tmp_path) -> None:
    run_benchmark("compare.py", tmp_path)
    data = json.loads((tmp_path / "compare_smoke.json").read_text())
    with_torchgpipe = importlib.util.find_spec("torchgpipe") is not None
    models = {m["model"]: m for m in data["models"]}
    assert set(models) == {"ResNet18", "GPT tiny"}
    names = [r["name"] for r in models["ResNet18"]["rows"]]
    expected = ["one device", "hand split", "uniform", "by parameters"]
    assert names == expected + (["torchgpipe"] if with_torchgpipe else []) + ["autosplit"]
    assert "hand split" not in [r["name"] for r in models["GPT tiny"]["rows"]]
    for model in models.values():
        for row in model["rows"]:
            assert row["median_s"] > 0 and row["predicted_ms"] > 0 and row["bound_ms"] > 0
            assert row["vs_one_device"] > 0
            assert len(row["measured_s"]) == data["settings"]["rounds"]
    oracle = data["oracle"]
    assert len(oracle["points"]) == 10 * 2  # ResNet18: 10 cuts × m ∈ {1, 2}
    assert sum(p["autosplit"] for p in oracle["points"]) == 1
    assert oracle["autosplit_vs_best"] > 0 and oracle["refined_best"]
    assert all(g["value"] > 0 for g in data["goals"])
    check_figures(tmp_path, data["figures"], 3)
    text = (tmp_path / "compare_smoke.md").read_text()
    assert "| plan | cut before |" in text and "## The oracle" in text


def test_compare_without_torchgpipe_skips_its_rows(monkeypatch) -> None:
    compare = load_benchmark("compare")
    monkeypatch.setattr(compare, "balance_by_time", None)
    case = compare.smoke_cases()[0][0]
    profile, model, inputs, _ = compare.profile_case(case, torch.device("cpu"))
    plans, notes = compare.case_plans(case, profile, model, inputs, torch.device("cpu"))
    assert "torchgpipe" not in plans and set(plans) >= {"hand split", "autosplit"}
    measured = {compare.plan_key(p): name for name, p in reversed(list(plans.items()))}
    times = {label: [0.1] for label in ["one device", *measured.values()]}
    result = compare.assemble_case(case, profile, plans, notes, measured, {"times": times}, False)
    assert "torchgpipe" not in [r["name"] for r in result["rows"]]
    assert any("pip install torchgpipe==0.0.7" in note for note in result["notes"])


def test_torchgpipe_layers_map_to_autosplit_blocks() -> None:
    peer = load_benchmark("torchgpipe_peer")
    resnet = torchvision.models.resnet50()
    owners = [owner for owner, _ in peer.flatten("resnet50", resnet)]
    names = autosplit.trace(resnet).block_names
    assert len(owners) == 23 and list(dict.fromkeys(owners)) == list(names)
    assert peer.to_block_balance([12, 11], owners, names) == ((10, 9), [])  # cut before layer3.1
    balance, notes = peer.to_block_balance([3, 20], owners, names)  # between relu and maxpool
    assert balance == (2, 17) and "inside block bn1" in notes[0]
    gpt = load_benchmark("common").load_example("gpt").build_model("tiny")
    owners = [owner for owner, _ in peer.flatten("gpt-tiny", gpt)]
    names = autosplit.trace(gpt).block_names
    assert peer.to_block_balance([1, 4], owners, names) == ((2, 4), [])


def test_a_script_that_restarts_its_allocator_does_so_before_its_imports() -> None:
    """A script that starts again with the C allocator keeping freed memory (as the ranks run)
    does it first: every import after the restart would otherwise be paid twice (~2 s each)."""
    restarting = 0
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        if "restart_keeping_freed_memory()" not in text:
            continue
        restarting += 1
        body = [node for node in ast.parse(text).body
                if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
                and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
        first = body[0]
        assert isinstance(first, ast.If) and ast.unparse(first.test) == "__name__ == '__main__'", \
            f"{path.name}: the restart is not its first statement"
        assert "restart_keeping_freed_memory()" in ast.unparse(first), path.name
        assert text.count("restart_keeping_freed_memory()") == 1, path.name
    assert restarting >= 10


def test_no_benchmark_script_imports_another() -> None:
    """Scripts (files with a ``__main__`` block) share modules (harness, report, common, …), never
    each other."""
    files = {path.stem: path.read_text() for path in (ROOT / "benchmarks").glob("*.py")}
    scripts = {name for name, text in files.items() if 'if __name__ == "__main__":' in text}
    assert {"tutorial", "compare", "solvers", "planning", "analytic", "gpu_check",
            "layouts", "schedules"} <= scripts
    for name, text in files.items():
        imported = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        assert not imported & scripts, f"benchmarks/{name}.py imports {imported & scripts}"


@pytest.mark.long
def test_accuracy_benchmark_smoke(tmp_path) -> None:
    run_benchmark("accuracy.py", tmp_path)
    data = json.loads((tmp_path / "accuracy_smoke.json").read_text())
    with_torchgpipe = importlib.util.find_spec("torchgpipe") is not None
    models = {m["key"]: m for m in data["models"]}
    assert set(models) == {"resnet18"}  # bigvocab: the layouts smoke
    for key, model in models.items():
        assert len(model["profiles"]) == data["settings"]["profiles"] == 2
        expected = {"autosplit", "uniform", "by parameters", "one device"}
        expected |= {"torchgpipe"} if with_torchgpipe else set()
        expected |= {"hand split"} if key == "resnet18" else set()
        for prof in model["profiles"]:  # each profile's plans timed in its own rounds
            assert set(prof["plans"]) == expected
            # one device trained as its prediction runs it: in micro-batches or at once
            assert prof["plans"]["one device"]["split_size"] in (*prof["microbatch_sizes"], 8)
            assert all(r["predicted_ms"] > 0 and r["label"] in prof["measured"]
                       for r in prof["plans"].values())
            assert all(m["median_ms"] > 0 and m["n"] == 1 for m in prof["measured"].values())
        assert len(model["step_errors"]) == 2 * len(expected)
        assert all(e["error"] >= 0 for e in model["step_errors"])
        agree = model["agreement"]
        assert 1 <= agree["distinct"] <= 2 and 1 <= agree["agreeing"] <= 2
        together = model["agreement_measured"]  # distinct choices timed together, else None
        assert (together is None) == (agree["distinct"] == 1)
        if together is not None:
            assert len(together["measured"]) == agree["distinct"]
    assert [g["met"] in (True, False) for g in data["goals"]] == [True] * 4
    assert data["settings"]["torchgpipe"] == ("0.0.7" if with_torchgpipe else None)
    text = (tmp_path / "accuracy_smoke.md").read_text()
    assert "## Goals" in text and "| profile | autosplit / |" in text
    for model in models.values():  # each measured ratio with its spread over paired rounds
        for e in model["ratio_errors"]:
            assert e["measured_ratio_spread"] == 0.0  # one round: nothing to pair
            assert e["beyond_noise"] == (e["error"] != 0.0)
    assert "± (paired rounds)" in text and "Ratio errors larger than" in text
    for model in models.values():  # the interval autosplit prints, where both were verified
        for e in model["ratio_errors"]:
            if e["within_printed"] is not None:
                assert e["printed_low"] <= e["predicted_ratio"] <= e["printed_high"]
                assert e["within_printed"] == (
                    e["printed_low"] <= e["measured_ratio"] <= e["printed_high"])
    # the figures derived again from the saved results, nothing measured: the same report
    again = tmp_path / "again"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accuracy.py"), "--render",
                           str(tmp_path / "accuracy_smoke.json"), "--out", str(again)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rendered = json.loads((again / "accuracy.json").read_text())
    assert rendered["goals"] == data["goals"] and rendered["models"] == data["models"]
    assert (again / "accuracy.md").read_text() == text


def _refusal(script: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``benchmarks/<script>.py``'s main says on stderr given ``argv``, in this process,
    after checking that it exits with code 2 (the smoke tests run the scripts as commands)."""
    with pytest.raises(SystemExit) as exited:
        load_benchmark(script).main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_accuracy_render_never_overwrites_the_file_it_reads(tmp_path, capsys) -> None:
    saved = tmp_path / "accuracy.json"
    saved.write_text("{}")
    err = _refusal("accuracy", ["--render", str(saved), "--out", str(tmp_path)], capsys)
    assert "would overwrite" in err
    assert saved.read_text() == "{}"
    out = tmp_path / "out"  # a file that is not an accuracy.json: one line, nothing written
    err = _refusal("accuracy", ["--render", str(saved), "--out", str(out)], capsys)
    assert "not an accuracy.json" in err
    assert "Traceback" not in err and not out.exists()


def test_a_ratio_holds_when_the_measured_one_is_inside_the_printed_interval() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from accuracy_cases import printed_interval

    from autosplit.measure.spread import PREDICTION_ERROR

    auto = {"predicted_ms": 300.0, "step_spread": 0.01}
    one = {"predicted_ms": 400.0, "step_spread": 0.01}
    got = printed_interval(auto, one, 0.70)
    # 0.75 at ± 1 % each, widened by the prediction's error: about 0.713 … 0.789
    assert got["printed_low"] == pytest.approx(0.75 * 0.99 / 1.01 / (1 + PREDICTION_ERROR))
    assert got["printed_high"] == pytest.approx(0.75 * 1.01 / 0.99 * (1 + PREDICTION_ERROR))
    assert got["within_printed"] is False
    assert printed_interval(auto, one, 0.72)["within_printed"] is True
    unverified = printed_interval(auto, {"predicted_ms": 400.0, "step_spread": None}, 0.75)
    assert unverified == {"printed_low": None, "printed_high": None, "within_printed": None}


def test_one_device_runs_its_batch_as_its_prediction_does() -> None:
    """The harness's one device, in micro-batches of ``split`` (the plan's
    ``single_device_split``): the scaled losses' gradients add up to the whole batch's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness import one_device_parts

    from autosplit.measure.losses import tutorial_loss

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x, t = torch.randn(10, 6), torch.randn(10, 3)

    def grads(split: int | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        parts = one_device_parts((x,), (t,), split)
        for xs, ts, share in parts:  # as the harness's one device runs them
            (tutorial_loss(model(*xs), ts) * share).backward()
        return [q.grad.clone() for q in model.parameters()]

    assert [len(xs[0]) for xs, _, _ in one_device_parts((x,), (t,), 4)] == [4, 4, 2]
    assert len(one_device_parts((x,), (t,), None)) == len(one_device_parts((x,), (t,), 12)) == 1
    assert one_device_parts((x,), (t,), None)[0][2] == 1.0  # the batch at once: loss unscaled
    whole = grads(None)
    for split in (1, 3, 4, 10):
        for got, want in zip(grads(split), whole):
            torch.testing.assert_close(got, want)


def test_a_measured_ratio_is_known_to_its_paired_rounds_spread() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from accuracy_cases import paired_spread

    # per-round ratios 1 … 5: quartiles 2 and 4 around the median 3
    assert paired_spread([1, 2, 3, 4, 5], [1, 1, 1, 1, 1]) == pytest.approx(1 / 3)
    # drift that hits both plans alike in a round leaves the ratio exact
    assert paired_spread([1.0, 2.0, 1.5], [2.0, 4.0, 3.0]) == pytest.approx(0.0)
    assert paired_spread([1.0], [2.0]) == 0.0


def test_accuracy_smoke_never_writes_to_results(capsys) -> None:
    results = ROOT / "benchmarks" / "results"
    err = _refusal("accuracy", ["--smoke", "--out", str(results)], capsys)
    assert "--smoke never writes to benchmarks/results" in err


def test_torchgpipe_peer_balances_a_resnet_and_the_big_vocabulary_model() -> None:
    """torchgpipe 0.0.7's balance_by_time through the adapter (pip install '.[test]' has it)."""
    peer = load_benchmark("torchgpipe_peer")
    bigvocab = load_benchmark("common").load_example("bigvocab")
    torch.manual_seed(0)
    resnet, gpt = torchvision.models.resnet18(), bigvocab.build_model("tiny")
    owners = [owner for owner, _ in peer.flatten("gpt-bigvocab", gpt)]
    assert list(dict.fromkeys(owners)) == list(autosplit.trace(gpt).block_names)[1:]
    if peer.balance_by_time is None:
        pytest.skip("torchgpipe is not installed (pip install torchgpipe==0.0.7)")
    cases = [("resnet18", resnet, (torch.randn(4, 3, 32, 32),)),
             ("gpt-bigvocab", gpt, bigvocab.example_inputs(4, "tiny"))]
    for key, model, inputs in cases:
        names = autosplit.trace(model).block_names
        got = peer.torchgpipe_balance(key, model, inputs, 2, names, torch.device("cpu"))
        assert len(got["layer_balance"]) == 2 and sum(got["layer_balance"]) == got["layers"]
        assert len(got["balance"]) == 2 and sum(got["balance"]) == len(names)
        assert min(got["balance"]) >= 1 and got["sample_rows"] == 2


@pytest.mark.long
def test_layouts_benchmark_smoke(tmp_path) -> None:
    run_benchmark("layouts.py", tmp_path)
    data = json.loads((tmp_path / "layouts_smoke.json").read_text())
    # the all-reduce as `autosplit plan` takes it: from the test's own machine cache (conftest's
    # made-up figures; tests/test_topology.py measures it)
    assert data["settings"]["allreduce_source"].startswith("from the machine cache")
    assert data["settings"]["allreduce_bytes_per_s"] == 1e9
    models = {m["key"]: m for m in data["models"]}
    assert set(models) == {"resnet18", "bigvocab"}
    for key, model in models.items():
        plans = model["plans"]
        assert set(plans) == {"autosplit", "data parallel", "best pipeline"} | (
            {"hand split"} if key == "resnet18" else set())
        assert (plans["data parallel"]["layout"], plans["best pipeline"]["layout"]) == (
            "1 × 2", "2 × 1")  # ranks × replicas: a pipeline of any searched schedule
        from autosplit.validation import KNOWN_SCHEDULES
        assert all(r["schedule"].split(",")[0] in KNOWN_SCHEDULES for r in plans.values())
        assert plans["autosplit"]["label"] in {r["label"] for name, r in plans.items()
                                               if name != "autosplit"} | {"autosplit"}
        assert all(r["label"] in model["measured"] and r["predicted_ms"] > 0
                   for r in plans.values())
        best = min(x["median_ms"] for x in model["measured"].values())
        assert model["choice_vs_best"] == best / plans["autosplit"]["measured_ms"] <= 1
    assert data["goals"]["choice_vs_best"] == min(m["choice_vs_best"] for m in models.values())
    assert "## Goals" in (tmp_path / "layouts_smoke.md").read_text()


@pytest.mark.long
def test_schedules_benchmark_smoke(tmp_path) -> None:
    run_benchmark("schedules.py", tmp_path)
    data = json.loads((tmp_path / "schedules_smoke.json").read_text())
    models = {m["key"]: m for m in data["models"]}
    assert set(models) == {"resnet18"}  # bigvocab: the layouts smoke
    for key, model in models.items():
        plans = model["plans"]
        assert "autosplit" in plans and ("hand split (GPipe)" in plans) == (key == "resnet18")
        assert {"gpipe", "1f1b"} <= {r["schedule"] for r in plans.values()}
        assert all(r["label"] in model["measured"] and r["predicted_ms"] > 0
                   for r in plans.values())
        for r in plans.values():  # every rank's peak measured, and set against the plan's
            assert len(r["measured_peak_bytes"]) == len(r["memory_per_rank_bytes"]) == 2
            assert all(q > 0 for q in r["measured_peak_bytes"])
            assert r["memory_errors"] == [(p - q) / q for p, q in zip(
                r["memory_per_rank_bytes"], r["measured_peak_bytes"])]
        # the choice as the command makes it: the best plan at its micro-batch size by block
        # sums (no schedule's best at that size beats it), chosen on a verification
        auto = plans["autosplit"]
        same_size = [r["block_sum_ms"] for name, r in plans.items()
                     if r["split_size"] == auto["split_size"]
                     and not name.startswith(("hand split", "autosplit"))]
        assert all(auto["block_sum_ms"] <= t * (1 + 1e-9) for t in same_size)
        assert model["choice"].startswith(("chosen among the", "the only candidate"))
    resnet = models["resnet18"]
    assert resnet["vs_hand"] == (resnet["plans"]["hand split (GPipe)"]["measured_ms"]
                                 / resnet["plans"]["autosplit"]["measured_ms"])
    assert resnet["limited"]["memory_bytes"] < resnet["limited"]["hand_needs_bytes"]
    assert data["goals"]["vs_hand"] == resnet["vs_hand"]
    assert data["goals"]["memory_error"] == max(
        abs(e) for m in models.values() for r in m["plans"].values() for e in r["memory_errors"])
    text = (tmp_path / "schedules_smoke.md").read_text()
    assert "## Goals" in text and "as `autosplit plan` makes it: " in text


LEAD_IN_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from harness import Config, Group, ModelSpec, measure
if __name__ == "__main__":
    spec = ModelSpec("resnet18", 2, (3, 16, 16))
    groups = [Group(name, spec, (Config("one device", None),), rounds=2, warmup=1, lead_in_s=lead,
                    settle_rounds=0, retries=0, more_rounds=0)  # (settling, retries: own tests)
              for name, lead in (("led", 0.5), ("plain", 0.0))]
    got = measure(groups, nprocs=2, timeout_s=120)
    print(json.dumps({name: {"leads": g["lead_in_steps"], "times": g["times"], "run": g["steps_run"]}
                      for name, g in got.items()}))
"""


def test_a_short_step_is_timed_after_steps_of_its_own(tmp_path) -> None:
    """The harness's lead-in: a configuration whose warm-up step took less than lead_in_s runs
    ceil(lead_in_s / step) untimed steps before each timing; none without a lead-in."""
    script = tmp_path / "lead_in.py"
    script.write_text(LEAD_IN_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(ROOT / "benchmarks")],
                          capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["plain"]["leads"] == {"one device": 0}
    led = got["led"]["leads"]["one device"]  # (how many depends on the step: see below)
    for name, lead in (("led", led), ("plain", 0)):
        assert len(got[name]["times"]["one device"]) == 2
        assert got[name]["run"] == {"one device": 1 + 2 * (lead + 1)}  # warm-up, 2 timings


def test_lead_in_steps_fill_the_lead_in_with_the_configurations_own_steps() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness import lead_in_steps

    assert lead_in_steps(1.0, 0.3) == 4  # 1.2 s of its own steps before each timing
    assert lead_in_steps(1.0, 0.25) == 4
    assert lead_in_steps(0.5, 0.0) == 500  # (a step timed at 0: 1 ms assumed)
    assert lead_in_steps(1.0, 1.0) == lead_in_steps(1.0, 3.0) == 0  # long enough already
    assert lead_in_steps(0.0, 0.1) == 0  # no lead-in asked for
    assert lead_in_steps(1.0, float("inf")) == 0  # no step seen


FRESH_RUNNER = """
import json, mmap, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from harness import Group, ModelSpec, _rounds, page_faults

def fresh_runner(fresh):
    # a configuration whose runs for which fresh(call number) holds touch 4 MiB of fresh
    # pages and take 0.5 s, the others touch none and take 0.01 s
    def run(lead=0):
        run.calls += 1
        before = page_faults()
        touched = fresh(run.calls)
        if touched:
            block = mmap.mmap(-1, 4 << 20)
            block.write(b"x" * (4 << 20))
            block.close()
        run.faults = page_faults() - before
        return 0.5 if touched else 0.01
    run.calls, run.faults = 0, 0
    return run
"""

SETTLING_SCRIPT = FRESH_RUNNER + """
def runner(fresh_runs):  # its first fresh_runs runs fault
    return fresh_runner(lambda call: call <= fresh_runs)

if __name__ == "__main__":
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
    out = {}
    for name, fresh, settle, warmup in (("settles", 3, 10, 1), ("limited", 10, 2, 1),
                                        ("quiet", 0, 10, 1), ("no warm-up", 10, 10, 0)):
        group = Group(name, ModelSpec("resnet18", 2), (), rounds=2, warmup=warmup, retries=0,
                      settle_rounds=settle)
        runners = {"A": runner(fresh), "B": runner(0)}
        _, load, _ = _rounds(group, ["A", "B"], runners, 2, warmup, 0, "round")
        out[name] = {k: load[k] for k in ("settling_rounds", "unsettled", "faulted_timings")}
        out[name]["calls"] = runners["A"].calls
    dist.destroy_process_group()
    print(json.dumps(out))
"""


def _one_rank_script(tmp_path: Path, text: str) -> Any:
    """Run ``text`` as a script with the benchmarks folder and a FileStore path as its
    arguments (a one-rank gloo group of its own); the JSON its last line prints."""
    script = tmp_path / "script.py"
    script.write_text(text)
    done = subprocess.run([sys.executable, str(script), str(ROOT / "benchmarks"),
                           str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_untimed_rounds_go_on_until_no_step_faults_in_fresh_memory(tmp_path) -> None:
    """After the warm-up round, the harness runs untimed rounds while a configuration's steps
    fault in fresh memory (at most settle_rounds); timings that still do are counted."""
    got = _one_rank_script(tmp_path, SETTLING_SCRIPT)
    # warm-up and settling rounds 1, 2 fault; round 3 does not; then 2 timed rounds
    assert got["settles"] == {"settling_rounds": 3, "unsettled": [], "faulted_timings": 0,
                              "calls": 1 + 3 + 2}
    # the limit reached: still faulting, and so are both timings
    assert got["limited"] == {"settling_rounds": 2, "unsettled": ["A"], "faulted_timings": 2,
                              "calls": 1 + 2 + 2}
    assert got["quiet"] == {"settling_rounds": 0, "unsettled": [], "faulted_timings": 0,
                            "calls": 1 + 2}
    assert got["no warm-up"] == {"settling_rounds": 0, "unsettled": [], "faulted_timings": 2,
                                 "calls": 2}


RETAKE_SCRIPT = FRESH_RUNNER + """
def runner(fresh_calls):  # the runs numbered in fresh_calls fault
    return fresh_runner(lambda call: call in fresh_calls)

if __name__ == "__main__":
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
    out = {}
    # call 1: the warm-up; 2 and 3: the timed rounds; call 3 faults (and 4 too for "twice")
    for name, fresh, retries in (("retaken", {3}, 3), ("twice", {3, 4}, 3), ("kept", {3}, 0),
                                 ("limit", {3, 4, 5}, 1)):
        group = Group(name, ModelSpec("resnet18", 2), (), rounds=2, warmup=1, retries=retries)
        runners = {"A": runner(fresh)}
        times, load, _ = _rounds(group, ["A"], runners, 2, 1, 0, "round")
        out[name] = {k: load[k] for k in ("retaken_fresh", "faulted_timings", "retried")}
        out[name].update(calls=runners["A"].calls, times=times["A"])
    dist.destroy_process_group()
    print(json.dumps(out))
"""


def test_a_timing_whose_steps_fault_in_fresh_memory_is_taken_again(tmp_path) -> None:
    """After settling, a timed run that faults in fresh memory on a rank is timed again (within
    the retries), and the load says so; with no retries left it is kept and counted."""
    got = _one_rank_script(tmp_path, RETAKE_SCRIPT)
    assert got["retaken"] == {"retaken_fresh": 1, "faulted_timings": 0, "retried": 0,
                              "calls": 4, "times": [0.01, 0.01]}
    assert got["twice"] == {"retaken_fresh": 2, "faulted_timings": 0, "retried": 0,
                            "calls": 5, "times": [0.01, 0.01]}
    assert got["kept"] == {"retaken_fresh": 0, "faulted_timings": 1, "retried": 0,
                           "calls": 3, "times": [0.01, 0.5]}
    assert got["limit"] == {"retaken_fresh": 1, "faulted_timings": 1, "retried": 0,
                            "calls": 4, "times": [0.01, 0.5]}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import settling_words

    assert "1 timing(s) whose steps faulted in fresh memory taken again" in settling_words(
        {"retaken_fresh": 1})


MORE_ROUNDS_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from harness import Group, ModelSpec, _rounds

def runner(times):
    # a configuration whose n-th timing takes times[n] seconds (the last one from then on)
    def run(lead=0):
        run.calls += 1
        return times[min(run.calls, len(times)) - 1]
    run.calls, run.faults = 0, 0
    return run

if __name__ == "__main__":
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
    out = {}
    for name, times, more in (("steady", [1.0], 4), ("noisy", [1.0, 2.0] * 5, 4),
                              ("calms", [1.0, 3.0, 1.0, 1.0], 4), ("off", [1.0, 2.0] * 5, 0)):
        group = Group(name, ModelSpec("resnet18", 2), (), rounds=3, warmup=0, retries=0,
                      more_rounds=more, max_spread=0.03)
        runners = {"A": runner(times), "B": runner([1.0])}
        got, load, _ = _rounds(group, ["A", "B"], runners, 3, 0, 0, "round")
        out[name] = {"extra": load["extra_rounds"], "A": got["A"], "B": len(got["B"])}
    dist.destroy_process_group()
    print(json.dumps(out))
"""


def test_timed_rounds_go_on_while_a_configurations_timings_spread(tmp_path) -> None:
    """After the timed rounds, whole rounds more (every configuration, so rounds stay paired)
    while some configuration's timings spread by more than max_spread, at most more_rounds."""
    got = _one_rank_script(tmp_path, MORE_ROUNDS_SCRIPT)
    assert got["steady"] == {"extra": 0, "A": [1.0, 1.0, 1.0], "B": 3}
    assert got["noisy"] == {"extra": 4, "A": [1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0], "B": 7}
    # 1, 3, 1 spread by half their IQR (1) over their median (1): 1, 3, 1, 1 still (25 %);
    # 1, 3, 1, 1, 1 no more (0)
    assert got["calms"] == {"extra": 2, "A": [1.0, 3.0, 1.0, 1.0, 1.0], "B": 5}
    assert got["off"] == {"extra": 0, "A": [1.0, 2.0, 1.0], "B": 3}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import lead_in_words, settling_words

    assert "2 more timed rounds: a configuration's timings spread" in settling_words(
        {"extra_rounds": 2})
    assert "up to 5 more timed rounds while a configuration's timings spread by over 3%" in (
        lead_in_words({"more_rounds": 5, "max_spread": 0.03}))


def test_retries_and_settle_rounds_take_whole_numbers_of_0_or_more(capsys) -> None:
    assert "--settle-rounds: a whole number of 0 or more; got '-1'" in _refusal(
        "accuracy", ["--settle-rounds", "-1"], capsys)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness import _count

    assert _count("0") == 0 and _count("10") == 10
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="0 or more"):
            _count(bad)


def test_more_rounds_take_a_count_and_max_spread_a_positive_number(capsys) -> None:
    assert "--max-spread: a number above 0; got '0'" in _refusal(
        "accuracy", ["--max-spread", "0"], capsys)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness import _fraction, add_load_arguments, load_options

    assert _fraction("0.03") == 0.03
    for bad in ("0", "-0.1", "x", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="above 0"):
            _fraction(bad)
    parser = argparse.ArgumentParser()
    add_load_arguments(parser)
    options = load_options(parser.parse_args(["--more-rounds", "2", "--max-spread", "0.05"]))
    assert (options["more_rounds"], options["max_spread"]) == (2, 0.05)
    assert load_options(parser.parse_args([]))["more_rounds"] == 5


def test_a_run_is_settled_under_one_mib_of_fresh_memory_on_every_rank() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness import SETTLED_BYTES, settled
    from report import settling_words

    assert SETTLED_BYTES == 1 << 20
    assert settled([0, 256], page_bytes=4096)  # 1 MiB: still settled
    assert not settled([0, 257], page_bytes=4096)
    assert not settled([16000, 0], page_bytes=4096)  # the big-vocabulary logits, 65 MB
    assert settled([])
    assert settling_words({}) == ""  # results written before the rule
    words = settling_words({"settling_rounds": 3, "unsettled": ["head cut"],
                            "faulted_timings": 2, "timings": 10})
    assert "3 untimed rounds after the warm-up" in words
    assert "head cut still did" in words and "2 of the 10 kept timings faulted" in words


@pytest.mark.long
def test_runtime_gap_benchmark_smoke(tmp_path) -> None:
    """Every action of torch's runtime timed inside it, the replay of those times, each rank's
    step taken apart."""
    run_benchmark("runtime_gap.py", tmp_path)
    data = json.loads((tmp_path / "runtime_gap_smoke.json").read_text())
    (m,) = data["models"]
    assert len(m["measured_ms"]) == data["settings"]["steps"] == 2
    # warm-up steps: 2 or more, while a step faulted in fresh memory, at most 60
    assert data["settings"]["min_warmup_steps"] == 2 <= m["warmup_steps"] <= 60
    stages = len(m["balance"])
    assert {f"{kind}{s}" for kind in "FB" for s in range(stages)} <= set(m["runtime"])
    assert m["replay_ms"] > 0 and m["predicted_ms"] > 0 and m["loss_ms"] > 0
    assert m["replay_mean_ms"] > 0 and m["replay_steps_ms"] > 0  # means; each step's own
    # each rank's stages timed in the rank too, with the other rank waiting and working
    every = {f"{kind}{s}" for kind in "FB" for s in range(stages)}
    for way in ("alone", "together", "by hand, alone", "by hand, together"):
        assert set(m["in_rank"][way]) == every and all(v > 0 for v in m["in_rank"][way].values())
    for parts, step in zip(m["per_rank"], [statistics.fmean(m["measured_ms"])] * 2):
        # the parts of a rank's step add up to the step (the rest is what no event covers)
        assert sum(parts.values()) == pytest.approx(step, rel=1e-9)
        assert parts["actions"] > 0
    delays = m["input_delays"]
    assert delays["count"] == 2 * 2 * m["microbatches"]  # per step: m forwards in, m backwards
    assert len(delays["per_step_ms"]) == 2
    assert "| replay of the runtime's own action times |" in (tmp_path / "runtime_gap_smoke.md").read_text()


def test_a_timing_is_disturbed_by_other_processes_and_by_the_hypervisor_alike() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness import disturbance

    # 2 cores for 1 s: the ranks used 1.8 core-s of the machine's 2.0 busy ones
    assert disturbance(2.0, 0.0, 1.8, 1.0, 2) == pytest.approx((0.1, True))
    # the same loss taken by the hypervisor instead of another process
    assert disturbance(1.8, 0.2, 1.8, 1.0, 2) == pytest.approx((0.1, True))
    assert disturbance(2.0, 0.2, 1.8, 1.0, 2) == pytest.approx((0.2, True))
    # the ranks' own time read above the machine's (clock granularity) is no negative loss
    assert disturbance(1.7, 0.0, 1.8, 1.0, 2) == pytest.approx((0.0, False))
    # under 0.05 core-s (five ticks of /proc/stat) cannot be judged
    assert disturbance(0.24, 0.0, 0.2, 0.1, 2)[1] is False


def test_the_load_sentence_names_the_hypervisor_only_where_it_was_counted() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import load_sentence

    load = {"others_share": 0.01, "others_cpu_s": 0.3, "wall_s": 30.0, "steal_s": 5.5,
            "retried": 2, "max_others": 0.1, "kept_over_limit": 0}
    assert "they took more than 10%" in load_sentence(load)  # written before it counted
    now = load_sentence({**load, "steal_counted": True})
    assert "the hypervisor took 6 core-s" in now
    assert "2 timing(s) during which other processes or the hypervisor took more than 10%" in now


def test_runtime_gap_runs_a_given_cut_scored_as_the_planner_scores_it() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    from runtime_gap import _balance, given_plan
    from synthetic import make_profile

    from autosplit.planner import plan_with_balance

    assert _balance("5,1") == (5, 1)
    for bad in ("5", "5,1,1", "0,6", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError, match="a cut into 2 stages"):
            _balance(bad)
    prof = make_profile([2, 4], [[1.0, 0.9], [2.0, 1.8], [0.5, 0.5]], batch_size=8)
    plan = given_plan(prof, (2, 1), 4, "gpipe")
    assert plan.balance == (2, 1) and plan.split_size == 4
    assert plan == plan_with_balance(prof, [2, 1], 4, options=PlanOptions(schedule="gpipe"))
    with pytest.raises(InvalidInputError, match="has 2 blocks; .* has 3"):
        given_plan(prof, (1, 1), 4, "gpipe")
    with pytest.raises(InvalidInputError, match="--split-size 3 was not profiled"):
        given_plan(prof, (2, 1), 3, "gpipe")


def test_runtime_gap_refuses_a_cut_of_other_blocks_before_measuring(capsys) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from runtime_gap import main

    with pytest.raises(SystemExit) as info:  # the smoke model has more than 2 blocks
        main(["--smoke", "--balance", "1,1", "--split-size", "2", "--out", "/nonexistent"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --balance 1,1 has 2 blocks; ") and "profile" not in err


def test_gpu_analytic_fits_the_kept_h200_profiles(tmp_path) -> None:
    """On the blocks measured on an H200 (committed by gpu_check.py), the spec fitted with a
    floor per operator follows every micro-batch size, also those held out of the fit; the
    efficiencies alone cannot (the blocks took the same time at every size there)."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_analytic.py"), "--out",
                    str(tmp_path)], capture_output=True, text=True, timeout=300, check=True)
    data = json.loads((tmp_path / "gpu_analytic.json").read_text())
    assert [run["model"] for run in data["runs"]] == ["ResNet", "GPT"]
    for run in data["runs"]:
        largest = max(run["sizes"])
        worst = {label: max(abs(e["total_error"]) for e in row["errors"].values())
                 for label, row in run["specs"].items()}
        assert worst["with floor, every size"] < 0.10
        assert worst[f"with floor, b={largest} only"] < 0.10  # the smaller sizes held out
        assert worst["efficiencies, every size"] > 0.3 and worst["before"] > 0.4
        assert run["specs"]["with floor, every size"]["op_overhead_s"] > 0
        for row in run["specs"].values():  # no fit makes the device faster than its peak
            assert 0 < row["efficiency"] <= 1 and 0 < row["bandwidth_efficiency"] <= 1
    assert "| with floor, every size |" in (tmp_path / "gpu_analytic.md").read_text()


def test_wait_benchmark_sums_up_runs_against_the_goals() -> None:
    """The wait benchmark's summary, on made-up runs (timing the commands takes minutes: the
    benchmark is run by hand, not by the suite)."""
    wait = load_benchmark("wait")
    after = wait.Revision("after", "HEAD", "abc", ROOT, 0)

    def run(command: str, cache: str, seconds: float, code: int | None = 0) -> Any:
        return wait.Run(1, command, "after", cache, seconds, code, cache == "warm", True, 0.5,
                        {"stages": 1, "replicas": 2, "split_size": 10, "schedule": "gpipe"}, "")

    runs = [run("toy", "cold", 35.0), run("toy", "warm", 12.0), run("partition-toy", "cold", 30),
            run("partition-toy", "warm", 13.0, None)]
    commands = [wait.COMMANDS["toy"], wait.COMMANDS["partition-toy"]]
    rows = {(r.command, r.cache): r for r in wait.summarize(runs, commands, [after])}
    assert rows["toy", "cold"].met is True and rows["toy", "warm"].met is False
    assert rows["partition-toy", "cold"].met is True  # 30 s ≤ the toy plan's 35 s
    assert rows["partition-toy", "warm"].met is False and rows["partition-toy", "warm"].failed == 1
    assert rows["toy", "warm"].median_s == 12.0 and rows["toy", "warm"].goal == "≤ 10 s"


def test_the_committed_accuracy_and_schedules_results_render_as_committed() -> None:
    """Measuring nothing, the reports of every model measured, also those without a hand split
    (the smoke runs take ResNet18 only): the saved JSON gives the committed Markdown again."""
    results = ROOT / "benchmarks" / "results"
    accuracy, schedules = load_benchmark("accuracy"), load_benchmark("schedules")
    saved = json.loads((results / "accuracy.json").read_text())
    assert {"bigvocab", "gpt-small"} <= {m["key"] for m in saved["models"]}
    again = accuracy.rederive(saved)
    assert again["models"] == saved["models"] and again["goals"] == saved["goals"]
    assert accuracy.markdown(again) == (results / "accuracy.md").read_text()
    saved = json.loads((results / "schedules.json").read_text())
    assert any("hand split (GPipe)" not in m["plans"] for m in saved["models"])
    assert schedules.markdown(saved) == (results / "schedules.md").read_text()


def test_the_split_rules_hf_transformers_measures_against() -> None:
    """torchtitan's even layers (``generate_llm_fqn_per_model_part(2, L)``: embedding and
    norm + head weighted as one layer each, the remainder to the first stage) and PiPPy's
    ``split_into_equal_size(2)`` (greedy on parameter bytes), as benchmarks/hf_transformers.py
    maps them to blocks; no model is built."""
    from synthetic import make_profile

    hf = load_benchmark("hf_transformers")
    llama = ["model.embed_tokens", "model.rotary_emb", *(f"model.layers.{i}" for i in range(8)),
             "model.norm", "lm_head"]
    # L = 8: 10 effective layers, 5 a stage; stage 0 has the embedding and layers 0-3
    assert hf.torchtitan_balance(llama, 8, "model.layers.") == (6, 6)
    gpt2 = ["transformer.wte", "transformer.wpe", *(f"transformer.h.{i}" for i in range(3)),
            "transformer.ln_f", "lm_head"]
    # L = 3: 5 effective layers, 3 then 2; stage 0 has the embeddings and layers 0-1
    assert hf.torchtitan_balance(gpt2, 3, "transformer.h.") == (4, 3)
    assert hf.torchtitan_balance(gpt2, 3, "transformer.h.", input_weight=2) == (3, 4)

    def pippy(param_bytes: list[int]) -> tuple[int, ...]:
        prof = make_profile([1], [[1.0]] * len(param_bytes), batch_size=2,
                            param_bytes=param_bytes)
        return hf.pippy_balance(prof)

    assert pippy([10, 10, 10, 10]) == (2, 2)  # the threshold is 20: two blocks fill it
    assert pippy([10, 10, 5, 15]) == (2, 2)
    assert pippy([5, 50, 5, 5]) == (1, 3)  # a block above the threshold starts a stage
    assert pippy([50, 5, 5, 5]) == (1, 3)  # … and is a stage of its own on an empty one


def test_model_zoo_benchmark_smoke(tmp_path) -> None:
    """One model that splits exactly and one that cannot be captured, each in its process."""
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    run_benchmark("model_zoo.py", tmp_path)
    rows = {r["model"]: r for r in
            json.loads((tmp_path / "model_zoo_smoke.json").read_text())["rows"]}
    squeezenet = rows["torchvision/squeezenet1_0"]
    assert squeezenet["capture"] == "fx" and squeezenet["blocks"] >= 4
    assert squeezenet["stages_2"] == squeezenet["stages_4"] == "equal"
    deberta = rows["DebertaV2ForSequenceClassification"]
    assert deberta["capture"] == "fails" and "leave labels out" in deberta["error"]
    text = (tmp_path / "model_zoo_smoke.md").read_text()
    assert "**1 of 2 entries enter and split exactly on 2 stages**" in text
