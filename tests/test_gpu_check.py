"""benchmarks/gpu_check.py: its dry run takes every step on the CPU; without a GPU it stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autosplit

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.py")


@pytest.mark.long
def test_dry_run_takes_every_step_on_the_cpu(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    steps = {r["name"]: r for r in data["steps"]}
    assert list(steps) == ["tests", "resnet50", "memory", "analytic", "gpt", "bf16"]
    assert {r["status"] for r in steps.values()} == {"ok"}, {
        name: r.get("error") for name, r in steps.items()}
    assert data["settings"]["dry_run"] and data["settings"]["devices"] == ["cpu", "cpu"]
    assert steps["tests"]["result"]["counts"].get("failed", 0) == 0
    runs = [steps["resnet50"]["result"], steps["gpt"]["result"], *steps["bf16"]["result"].values()]
    for run in runs:
        assert sum(run["balance"]) > 0 and len(run["balance"]) == 2
        assert run["expected_ms"] == pytest.approx(run["serial_ms"])  # both stages on the CPU
        for key in ("partition", "emitted"):
            assert len(run[key]["samples"]) == 2 and run[key]["median"] > 0
        assert run["emitted_vs_partition_max_abs_diff"] == 0.0  # same modules, same batch
    # the dry run takes the GPT only in bfloat16 (a CPU's bfloat16 convolutions are slow)
    assert {k: r["dtype"] for k, r in steps["bf16"]["result"].items()} == {
        "gpt": "torch.bfloat16"}
    (device,) = steps["memory"]["result"]["devices"]
    assert device["stages"] == [0, 1] and device["predicted_bytes"] == sum(
        steps["memory"]["result"]["stage_predicted_bytes"])
    analytic = steps["analytic"]["result"]
    assert analytic["spec"] == "cpu-core" and set(analytic["before"]["errors"]) == {"2", "4"}
    assert analytic["calibrated"]["efficiency"] != analytic["before"]["efficiency"]
    for which in ("resnet", "gpt"):  # the measured blocks, kept for fitting without a GPU
        saved = autosplit.Profile.load(tmp_path / f"gpu_profile_{which}.json")
        assert saved.microbatch_sizes == (2, 4) and len(saved.blocks) == sum(
            steps["resnet50" if which == "resnet" else "gpt"]["result"]["balance"])
    for run in runs:
        assert run["verified_expected_ms"] > 0 and "verified_error_text" not in run
        assert len(run["verified_stage_compute_ms"]) == 2
    text = (tmp_path / "gpu.md").read_text()
    assert "## Plan against measured step" in text and "## Analytic cpu-core" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_one_line_and_exit_0(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.count("\n") == 1 and "no CUDA device" in done.stdout
    assert not any(tmp_path.iterdir())


def test_spec_is_found_from_the_device_name() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import spec_for

    assert spec_for("NVIDIA H200") == "h200"
    assert spec_for("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert spec_for("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert spec_for("NVIDIA A100-PCIE-40GB") == "a100-40gb"
    assert spec_for("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert spec_for("NVIDIA L4") == "l4"
    with pytest.raises(LookupError, match="no known spec matches 'Tesla T4'"):
        spec_for("Tesla T4")
