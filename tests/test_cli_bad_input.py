"""Bad input to the command line, row by row: exit code 2 (1 for an internal error), exactly one
line on stderr and no traceback, no output written, every input file unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import suite_settings

from autosplit import cli
from autosplit.cli import main

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "examples" / "toy.py"
P = ["plan", "model.py", "--gpus", "2", "--profile", "prof.json"]  # a plan with no profiling
C = ["compare", "model.py", "--gpus", "2", "--profile", "prof.json"]
M = ["plan", "m.py", "--gpus", "2", "-o", "p.json"]  # with a model file m.py of the row's

EXIT_IN_BUILD = "import sys, torch\ndef build_model():\n    sys.exit(0)\n" \
    "def example_inputs(batch_size=4):\n    return torch.randn(batch_size, 10)\n"
EXIT_AT_IMPORT = "import sys\nsys.exit(0)\n"
EXIT_IN_INPUTS = "import sys, torch\ndef build_model():\n    return torch.nn.Linear(10, 5)\n" \
    "def example_inputs(batch_size=4):\n    sys.exit(3)\n"
ARGPARSE = "import argparse, torch\nparser = argparse.ArgumentParser()\n" \
    "parser.add_argument('--size', required=True)\nparser.parse_args()\n" \
    "def build_model():\n    return torch.nn.Linear(10, 5)\n"
DEEP = "[" * 100_000 + "]" * 100_000


@dataclass(frozen=True)
class Row:
    """argv, run in a folder holding model.py (the toy), prof.json (its profile at sizes 2, 4)
    and plan.json (a plan of it) plus ``files``: name → text, or "@prof", "@plan", "@dir",
    "@fifo" (a named pipe), "@link:TARGET" (a symbolic link), "@hard:TARGET" (a hard link)."""

    argv: list[str]
    match: str = ""
    codes: tuple[int, ...] = (2,)
    files: dict[str, str] = field(default_factory=dict)


ROWS: dict[str, Row] = {
    # outputs onto inputs
    "emit onto the model file": Row([*P, "-o", "out.json", "--emit", "model.py"],
                                    "is the model file"),
    "-o onto the model file": Row([*P, "-o", "model.py"], "is the model file"),
    "-o onto --profile": Row([*P, "-o", "prof.json"], "is --profile"),
    "default -o onto --profile": Row(["plan", "model.py", "--gpus", "2", "--profile", "plan.json"],
                                     "is --profile", files={"plan.json": "@prof"}),
    "-o onto a symlink to --profile": Row([*P, "-o", "link.json"], "is --profile",
                                          files={"link.json": "@link:prof.json"}),
    "-o onto a hard link to --profile": Row([*P, "-o", "hard.json"], "is --profile",
                                            files={"hard.json": "@hard:prof.json"}),
    "-o onto the model by another path": Row([*P, "-o", "./sub/../model.py"], "is the model file",
                                             files={"sub": "@dir"}),
    "profile -o onto the model file": Row(["profile", "model.py", "-o", "model.py"],
                                          "is the model file"),
    "calibrate -o onto --profile": Row(["calibrate", "model.py", "--profile", "prof.json",
                                        "--device", "cpu-core", "-o", "prof.json"], "is --profile"),
    "compare --plot onto the model": Row([*C, "--plot", "model.py"], "is the model file"),
    "show --plot onto the plan": Row(["show", "plan.json", "--plot", "plan.json"],
                                     "is the plan file"),
    "emit onto the --entry file": Row([*P, "--entry", "other.py:build_model", "--emit", "other.py",
                                       "-o", "out.json"], "is the --entry file",
                                      files={"other.py": TOY.read_text()}),
    "two outputs, one file": Row([*P, "-o", "same.json", "--emit", "./same.json"], "the same file"),
    # outputs that cannot be written: nothing is, not even the others
    "--emit into a missing folder": Row([*P, "-o", "p.json", "--emit", "nodir/x.py"],
                                        "does not exist"),
    "--plot into a missing folder": Row([*P, "-o", "p.json", "--plot", "nodir/x.png"],
                                        "does not exist"),
    "--plot with an unknown extension": Row([*P, "-o", "p.json", "--plot", "x.xyz"],
                                            "extension .xyz"),
    "--plot with no extension": Row([*P, "-o", "p.json", "--plot", "picture"], "no extension"),
    "-o onto a folder": Row([*P, "-o", "sub"], "is a folder", files={"sub": "@dir"}),
    "-o under a file": Row([*P, "-o", "model.py/p.json"], "is not a folder"),
    "-o onto a pipe": Row([*P, "-o", "fifo"], "not a regular file", files={"fifo": "@fifo"}),
    "-o into a read-only folder": Row([*P, "-o", "ro/p.json"], "not writable",
                                      files={"ro": "@dir"}),
    "fails after the checks": Row([*P, "-o", "p.json", "--emit", "e.py", "--memory", "1KiB"],
                                  "does not fit"),
    # values
    "--memory inf": Row([*P, "--memory", "inf"], "memory size must be a finite size"),
    "--memory nan": Row([*P, "--memory", "nan"], "memory size must be a finite size"),
    "--memory 0": Row([*P, "--memory", "0"], "memory size must be a finite size"),
    "--bandwidth inf": Row([*P, "--bandwidth=inf"], "bandwidth must be a finite size"),
    "--bandwidth 0": Row([*P, "--bandwidth=0"], "bandwidth must be a finite size"),
    "--bandwidth -1": Row([*P, "--bandwidth=-1"], "bandwidth must be a finite size"),
    "--bandwidth nan": Row([*P, "--bandwidth=nan"], "bandwidth must be a finite size"),
    "--batch-size 0": Row([*P, "--batch-size", "0"], "positive integer"),
    "--split-size not profiled": Row([*P, "--split-size", "3"], "was not profiled"),
    "--budget -1": Row(["profile", "model.py", "--budget", "-1", "-o", "p.json"], "non-negative"),
    "run --timeout inf": Row(["run", "model.py", "--plan", "plan.json", "--timeout", "inf"],
                             "finite"),
    "run --lr nan": Row(["run", "model.py", "--plan", "plan.json", "--lr", "nan"], "finite"),
    # corrupt record files: refused on load, naming the field
    "profile with micro-batch size 0": Row([*P, "--profile", "zero.json", "-o", "p.json"],
                                           "microbatch_sizes", files={"zero.json": "@zero"}),
    "deeply nested profile": Row([*P, "--profile", "deep.json", "-o", "p.json"], "nested",
                                 files={"deep.json": DEEP}),
    "deeply nested plan": Row(["show", "deep.json"], "nested", files={"deep.json": DEEP}),
    "show a plan with an empty stage": Row(["show", "empty.json"], "blocks is empty",
                                           files={"empty.json": "@empty"}),
    "run a plan with an empty stage": Row(["run", "model.py", "--plan", "empty.json"],
                                          "blocks is empty",
                                          files={"empty.json": "@empty"}),
    # model files that exit or parse the command line
    "sys.exit in build_model": Row(M, "called sys.exit(0) in build_model",
                                   files={"m.py": EXIT_IN_BUILD}),
    "sys.exit at import": Row(M, "called sys.exit(0) while being imported",
                              files={"m.py": EXIT_AT_IMPORT}),
    "sys.exit in example_inputs": Row(M, "called sys.exit(3) in example_inputs",
                                      files={"m.py": EXIT_IN_INPUTS}),
    "argparse in the model file": Row(M, "m.py: error: the following arguments are required",
                                      files={"m.py": ARGPARSE}),
    # the hand split's micro-batch size
    "--manual-split-size not profiled": Row([*C, "--manual", "net2", "--manual-split-size", "3"],
                                            "--manual-split-size 3 was not profiled"),
    "--manual-split-size over the batch": Row([*C, "--manual", "net2", "--manual-split-size", "40"],
                                              "larger than the batch 20"),
    "--manual-split-size with no hand split": Row([*C, "--manual-split-size", "4"],
                                                  "needs a hand split"),
    # devices in nodes
    "no device count": Row(P[:2] + P[4:], "give the device count"),
    "--nodes not dividing --gpus": Row([*P, "--nodes", "3"], "--nodes 3 does not divide --gpus 2"),
    "--gpus-per-node not dividing --gpus": Row([*P, "--gpus-per-node", "4"],
                                               "--gpus-per-node 4 does not divide --gpus 2"),
    "--gpus against nodes × per node": Row([*P, "--nodes", "2", "--gpus-per-node", "2"],
                                           "--gpus 2 differs from --nodes 2 × --gpus-per-node 2"),
    "--nodes alone": Row([*P[:2], *P[4:], "--nodes", "2"], "does not say how many devices"),
    "--nodes 0": Row([*P, "--nodes", "0"], "must be a positive integer"),
    "--inter-node-bandwidth without nodes": Row([*P, "--inter-node-bandwidth", "1GB"],
                                                "needs --nodes"),
    "--inter-node-bandwidth 0": Row([*P, "--nodes", "2", "--inter-node-bandwidth", "0"],
                                    "bandwidth"),
}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The toy model's profile (sizes 2, 4) and a plan, and broken variants of them (JSON); made
    under the suite's settings (a machine cache of its own: planning measures nothing of this
    machine)."""
    base = tmp_path_factory.mktemp("records")
    prof, plan = base / "prof.json", base / "plan.json"
    with suite_settings(base):
        assert main(["profile", str(TOY), "--microbatch-sizes", "2,4", "--repeats", "1",
                     "-o", str(prof)]) == 0
        assert main(["plan", str(TOY), "--gpus", "2", "--profile", str(prof), "--pipeline-only",
                     "-o", str(plan)]) == 0
    zero, empty = json.loads(prof.read_text()), json.loads(plan.read_text())
    zero["microbatch_sizes"][0] = 0
    empty["layout"]["stages"][1]["blocks"] = []
    return {"@prof": prof.read_text(), "@plan": plan.read_text(), "@zero": json.dumps(zero),
            "@empty": json.dumps(empty)}


