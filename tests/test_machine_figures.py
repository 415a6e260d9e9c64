"""The machine's figures are measured once per machine and kept in a cache file; a cache that
is stale, foreign, corrupt or of another version is measured again, saying why in one line.
Synthetic measurements and a temporary cache file: nothing here reads this machine's cache."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from autosplit.measure.machine_cache import (
    MAX_AGE_S,
    MachineFigures,
    MachineKey,
    Measurers,
    cache_path,
    describe_age,
    figures_for,
    load,
)

KEY = MachineKey("host-a", "gloo", "cpu", 2, 1, "2.14.1")
NOW = 1_800_000_000.0


class Counting:
    """Synthetic measurers that count what they were asked to measure."""

    def __init__(self) -> None:
        self.collectives_calls = 0
        self.schedules: list[tuple[str, ...]] = []
        self.one_stage_calls = 0

    def measurers(self) -> Measurers:
        def collectives() -> tuple[float, float, float]:
            self.collectives_calls += 1
            return 2e9, 0.3, 1.5e9

        def actions(names: Sequence[str]) -> tuple[tuple[tuple[str, float], ...],
                                                   tuple[tuple[str, float], ...]]:
            self.schedules.append(tuple(names))
            return (tuple((n, 0.5 + i) for i, n in enumerate(names)),
                    tuple((n, 0.05) for n in names))

        def one_stage() -> tuple[float, float]:
            self.one_stage_calls += 1
            return 0.2, 0.01

        return Measurers(collectives, actions, one_stage)


def test_measured_once_then_taken_from_the_cache(tmp_path: Path) -> None:
    path, counting = tmp_path / "machine.json", Counting()
    first, note = figures_for(KEY, ("gpipe", "1f1b"), counting.measurers(), path=path, now=NOW)
    assert "measured the machine's figures (none measured on this machine yet)" in note
    assert counting.collectives_calls == 1 and counting.schedules == [("gpipe", "1f1b")]
    assert path.exists()
    again, note = figures_for(KEY, ("gpipe",), counting.measurers(), path=path, now=NOW + 7200)
    assert again == first and "measured 2 h ago" in note and "--remeasure" in note
    assert counting.collectives_calls == 1 and counting.schedules == [("gpipe", "1f1b")]
    assert again.profile_fields() == {
        "allreduce_bytes_per_s": 2e9, "allreduce_latency_ms": 0.3, "link_bytes_per_s": 1.5e9,
        "action_ms": (("gpipe", 0.5), ("1f1b", 1.5)),
        "action_spread": (("gpipe", 0.05), ("1f1b", 0.05)),
        "one_stage_action_ms": 0.2, "one_stage_action_spread": 0.01}


def test_only_the_missing_schedules_are_measured(tmp_path: Path) -> None:
    path, counting = tmp_path / "machine.json", Counting()
    figures_for(KEY, ("gpipe",), counting.measurers(), path=path, now=NOW)
    figures, note = figures_for(KEY, ("gpipe", "zbv"), counting.measurers(), path=path, now=NOW)
    assert counting.schedules == [("gpipe",), ("zbv",)] and counting.collectives_calls == 1
    assert dict(figures.action_ms).keys() == {"gpipe", "zbv"} and "zbv measured now" in note
    assert dict(load(path, KEY, NOW)[0].action_ms).keys() == {"gpipe", "zbv"}  # kept


@pytest.mark.parametrize("spoil, why", [
    (lambda path: path.write_text("{not json"), "is unreadable (JSONDecodeError)"),
    (lambda path: path.write_text(json.dumps({"version": 99, "machines": {}})),
     "of another version"),
    (lambda path: _edit(path, lambda e: e.update(measured_at=NOW - MAX_AGE_S - 86400)),
     "8 days old"),
    (lambda path: _edit(path, lambda e: e["key"].update(torch="2.0.0")),
     "of another machine (host-a/gloo/cpu×2/1 thread/torch 2.0.0)"),
    (lambda path: _edit(path, lambda e: e.update(link_bytes_per_s=-1)), "is unreadable"),
    (lambda path: _edit(path, lambda e: e.pop("allreduce_latency_ms")), "is unreadable"),
])
def test_a_spoilt_cache_is_measured_again_saying_why(tmp_path: Path, spoil, why: str) -> None:
    path, counting = tmp_path / "machine.json", Counting()
    figures_for(KEY, ("gpipe",), counting.measurers(), path=path, now=NOW)
    spoil(path)
    figures, note = figures_for(KEY, ("gpipe",), counting.measurers(), path=path, now=NOW)
    assert counting.collectives_calls == 2 and why in note and "\n" not in note
    assert load(path, KEY, NOW) == (figures, "")  # written again, readable


def test_remeasure_and_other_machines(tmp_path: Path) -> None:
    path, counting = tmp_path / "machine.json", Counting()
    figures_for(KEY, ("gpipe",), counting.measurers(), path=path, now=NOW)
    _, note = figures_for(KEY, ("gpipe",), counting.measurers(), path=path, now=NOW,
                          remeasure=True)
    assert counting.collectives_calls == 2 and "(--remeasure)" in note
    other = dataclasses.replace(KEY, host="host-b")
    _, note = figures_for(other, ("gpipe",), counting.measurers(), path=path, now=NOW)
    assert "none measured for host-b/" in note and counting.collectives_calls == 3
    assert load(path, KEY, NOW)[0] is not None and load(path, other, NOW)[0] is not None


def test_a_gpu_measures_no_runtime_cost(tmp_path: Path) -> None:
    counting = Counting()
    measurers = dataclasses.replace(counting.measurers(), actions=None, one_stage=None)
    key = dataclasses.replace(KEY, backend="nccl", device="NVIDIA H100")
    figures, _ = figures_for(key, ("gpipe",), measurers, path=tmp_path / "m.json", now=NOW)
    assert figures.action_ms == () and counting.schedules == []
    assert "action_ms" not in figures.profile_fields()
    again, note = figures_for(key, ("gpipe",), measurers, path=tmp_path / "m.json", now=NOW)
    assert again == figures and "from" in note and counting.collectives_calls == 1


def test_the_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AUTOSPLIT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path() == tmp_path / "autosplit" / "machine.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_path() == Path.home() / ".cache" / "autosplit" / "machine.json"
    assert [describe_age(s) for s in (40, 180, 7200, 86400, 9 * 86400)] == [
        "40 s", "3 min", "2 h", "1 day", "9 days"]


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    (entry,) = data["machines"].values()
    change(entry)
    path.write_text(json.dumps(data))


def test_figures_round_trip() -> None:
    figures = MachineFigures(KEY, NOW, 1e9, 0.1, 2e9, (("gpipe", 0.4),), (("gpipe", 0.02),),
                             0.3, 0.01)
    assert MachineFigures.from_json(json.loads(json.dumps(figures.to_json()))) == figures


def test_figures_at_hand_measure_only_what_they_lack(tmp_path: Path) -> None:
    path, counting = tmp_path / "machine.json", Counting()
    first, _ = figures_for(KEY, (), counting.measurers(), path=path, now=NOW)
    assert counting.schedules == [] and counting.one_stage_calls == 1
    path.unlink()  # the cache is not read when the figures are at hand
    more, _ = figures_for(KEY, ("zbv",), counting.measurers(), path=path, now=NOW, have=first)
    assert counting.collectives_calls == 1 and counting.schedules == [("zbv",)]
    assert dict(more.action_ms) == {"zbv": 0.5}
    assert more.allreduce_bytes_per_s == first.allreduce_bytes_per_s
    assert path.exists()


def test_a_cold_cache_starts_the_cpu_ranks_once_for_the_collectives_and_the_one_stage_cost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Between CPU workers the all-reduce, the link and the one-stage runtime's cost are
    measured on one launch of the ranks: the one-stage measurer then takes what it brought."""
    from synthetic import make_profile

    from autosplit.measure import machine, runtime_cost
    from autosplit.measure.collectives import AllReduceCost, Collectives

    launches: list[int] = []

    def measured() -> machine.CpuMachine:
        launches.append(1)
        return machine.CpuMachine(Collectives(AllReduceCost(1e9, 0.5), 2e9),
                                          (0.3, 0.1))

    def never() -> tuple[float, float]:
        raise AssertionError("a second launch")

    monkeypatch.setattr(machine, "measure_cpu_machine", measured)
    monkeypatch.setattr(runtime_cost, "measure_one_stage_action_ms", never)
    prof = make_profile([1], [[1.0]], batch_size=2)  # measured on a CPU worker
    _, measurers = machine.machine_measurers(prof.device.kind)
    assert measurers.collectives() == (1e9, 0.5, 2e9)
    assert measurers.one_stage() == (0.3, 0.1)
    assert launches == [1]


def test_the_cpu_machine_is_measured_on_one_launch_of_two_ranks() -> None:
    from autosplit.measure.machine import measure_cpu_machine

    machine = measure_cpu_machine(nbytes=2**17, link_bytes=2**16, repeats=1)
    found = machine.collectives
    assert found.allreduce.bus_bytes_per_s > 0 and found.allreduce.latency_ms > 0
    assert found.link_bytes_per_s > 0
    ms, spread = machine.one_stage_action
    assert ms >= 0 and spread >= 0
