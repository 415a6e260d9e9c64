"""The command line: happy paths of every command, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

from autosplit import __version__
from autosplit.cli import main

ROOT = Path(__file__).resolve().parent.parent
TOY = str(ROOT / "examples" / "toy.py")
FAST = ["--microbatch-sizes", "2,4", "--repeats", "1"]

SKIP_MODEL = '''
import torch
from torch import nn

class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.c(self.b(h) + h)

def build_model():
    return Skip()

def example_inputs(batch_size=8):
    return torch.randn(batch_size, 4)
'''


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version_and_help(capsys) -> None:
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out
    for command in ("profile", "plan", "compare", "show"):
        assert main([command, "--help"]) == 0
        assert "usage: autosplit " + command in capsys.readouterr().out


def test_profile_then_plan_then_show(tmp_path, capsys) -> None:
    prof = tmp_path / "profile.json"
    code, out, err = run(capsys, "profile", TOY, *FAST, "-o", str(prof))
    assert code == 0, err
    assert json.loads(prof.read_text())["kind"] == "profile"
    assert "measured micro-batch sizes 2, 4" in out

    plan = tmp_path / "plan.json"
    png = tmp_path / "plan.png"
    code, out, err = run(capsys, "plan", TOY, "--gpus", "2", "--profile", str(prof), "-o", str(plan),
                         "--plot", str(png), "--schedule", "1f1b", "--memory", "1GiB")
    assert code == 0, err
    assert "net1" in out and "net2" in out and "predicted step" in out
    assert json.loads(plan.read_text())["layout"]["schedule"] == "1f1b"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width >= 800 and height >= 400 and len(data) > 20_000

    code, out, err = run(capsys, "show", str(plan), "--model", TOY)
    assert code == 0, err
    assert "net1" in out and "1f1b" in out


def test_plan_profiles_when_no_profile_is_given(tmp_path, capsys) -> None:
    model = tmp_path / "skip.py"
    model.write_text(SKIP_MODEL)
    # --solver seeds the GPipe/1F1B search; --schedule auto's joint search does not use it
    code, out, err = run(capsys, "plan", str(model), "--gpus", "3", *FAST, "--solver", "milp",
                         "--schedule", "gpipe", "-o", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "profiling on CPU" in out and "solver milp" in out
    assert len(json.loads((tmp_path / "p.json").read_text())["layout"]["stages"]) == 3
    # the runtime's cost per action of the one schedule planned, not of every schedule
    costs = next(line for line in out.splitlines() if "pipeline runtime per action" in line)
    assert "gpipe" in costs and "1f1b" not in costs and "zbv" not in costs


def test_input_shape_instead_of_example_inputs(tmp_path, capsys) -> None:
    model = tmp_path / "bare.py"
    model.write_text("import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Linear(5, 1))\n")
    code, out, err = run(capsys, "plan", str(model), "--gpus", "2", "--input-shape", "5",
                         "--batch-size", "8", *FAST, "-o", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "batch 8" in out


def test_compare_shows_every_plan(tmp_path, capsys) -> None:
    png = tmp_path / "cmp.png"
    code, out, err = run(capsys, "compare", TOY, "--gpus", "2", "--manual", "net2",
                         "--manual-split-size", "4", *FAST, "--plot", str(png))
    assert code == 0, err
    for name in ("autosplit", "hand split", "uniform", "parameters", "torchgpipe"):
        assert name in out
    assert png.stat().st_size > 5000


def test_python_dash_m_works(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "autosplit", "--version"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == f"autosplit {__version__}"


def _one_line_error(capsys, tmp_path, *argv: str, match: str) -> None:
    before = set(tmp_path.iterdir())
    code = main(list(argv))
    _, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], lines[0]
    assert "Traceback" not in err
    assert set(tmp_path.iterdir()) == before, "a file was written"


def test_bad_inputs_are_one_line_errors(tmp_path, capsys) -> None:
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('broken on purpose')\n")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    other = tmp_path / "other.py"
    other.write_text(SKIP_MODEL)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{ this is not json")
    # a plan for the toy model, to be shown against another model
    toy_plan = tmp_path / "toy_plan.json"
    assert main(["plan", TOY, "--gpus", "2", *FAST, "-o", str(toy_plan)]) == 0
    capsys.readouterr()
    out = str(tmp_path / "never.json")
    cases = [
        (["plan", str(tmp_path / "missing.py"), "--gpus", "2", "-o", out], "does not exist"),
        (["plan", str(raising), "--gpus", "2", "-o", out], "RuntimeError: broken on purpose"),
        (["plan", str(empty), "--gpus", "2", "-o", out], "looked for build_model or model"),
        (["plan", TOY, "--gpus", "2", "--memory", "lots", "-o", out], "cannot read 'lots'"),
        (["plan", TOY, "--gpus", "0", "-o", out], "must be a positive integer, got 0"),
        (["plan", TOY, "--gpus", "5", "--pipeline-only", *FAST, "-o", out],
         "more than the model's 2 blocks"),
        (["plan", TOY, "--gpus", "2", "--memory", "1KiB", *FAST, "-o", out], "does not fit"),
        (["show", str(toy_plan), "--model", str(other)], "made for another model"),
        (["show", str(corrupt)], "not valid JSON"),
        (["show", str(tmp_path / "nope.json")], "does not exist"),
        (["plan", TOY, "--gpus", "2", "--profile", str(corrupt), "-o", out], "not valid JSON"),
        (["compare", TOY, "--gpus", "2", "--manual", "nowhere", *FAST], "unknown split point"),
        (["plan", TOY, "--gpus", "2", "--entry", "nothing_here", "-o", out], "looked for nothing_here"),
        (["plan", TOY, "--gpus", "2", "--microbatch-sizes", "0", "-o", out], "positive integers"),
    ]
    for argv, match in cases:
        _one_line_error(capsys, tmp_path, *argv, match=match)


def test_no_command_prints_help(capsys) -> None:
    assert main([]) == 2
    assert "usage: autosplit" in capsys.readouterr().out


def test_analytic_plan_for_a_named_device(tmp_path, capsys) -> None:
    gpt = str(ROOT / "examples" / "gpt.py")
    code, out, err = run(capsys, "plan", gpt, "--model-arg", "size=tiny", "--gpus", "2",
                         "--device", "h100-80gb", "--optimizer", "adam", "--batch-size", "8",
                         "-o", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "estimated GPT on h100-80gb" in out and "analytic on h100-80gb" in out
    assert "one device of 74.5 GiB could hold it too" in out
    assert json.loads((tmp_path / "p.json").read_text())["provenance"]["profile"].startswith("analytic")


def test_calibrate_then_plan_with_the_spec(tmp_path, capsys) -> None:
    gpt = str(ROOT / "examples" / "gpt.py")
    prof, spec = tmp_path / "measured.json", tmp_path / "spec.json"
    assert main(["profile", gpt, "--model-arg", "size=tiny", "--batch-size", "8",
                 "--microbatch-sizes", "4,8", "--repeats", "1", "-o", str(prof)]) == 0
    code, out, err = run(capsys, "calibrate", gpt, "--model-arg", "size=tiny", "--profile", str(prof),
                         "--device", "cpu-core", "-o", str(spec))
    assert code == 0, err
    assert "cpu-core: efficiency 0.500 →" in out
    fitted = json.loads(spec.read_text())
    assert fitted["efficiency"] != 0.5 and "calibrated on GPT" in fitted["source"]
    code, out, err = run(capsys, "plan", gpt, "--model-arg", "size=tiny", "--gpus", "2",
                         "--device-spec", str(spec), "--batch-size", "8", "-o", str(tmp_path / "p.json"))
    assert code == 0, err
    assert f"efficiency {fitted['efficiency']:.2f}" in out


def test_devices_lists_the_known_specs(capsys) -> None:
    code, out, _ = run(capsys, "devices")
    assert code == 0
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "rtx-4090"):
        assert name in out


def test_bad_device_names_and_spec_files(tmp_path, capsys) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "mine", "peak_bf16_flops_per_s": 1e12}))
    out = str(tmp_path / "never.json")
    _one_line_error(capsys, tmp_path, "plan", TOY, "--gpus", "2", "--device", "h100", "-o", out,
                    match="known devices are a100-40gb")
    _one_line_error(capsys, tmp_path, "plan", TOY, "--gpus", "2", "--device-spec", str(spec), "-o", out,
                    match="missing the field")
    _one_line_error(capsys, tmp_path, "plan", TOY, "--gpus", "2", "--model-arg", "nonsense", "-o", out,
                    match="not KEY=VALUE")


def test_compare_measure_trains_each_plan(tmp_path, capsys) -> None:
    import re

    code, out, err = run(capsys, "compare", TOY, "--gpus", "2", *FAST, "--measure", "--rounds", "2",
                         "--timeout", "60")
    assert code == 0, err
    assert "measured step" in out
    header, *rows = [line for line in out.splitlines() if line.startswith(("plan ", "autosplit ", "uniform "))]
    assert "measured step" in header
    # each plan's median and the range of its timed steps
    for row in rows:
        got = re.search(r"([\d.]+) ms \(([\d.]+)–([\d.]+) ms\)$", row.rstrip())
        assert got, row
        median, low, high = map(float, got.groups())
        assert low <= median <= high
    assert "the median of 2 timed step(s) per plan" in out


def test_comparison_table_measured_cells() -> None:
    from autosplit.report import _measured_cell

    assert _measured_cell(None) == "–"
    assert _measured_cell(5.23) == "5.2 ms"
    assert _measured_cell([5.6, 4.9, 5.2]) == "5.2 ms (4.9–5.6 ms)"
    assert _measured_cell([9_800.0, 10_200.0]) == "10.00 s (9800 ms–10.20 s)"  # units differ
    assert _measured_cell([12_000.0, 14_000.0]) == "13.00 s (12.00–14.00 s)"


def test_plan_emit_writes_an_importable_module(tmp_path, capsys) -> None:
    target = tmp_path / "pipelined_toy.py"
    code, _, err = run(capsys, "plan", TOY, "--gpus", "2", *FAST, "-o", str(tmp_path / "p.json"),
                       "--emit", str(target))
    assert code == 0, err
    text = target.read_text()
    assert "class PipelinedToyModel" in text and "autosplit plan" in text
    namespace: dict = {}
    exec(compile(text, str(target), "exec"), namespace)  # noqa: S102 - the emitted module
    import torch

    pipelined = namespace["PipelinedToyModel"](devices=["cpu", "cpu"])
    assert tuple(pipelined(torch.randn(8, 10)).shape) == (8, 5)


def test_a_plan_that_does_not_fit_says_what_to_try_with_the_commands_options(tmp_path,
                                                                              capsys) -> None:
    import re

    out = tmp_path / "p.json"
    code, _, err = run(capsys, "plan", TOY, "--gpus", "2", "--memory", "1KiB",
                       "--schedule", "gpipe", "--split-size", "4", *FAST, "--no-verify",
                       "-o", str(out))
    assert code == 2 and not out.exists()
    assert err.startswith("error: the model does not fit on 2 devices of 1.0 KiB"), err
    # the command's own options, not the library's keyword arguments
    assert "memory_per_gpu" not in err and "schedule='1f1b'" not in err, err
    assert "more devices than --gpus 2, --schedule 1f1b, a smaller --split-size or --memory " \
        in err, err
    enough = re.search(r"--memory (\S+)$", err.strip()).group(1)
    # the size it names is enough: the same command with it plans
    code, _, err = run(capsys, "plan", TOY, "--gpus", "2", "--memory", enough,
                       "--schedule", "gpipe", "--split-size", "4", *FAST, "--no-verify",
                       "-o", str(out))
    assert code == 0 and out.exists(), err


def test_size_at_least_reads_back_as_at_least_the_size() -> None:
    from autosplit.units import parse_bytes, size_at_least

    assert size_at_least(5130) == "5.1KiB" and size_at_least(512) == "512B"
    for n in (1, 1023.5, 1024, 5130, 3.3 * 2**20, 40 * 2**30 + 1):
        assert parse_bytes(size_at_least(n)) >= n


def test_run_shows_the_steps_range_and_the_prediction_with_its_spread() -> None:
    import dataclasses

    from synthetic import make_profile

    import autosplit
    from autosplit.cli.run import _against_plan
    from autosplit.distributed.job import RunResult

    plan = autosplit.plan(make_profile([2], [[1.0], [1.0]], batch_size=4), 2)
    steps = (0.030, 0.012, 0.010, 0.011)  # the first: the warm-up
    result = RunResult(2, steps, (steps, steps), (1.0,) * 4, "cpu", 1)
    sure = dataclasses.replace(plan, predicted_step_ms=10.0, step_spread=0.05)
    assert _against_plan(result, sure, "2 ranks") == (
        "median step 11.0 ms (10.0 ms–12.0 ms, 3 steps after the first) on 2 ranks (cpu) · the "
        "plan predicted 10.0 ms ± 5% · measured +10%")
    unverified = dataclasses.replace(sure, step_spread=None)
    one = RunResult(2, (0.009,), ((0.009,), (0.009,)), (1.0,), "cpu", 1)
    assert _against_plan(one, unverified, "2 ranks") == (
        "median step 9.0 ms (9.0 ms–9.0 ms, 1 step) on 2 ranks (cpu) · the plan predicted "
        "10.0 ms · measured -10%")


def test_budget_bounds_the_whole_command(tmp_path, capsys) -> None:
    plan = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", TOY, "--gpus", "2", *FAST, "--budget", "0",
                         "-o", str(plan))
    assert code == 0, err
    assert "not verified: verifying would take about" in out and "of --budget 0 s" in out
    assert "(block sums)" in out and plan.exists()
    code, out, err = run(capsys, "plan", TOY, "--gpus", "2", *FAST, "--budget", "600",
                         "-o", str(plan))
    assert code == 0, err
    assert "verified in" in out and "not verified:" not in out


def test_plan_measures_the_runtime_cost_of_only_the_schedules_that_can_win(
        tmp_path, capsys, monkeypatch) -> None:
    import os
    import time as clock

    from autosplit.measure import machine
    from autosplit.measure.machine_cache import MachineFigures, MachineKey, Measurers, save

    key = MachineKey.here("gloo", "cpu", threads=1)
    path = tmp_path / "machine.json"  # the collectives measured, no schedule's cost yet
    save(path, MachineFigures(key, clock.time(), 1e9, 0.5, 2e9, one_stage_action_ms=0.3,
                              one_stage_action_spread=0.05))
    monkeypatch.setenv("AUTOSPLIT_CACHE", str(path))
    asked: list[tuple[str, ...]] = []

    def actions(names):
        asked.append(tuple(names))
        return tuple((n, 1.0) for n in names), tuple((n, 0.1) for n in names)

    def collectives():
        raise AssertionError("the collectives were cached")

    monkeypatch.setattr(machine, "machine_measurers", lambda kind: (
        key, Measurers(collectives, actions, lambda: (0.3, 0.05))))
    assert os.environ["AUTOSPLIT_CACHE"] == str(path)
    code, out, err = run(capsys, "plan", TOY, "--gpus", "2", *FAST, "--no-verify",
                         "-o", str(tmp_path / "plan.json"))
    assert code == 0, err
    measured = [n for names in asked for n in names]
    assert measured and len(set(measured)) == len(measured)  # each at most once
    assert set(measured) <= {"gpipe", "1f1b"}  # the toy's 2 blocks run no v = 2 schedule
    assert len(asked) == 1  # two or fewer worth measuring: one round of ranks
    assert f"measured now: {', '.join(measured)}" in out
    assert "not measured: looped-bfs" in out
