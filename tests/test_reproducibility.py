"""How far a measured ratio moves between windows: benchmarks/reproducibility.py and the
accuracy benchmark's ratios of the same two plans measured in several profiles' windows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_window_summary_scores_the_predictions_made_without_each_window() -> None:
    from reproducibility import window_summary

    got = window_summary([1.0, 1.1, 0.95])
    assert got["median"] == 1.0 and (got["min"], got["max"]) == (0.95, 1.1)
    assert got["range"] == pytest.approx(1.1 / 0.95 - 1)
    # the geometric middle of the range, √(1.1 × 0.95), errs by the same on both ends
    assert got["best_single"] == pytest.approx(math.sqrt(1.1 / 0.95) - 1)
    middle = math.sqrt(1.1 * 0.95)
    assert middle / 0.95 - 1 == pytest.approx(1.1 / middle - 1) == got["best_single"]
    # the previous window as the prediction: 1.0 for 1.1 (−9.1 %), 1.1 for 0.95 (+15.8 %)
    assert got["previous_window"] == {"largest": pytest.approx(1.1 / 0.95 - 1),
                                      "within_goal": 0, "count": 2}
    # the other windows' median: 1.025 for 1.0 (+2.5 %), 0.975 for 1.1, 1.05 for 0.95
    assert got["other_windows"] == {"largest": pytest.approx(1 - 0.975 / 1.1),
                                    "within_goal": 1, "count": 3}
    steady = window_summary([0.8, 0.81, 0.805])
    assert steady["previous_window"]["within_goal"] == 2 and steady["best_single"] < 0.01
    with pytest.raises(ValueError, match="positive"):
        window_summary([1.0, 0.0])
    with pytest.raises(ValueError, match="positive"):
        window_summary([])


def _profile(p: int, auto: tuple[list[int], int], others: dict[str, tuple[list[int], int]],
             ratios: dict[str, float]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rows = {"autosplit": {"balance": auto[0], "split_size": auto[1]}}
    rows |= {name: {"balance": b, "split_size": s} for name, (b, s) in others.items()}
    return {"plans": rows}, [{"profile": p, "plan": name, "measured_ratio": r}
                             for name, r in ratios.items()]


def test_repeated_ratios_are_the_same_two_plans_measured_in_several_windows() -> None:
    from accuracy_cases import GOALS, goals, repeated_ratios

    cut = ([9, 10], 15)
    profiles, ratio_errors = [], []
    for p, (one, uniform) in enumerate([(0.62, 0.96), (0.66, 0.95), (0.63, 0.97)], start=1):
        # uniform and by parameters alike: one measurement of the profile, named twice
        prof, errs = _profile(p, cut, {"one device": ([19], 15), "uniform": ([10, 9], 15),
                                       "by parameters": ([10, 9], 15)},
                              {"one device": one, "uniform": uniform, "by parameters": uniform})
        profiles.append(prof)
        ratio_errors += errs
    # profile 3's hand split is measured in no other window: not repeated
    profiles[2]["plans"]["hand split"] = {"balance": [9, 10], "split_size": 20}
    ratio_errors.append({"profile": 3, "plan": "hand split", "measured_ratio": 0.98})
    model = {"profiles": profiles, "ratio_errors": ratio_errors}
    got = {tuple(r["plans"]): r for r in repeated_ratios(model)}
    assert set(got) == {("one device",), ("uniform", "by parameters")}
    one = got[("one device",)]
    assert one["profiles"] == [1, 2, 3] and one["measured"] == [0.62, 0.66, 0.63]
    assert one["range"] == pytest.approx(0.66 / 0.62 - 1)
    assert one["best_single"] == pytest.approx(math.sqrt(0.66 / 0.62) - 1)  # 3.2 %: beyond 3 %
    assert got[("uniform", "by parameters")]["measured"] == [0.96, 0.95, 0.97]
    # another autosplit plan in a profile is another pair of plans
    profiles[1]["plans"]["autosplit"] = {"balance": [10, 9], "split_size": 15}
    moved = {tuple(r["plans"]): r for r in repeated_ratios(model)}
    assert moved[("one device",)]["profiles"] == [1, 3]
    # the goals table counts the repeated ratios no one number can be within 3 % of
    scored = {"step_errors": [{"error": 0.01}], "ratio_errors": [
        {"error": 0.01, "beyond_noise": False, "within_printed": True}],
        "agreement": {"agreeing": 3, "profiles": 3}, "repeated_ratios": list(got.values())}
    ratio_goal = goals([scored])[2]
    assert ratio_goal["repeated"] == {"ratios": 2, "beyond_goal": 1,
                                      "best_single": pytest.approx(math.sqrt(0.66 / 0.62) - 1)}
    assert one["best_single"] > GOALS["ratio"] > got[("uniform", "by parameters")]["best_single"]


@pytest.mark.long
def test_reproducibility_benchmark_smoke(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reproducibility.py"),
                           "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "reproducibility_smoke.json").read_text())
    assert data["settings"]["windows"] == 2 and data["settings"]["smoke"] is True
    (model,) = data["models"]
    assert len(model["windows"]) == 2
    for w in model["windows"]:  # every configuration timed in every window
        assert set(w["measured"]) == {"autosplit", "hand split", "one device"}
        assert all(x["median_ms"] > 0 and x["n"] == 1 for x in w["measured"].values())
    assert [(r["plan"], r["other"]) for r in model["ratios"]] == [
        ("autosplit", "hand split"), ("autosplit", "one device")]
    for r in model["ratios"]:
        values = [x["ratio"] for x in r["windows"]]
        assert values == [w["measured"]["autosplit"]["median_ms"]
                          / w["measured"][r["other"]]["median_ms"] for w in model["windows"]]
        assert r["range"] == pytest.approx(max(values) / min(values) - 1)
        assert r["previous_window"]["count"] == 1 and r["other_windows"]["count"] == 2
    text = (tmp_path / "reproducibility_smoke.md").read_text()
    assert "## Summary" in text and "| ResNet18 | autosplit / one device | 2 |" in text


def test_reproducibility_refuses_one_window_and_never_writes_smoke_to_results(capsys) -> None:
    from reproducibility import main

    for argv, said in ((["--windows", "1"], "--windows must be 2 or more"),
                       (["--smoke", "--out", str(ROOT / "benchmarks" / "results")],
                        "--smoke never writes to benchmarks/results")):
        with pytest.raises(SystemExit) as exited:  # before anything is measured
            main(argv)
        assert exited.value.code == 2
        assert said in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_accuracy_report_says_how_far_the_same_ratio_moved_between_windows() -> None:
    import accuracy

    def data(*measured: list[float]) -> dict[str, Any]:
        rows = [{"plans": ["one device"], "profiles": [1, 2, 3], "measured": m,
                 "range": max(m) / min(m) - 1, "best_single": math.sqrt(max(m) / min(m)) - 1}
                for m in measured]
        return {"models": [{"model": "Big vocabulary", "repeated_ratios": rows}]}

    (wide,) = accuracy.repeated_sentence(data([1.028, 1.056, 0.990], [0.80, 0.81]))[1:]
    assert "2 ratios, whose measured values moved by up to 6.7% between windows" in wide
    assert "(Big vocabulary, autosplit / one device: 1.028, 1.056, 0.990)" in wide
    assert "for 1 of them no one number is within ±3% of every window's value" in wide
    (narrow,) = accuracy.repeated_sentence(data([0.80, 0.81]))[1:]
    assert "one number is within ±3% of every window's value of each" in narrow
    assert accuracy.repeated_sentence({"models": [{"model": "M", "repeated_ratios": []}]}) == []
