"""Each benchmark's --smoke variant runs from a checkout and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out), *extra],
        capture_output=True, text=True, timeout=120, check=True,
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


def test_analytic_benchmark_smoke(tmp_path) -> None:
    run_benchmark("analytic.py", tmp_path)
    data = json.loads((tmp_path / "analytic_smoke.json").read_text())
    assert [r["b"] for r in data["rows"]] == [16, 32]
    for r in data["rows"]:
        assert len(r["predicted_stage_ms"]) == 2 and all(v > 0 for v in r["measured_A_stage_ms"])
        assert 0 < r["efficiency"] <= 1.5
