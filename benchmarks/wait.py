"""How long a user waits for the planning commands, before and after, with the machine-figures
cache cold and warm, side by side in one run.

Each command runs as its own process, as a user runs it, timed by the wall clock around it
(``time.perf_counter`` around ``subprocess.run``): the interpreter's start, importing torch and
autosplit, profiling, measuring the machine and planning all count. Its outputs go to a fresh
scratch folder, which is also its working directory.

The commands (``--only`` picks some by name):

- ``toy``: ``autosplit plan examples/toy.py --gpus 2`` (goal: ≤ 40 s cold, ≤ 10 s warm)
- ``resnet50``: ``autosplit plan examples/resnet50.py --gpus 2`` (≤ 90 s cold, ≤ 60 s warm)
- ``resnet50-no-verify``: the same with ``--no-verify`` (≤ 40 s warm)
- ``profile-toy``: ``autosplit profile examples/toy.py -o p.json`` (no goal)
- ``partition-toy``: ``python -c`` loading examples/toy.py and calling
  ``autosplit.partition(model, inputs, gpus=2)`` (goal: no longer than ``toy``, same revision
  and cache)

The revisions: "after" is this checkout's work tree, as it is now; "before" (``--before REF``)
is another commit of the same repository, checked out for the run in a temporary git worktree
(removed at the end). Each runs as ``python -m autosplit`` with ``PYTHONPATH`` set to its own
tree, so its own code is imported (checked before timing), on its own examples/.

The cache: the machine's figures (all-reduce, link, the runtime's cost per action) are kept in
the file ``$AUTOSPLIT_CACHE`` names (``autosplit.measure.machine_cache.cache_path``). Cold: a file not
there yet, in a fresh empty folder. Warm: the file the cold run of the same command and
revision just wrote. Code without the cache ignores the variable: cold and warm then differ by
noise alone, which is the truth about that code. Whether the cold run left a cache file is
recorded.

The order: in each round, for each command, for each revision, cold then warm; ``--rounds N``
repeats it. A goal is met only by the measured median, and only when every run succeeded.
Each run's plan (stages, replicas, micro-batch size, schedule) is read from the file it wrote.

    python benchmarks/wait.py --before 85e4eed             # writes benchmarks/results/wait.{json,md}
    python benchmarks/wait.py --before 85e4eed --rounds 3 --only toy,partition-toy
    python benchmarks/wait.py --smoke                      # toy only, after only, 1 round
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, command_line, describe, machine, write_results

ROOT = Path(__file__).resolve().parent.parent
CACHES = ("cold", "warm")
TAIL_CHARS = 2000

PARTITION_SNIPPET = """\
import dataclasses, importlib.util, json, sys
import autosplit
spec = importlib.util.spec_from_file_location("toy", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
model, inputs = module.build_model(), module.example_inputs()
if isinstance(inputs, dict):
    pm = autosplit.partition(model, (), inputs, gpus=2)
else:
    pm = autosplit.partition(model, inputs, gpus=2)
plan = getattr(pm, "plan", None)
if plan is not None:
    with open(sys.argv[2], "w") as f:
        json.dump(dataclasses.asdict(plan), f, default=str)
"""


@dataclass(frozen=True)
class Goal:
    """Seconds not to exceed, cold and warm; or no longer than another command's median."""

    cold_s: float | None = None
    warm_s: float | None = None
    no_longer_than: str | None = None

    def words(self, cache: str) -> str:
        if self.no_longer_than:
            return f"≤ {self.no_longer_than}"
        limit = self.cold_s if cache == "cold" else self.warm_s
        return "–" if limit is None else f"≤ {limit:g} s"


@dataclass(frozen=True)
class Command:
    """One command a user waits for; ``argv`` from the revision's tree and the scratch folder."""

    name: str
    words: str
    argv: Callable[[Path, Path], list[str]]
    output: str
    goal: Goal


def _cli(*words: str, model: str, output: str) -> Callable[[Path, Path], list[str]]:
    def argv(tree: Path, scratch: Path) -> list[str]:
        return [sys.executable, "-m", "autosplit", words[0], str(tree / "examples" / model),
                *words[1:], "-o", str(scratch / output)]
    return argv


def _partition(tree: Path, scratch: Path) -> list[str]:
    return [sys.executable, "-c", PARTITION_SNIPPET, str(tree / "examples" / "toy.py"),
            str(scratch / "plan.json")]


COMMANDS = {c.name: c for c in (
    Command("toy", "autosplit plan examples/toy.py --gpus 2",
            _cli("plan", "--gpus", "2", model="toy.py", output="plan.json"), "plan.json",
            Goal(cold_s=40, warm_s=10)),
    Command("resnet50", "autosplit plan examples/resnet50.py --gpus 2",
            _cli("plan", "--gpus", "2", model="resnet50.py", output="plan.json"), "plan.json",
            Goal(cold_s=90, warm_s=60)),
    Command("resnet50-no-verify", "autosplit plan examples/resnet50.py --gpus 2 --no-verify",
            _cli("plan", "--gpus", "2", "--no-verify", model="resnet50.py", output="plan.json"),
            "plan.json", Goal(warm_s=40)),
    Command("profile-toy", "autosplit profile examples/toy.py -o p.json",
            _cli("profile", model="toy.py", output="p.json"), "", Goal()),
    Command("partition-toy", "autosplit.partition(model, inputs, gpus=2) on examples/toy.py",
            _partition, "plan.json", Goal(no_longer_than="toy")),
)}


@dataclass(frozen=True)
class Revision:
    """The code timed: ``tree`` is imported (``PYTHONPATH``) and its examples/ are used."""

    label: str
    ref: str
    commit: str
    tree: Path
    changed_files: int


@dataclass(frozen=True)
class Run:
    """One timed process."""

    round: int
    command: str
    revision: str
    cache: str
    seconds: float
    returncode: int | None  # None: killed at --timeout
    cache_file_before: bool
    cache_file_after: bool
    loadavg_1min: float
    choice: dict[str, Any] | None
    stderr_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass(frozen=True)
class Row:
    """The runs of one command, revision and cache, summed up against the goal."""

    command: str
    revision: str
    cache: str
    seconds: tuple[float, ...]
    failed: int
    median_s: float | None
    min_s: float | None
    max_s: float | None
    goal: str
    met: bool | None  # None: no goal, or nothing to compare with
    choices: tuple[str, ...]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def after_revision() -> Revision:
    changed = [line for line in _git("status", "--porcelain", "--untracked-files=no").splitlines()
               if line.strip()]
    return Revision("after", "work tree", _git("rev-parse", "--short", "HEAD"), ROOT, len(changed))


@contextmanager
def before_revision(ref: str) -> Iterator[Revision]:
    """``ref`` checked out in a temporary git worktree, removed afterwards."""
    commit = _git("rev-parse", "--short", f"{ref}^{{commit}}")
    tree = Path(tempfile.mkdtemp(prefix="autosplit-before-"))
    _git("worktree", "add", "--detach", str(tree), commit)
    try:
        yield Revision("before", ref, commit, tree, 0)
    finally:
        _git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tree, ignore_errors=True)