def _make(folder: Path, files: dict[str, str], records: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        if text == "@dir":
            path.mkdir()
        elif text == "@fifo":  # a special file here, never /dev/null (a bug would replace it)
            os.mkfifo(path)
        elif text.startswith("@link:"):
            path.symlink_to(text.removeprefix("@link:"))
        elif text.startswith("@hard:"):
            os.link(folder / text.removeprefix("@hard:"), path)
        else:
            path.write_text(records.get(text, text))


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` (links too) → a hash of what it holds."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = "link to " + os.readlink(path)
        elif path.is_dir():
            out[key] = "folder"
        elif not path.is_file():
            out[key] = "special file"
        else:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def _assert_one_line(err: str, code: int) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("error: " if code != 1 else "internal error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str], records: dict[str, str]) -> None:
    row = ROWS[name]
    if name == "-o into a read-only folder" and os.geteuid() == 0:
        pytest.skip("root may write into a read-only folder")
    shutil.copy(TOY, tmp_path / "model.py")
    (tmp_path / "prof.json").write_text(records["@prof"])
    (tmp_path / "plan.json").write_text(records["@plan"])
    _make(tmp_path, row.files, records)
    if "ro" in row.files:
        (tmp_path / "ro").chmod(0o500)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    argv_before = list(sys.argv)
    code, err = _run(row.argv, capsys)
    assert code in row.codes, err
    line = _assert_one_line(err, code)
    assert row.match in line
    assert _snapshot(tmp_path) == before, "a file was written or changed"
    assert sys.argv == argv_before


def _workspace(tmp_path: Path, records: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(TOY, tmp_path / "model.py")
    (tmp_path / "prof.json").write_text(records["@prof"])
    (tmp_path / "plan.json").write_text(records["@plan"])
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("fault, code", [(OSError(28, "No space left on device"), 2),
                                         (RuntimeError("a bug\non two lines"), 1)])
def test_a_failing_output_leaves_no_output(fault: Exception, code: int, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str],
                                           records: dict[str, str]) -> None:
    """The figure, written last, fails: neither the plan nor the emitted code is written."""
    import autosplit.figures

    _workspace(tmp_path, records, monkeypatch)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise fault

    monkeypatch.setattr(autosplit.figures, "plan_figure", broken)
    before = _snapshot(tmp_path)
    got, err = _run([*P, "-o", "p.json", "--emit", "e.py", "--plot", "p.png"], capsys)
    assert got == code
    line = _assert_one_line(err, code)
    assert ("No space left on device" if code == 2 else "RuntimeError: a bug on two lines") in line
    assert _snapshot(tmp_path) == before


def test_a_failing_rename_restores_the_outputs_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        records: dict[str, str]) -> None:
    """-o is renamed into place, then --emit's rename fails: the old -o comes back."""
    import autosplit.cli.outputs

    _workspace(tmp_path, records, monkeypatch)
    (tmp_path / "p.json").write_text("the previous plan")
    replace = os.replace
    calls = []

    def flaky(src: Any, dst: Any) -> None:
        calls.append(dst)
        if str(dst) == "e.py":
            raise OSError(5, "Input/output error")
        replace(src, dst)

    monkeypatch.setattr(autosplit.cli.outputs.os, "replace", flaky)
    before = _snapshot(tmp_path)
    code, err = _run([*P, "-o", "p.json", "--emit", "e.py"], capsys)
    assert code == 2 and "rolled back" in _assert_one_line(err, code)
    targets = [c for c in calls if not Path(c).name.startswith(".")]  # not the staged files
    assert targets[:2] == ["p.json", "e.py"]
    assert _snapshot(tmp_path) == before


def test_interrupt_and_internal_error_are_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        records: dict[str, str]) -> None:
    _workspace(tmp_path, records, monkeypatch)

    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.show, "show_command", interrupted)
    code, err = _run(["show", "plan.json"], capsys)
    assert code == 130 and _assert_one_line(err, 2) == "error: interrupted"

    def bug(args: Any) -> int:
        raise KeyError("oops")

    monkeypatch.setattr(cli.show, "show_command", bug)
    code, err = _run(["show", "plan.json"], capsys)
    assert code == 1
    assert _assert_one_line(err, code) == ("internal error: KeyError: 'oops' (run with --debug "
                                           "for the traceback)")
    for argv in (["--debug", "show", "plan.json"], ["show", "plan.json", "--debug"]):
        with pytest.raises(KeyError, match="oops"):
            main(argv)


def test_model_files_see_only_their_own_path_in_sys_argv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        records: dict[str, str]) -> None:
    """A model file that parses the command line sees no arguments, and its stderr is kept."""
    _workspace(tmp_path, records, monkeypatch)
    (tmp_path / "parses.py").write_text(
        "import argparse, sys\nparser = argparse.ArgumentParser()\nparser.add_argument('--x')\n"
        "ARGS = parser.parse_args()\nprint('model file says hi', file=sys.stderr)\n"
        + TOY.read_text()
    )
    monkeypatch.setattr(sys, "argv", ["autosplit", "plan", "--weird-flag"])
    code, err = _run(["plan", "parses.py", "--gpus", "2", "--profile", "prof.json",
                      "-o", "p.json"], capsys)
    assert code == 0, err
    assert "model file says hi" in err
    assert sys.argv == ["autosplit", "plan", "--weird-flag"]
    assert json.loads((tmp_path / "p.json").read_text())["kind"] == "plan"


def test_the_hand_split_uses_the_size_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str],
                                            records: dict[str, str]) -> None:
    _workspace(tmp_path, records, monkeypatch)
    for size, layout in ((2, "10×2"), (4, "5×4")):
        assert main([*C, "--manual", "net2", "--manual-split-size", str(size)]) == 0
        row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("hand split"))
        assert layout in row, row


def test_outputs_are_written_with_the_usual_permissions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        records: dict[str, str]) -> None:
    """Not the private 0600 of a temporary file; an existing output keeps its mode."""
    _workspace(tmp_path, records, monkeypatch)
    (tmp_path / "old.json").write_text("")
    (tmp_path / "old.json").chmod(0o640)
    umask = os.umask(0o022)
    try:
        assert main([*P, "-o", "new.json", "--emit", "old.json"]) == 0
    finally:
        os.umask(umask)
    assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "old.json").stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py", "new.json", "old.json",
                                                          "plan.json", "prof.json"]