def environment(revision: Revision, cache_file: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(revision.tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["AUTOSPLIT_CACHE"] = str(cache_file)
    return env


def check_import(revision: Revision) -> str:
    """The autosplit a revision's processes import; it must be its own tree's."""
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [sys.executable, "-c", "import autosplit; print(autosplit.__file__)"], cwd=scratch,
            env=environment(revision, Path(scratch) / "machine.json"), capture_output=True,
            text=True, timeout=300, check=False)
    where = done.stdout.strip()
    if done.returncode != 0 or not Path(where).resolve().is_relative_to(revision.tree.resolve()):
        raise SystemExit(f"the {revision.label} revision imports autosplit from {where!r}, "
                         f"not from {revision.tree}: {done.stderr[-TAIL_CHARS:]}")
    return where


def plan_choice(path: Path) -> dict[str, Any] | None:
    """What a written plan chose: stages, blocks per stage, replicas, micro-batch, schedule."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    choice: dict[str, Any] = {}
    stages = data.get("stages")
    if isinstance(stages, list):
        choice["stages"] = len(stages)
        choice["balance"] = [len(s["blocks"]) for s in stages
                             if isinstance(s, dict) and isinstance(s.get("blocks"), list)]
    for key in ("replicas", "split_size", "microbatches", "schedule", "predicted_step_ms"):
        if key in data:
            choice[key] = data[key]
    return choice or None


def choice_words(choice: dict[str, Any] | None) -> str:
    if not choice:
        return "–"
    parts = []
    if "balance" in choice:
        parts.append(f"{choice['balance']} × {choice.get('replicas', 1)}")
    if "split_size" in choice:
        parts.append(f"b={choice['split_size']}")
    if "schedule" in choice:
        parts.append(str(choice["schedule"]))
    return ", ".join(parts) or "–"


def time_one(command: Command, revision: Revision, cache: str, cache_file: Path, round_: int,
             timeout_s: float) -> Run:
    """One process of ``command`` in a fresh scratch folder, wall-clock timed."""
    with tempfile.TemporaryDirectory(prefix="autosplit-wait-") as name:
        scratch = Path(name)
        before = cache_file.exists()
        load = os.getloadavg()[0]
        start = time.perf_counter()
        try:
            done = subprocess.run(command.argv(revision.tree, scratch), cwd=scratch,
                                  env=environment(revision, cache_file), capture_output=True,
                                  text=True, timeout=timeout_s, check=False)
            code, stderr = done.returncode, done.stderr
        except subprocess.TimeoutExpired as expired:
            code = None
            stderr = (expired.stderr.decode(errors="replace")
                      if isinstance(expired.stderr, bytes) else expired.stderr or "")
        seconds = time.perf_counter() - start
        choice = plan_choice(scratch / command.output) if command.output and code == 0 else None
    run = Run(round_, command.name, revision.label, cache, seconds, code, before,
              cache_file.exists(), load, choice, "" if code == 0 else stderr[-TAIL_CHARS:])
    status = "ok" if run.ok else ("timed out" if code is None else f"FAILED (exit {code})")
    print(f"  round {round_ + 1} {command.name:<19} {revision.label:<6} {cache}: "
          f"{seconds:7.1f} s {status}; {choice_words(choice)}", flush=True)
    return run


def measure(commands: Sequence[Command], revisions: Sequence[Revision], rounds: int,
            timeout_s: float) -> list[Run]:
    runs = []
    for round_ in range(rounds):
        for command in commands:
            for revision in revisions:
                with tempfile.TemporaryDirectory(prefix="autosplit-cache-") as folder:
                    cache_file = Path(folder) / "machine.json"  # not there yet: cold
                    for cache in CACHES:  # warm: the file the cold run wrote
                        runs.append(time_one(command, revision, cache, cache_file, round_,
                                             timeout_s))
    return runs


def summarize(runs: Sequence[Run], commands: Sequence[Command],
              revisions: Sequence[Revision]) -> list[Row]:
    medians: dict[tuple[str, str, str], float | None] = {}
    groups: dict[tuple[str, str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.command, run.revision, run.cache), []).append(run)
    for key, group in groups.items():
        ok = [r.seconds for r in group if r.ok]
        medians[key] = statistics.median(ok) if ok and len(ok) == len(group) else None
    rows = []
    for command in commands:
        for revision in revisions:
            for cache in CACHES:
                key = (command.name, revision.label, cache)
                group = groups.get(key, [])
                ok = [r.seconds for r in group if r.ok]
                rows.append(Row(
                    command.name, revision.label, cache, tuple(r.seconds for r in group),
                    sum(not r.ok for r in group),
                    statistics.median(ok) if ok else None, min(ok) if ok else None,
                    max(ok) if ok else None, command.goal.words(cache),
                    met(command.goal, cache, medians.get(key),
                        medians.get((command.goal.no_longer_than or "", revision.label, cache))),
                    tuple(dict.fromkeys(choice_words(r.choice) for r in group if r.ok))))
    return rows


def met(goal: Goal, cache: str, median: float | None, other_median: float | None) -> bool | None:
    """Whether the median (of runs that all succeeded) meets the goal; None without one."""
    if goal.no_longer_than:
        if other_median is None:
            return None if median is not None else False
        return median is not None and median <= other_median
    limit = goal.cold_s if cache == "cold" else goal.warm_s
    if limit is None:
        return None
    return median is not None and median <= limit


def revision_words(revision: Revision) -> str:
    if revision.label == "after":
        return (f"after: the work tree at {revision.commit}"
                f"{f' with {revision.changed_files} changed files' if revision.changed_files else ''}")
    return f"before: {revision.ref} ({revision.commit})"


def markdown(data: dict[str, Any], rows: Sequence[Row], runs: Sequence[Run]) -> str:
    s = data["settings"]
    title = "How long a user waits for planning" + (
        " (SMOKE: the toy command, after only, 1 round)" if s["smoke"] else "")
    lines = [f"# {title}", "", describe(s["machine"]), "",
             f"`{s['command']}`; {s['rounds']} round(s), each: {s['order']}; every run its own "
             f"process, wall clock around it (interpreter start and imports included), killed "
             f"after {s['timeout_s']:g} s. Cold: {s['cold']}. Warm: {s['warm']}. Revisions: "
             + "; ".join(s["revision_words"]) + ". A goal is met by the median of runs that all "
             "succeeded.", "",
             "| command | revision | cache | median s | min–max s | failed | goal | met | plan |",
             "|---|---|---|---|---|---|---|---|---|"]
    words = {c["name"]: c["words"] for c in s["commands"]}
    for r in rows:
        median = "–" if r.median_s is None else f"{r.median_s:.1f}"
        spread = "–" if r.min_s is None else f"{r.min_s:.1f}–{r.max_s:.1f}"
        mark = {True: "yes", False: "no", None: "–"}[r.met]
        lines.append(f"| `{words[r.command]}` | {r.revision} | {r.cache} | {median} | {spread} | "
                     f"{r.failed} of {len(r.seconds)} | {r.goal} | {mark} | "
                     f"{'; '.join(r.choices) or '–'} |")
    loads = [r.loadavg_1min for r in runs]
    if loads:
        lines += ["", f"1-minute load average at the runs' starts: {min(loads):.1f}–"
                  f"{max(loads):.1f} (the previous run's own load included)."]
    cached = [r for r in runs if r.cache == "cold" and r.ok]
    if cached:
        lines += ["", "Cache file left by the cold runs: " + "; ".join(sorted(
            {f"{r.command} {r.revision}: {'yes' if r.cache_file_after else 'no'}"
             for r in cached})) + "."]
    failures = [r for r in runs if not r.ok]
    if failures:
        lines += ["", "## Failed runs", ""]
        for r in failures:
            last = r.stderr_tail.strip().splitlines()[-1:] or ["(no output)"]
            code = "timed out" if r.returncode is None else f"exit {r.returncode}"
            lines.append(f"- round {r.round + 1}, {r.command}, {r.revision}, {r.cache}: {code}: "
                         f"`{last[0][:300]}`")
    return "\n".join(lines) + "\n"


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMMANDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"names among {', '.join(COMMANDS)}; got {text!r}")
    return names


def _rounds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of 1 or more; got {text!r}")
    return value


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row], list[Run]]:
    names = ["toy"] if args.smoke else (args.only or list(COMMANDS))
    commands = [COMMANDS[n] for n in names]
    rounds = 1 if args.smoke else args.rounds
    before_ref = None if args.smoke else args.before
    if args.smoke and args.before:
        print(f"--smoke: after only, --before {args.before} left out", flush=True)
    started = time.perf_counter()
    with _revisions(before_ref) as revisions:
        imported = {r.label: check_import(r) for r in revisions}
        print(f"timing {', '.join(names)}: {len(revisions)} revision(s), cold and warm, "
              f"{rounds} round(s)", flush=True)
        runs = measure(commands, revisions, rounds, args.timeout)
    rows = summarize(runs, commands, revisions)
    settings = {
        "machine": machine(), "command": args.command, "smoke": args.smoke, "rounds": rounds,
        "timeout_s": args.timeout,
        "order": "for each command, for each revision, cold then warm",
        "cold": "$AUTOSPLIT_CACHE names a file not there yet, in a fresh empty folder",
        "warm": "the cache file the cold run of the same command and revision wrote",
        "revisions": [{**dataclasses.asdict(r), "tree": str(r.tree),
                       "imports": imported[r.label]} for r in revisions],
        "revision_words": [revision_words(r) for r in revisions],
        "commands": [{"name": c.name, "words": c.words, "goal": dataclasses.asdict(c.goal)}
                     for c in commands],
        "python": sys.executable,
    }
    data = {
        "settings": settings,
        "runs": [dataclasses.asdict(r) for r in runs],
        "rows": [dataclasses.asdict(r) for r in rows],
        "phases_seconds": {"total": time.perf_counter() - started},
    }
    return data, rows, runs


@contextmanager
def _revisions(before_ref: str | None) -> Iterator[list[Revision]]:
    if before_ref is None:
        yield [after_revision()]
        return
    with before_revision(before_ref) as before:
        yield [before, after_revision()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", metavar="REF", default=None,
                        help="the revision to time beside the work tree (default: none)")
    parser.add_argument("--only", metavar="NAME[,NAME]", type=_names, default=None,
                        help=f"commands to time, among {', '.join(COMMANDS)} (default: all)")
    parser.add_argument("--rounds", type=_rounds, default=1,
                        help="runs of each command, revision and cache (default 1)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds after which a run is killed and counted failed")
    parser.add_argument("--smoke", action="store_true",
                        help="the toy command once, after only, cold and warm")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results")
    args = parser.parse_args(argv)
    args.command = command_line("wait.py", sys.argv[1:] if argv is None else list(argv))
    data, rows, runs = run(args)
    stem = "wait_smoke" if args.smoke else "wait"
    text = markdown(data, rows, runs)
    write_results(args.out, stem, data, text)
    print(text)
    print(f"wrote {args.out / (stem + '.json')} and .md", flush=True)


if __name__ == "__main__":
    main()
