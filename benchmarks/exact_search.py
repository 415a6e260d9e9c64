"""Time the exact planner: the committed ResNet50 profile on 2 … 8 stages, and a synthetic
1,000-block model on 8 stages (GPipe and 1F1B). Prints one line per case; no file written.

    PYTHONPATH=. python benchmarks/exact_search.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import autosplit  # noqa: E402
from synthetic import make_profile  # noqa: E402


def timed(prof: autosplit.Profile, gpus: int, **kw: object) -> tuple[float, autosplit.Plan]:
    start = time.perf_counter()
    plan = autosplit.plan(prof, gpus=gpus, **kw)
    return time.perf_counter() - start, plan


def main() -> None:
    fixture = Path(__file__).resolve().parent.parent / "tests/fixtures/resnet50_profile.json"
    resnet = autosplit.Profile.load(fixture)
    for schedule in ("gpipe", "1f1b"):
        for gpus in range(2, 9):
            s, plan = timed(resnet, gpus, schedule=schedule)
            print(f"resnet50 {schedule} p={gpus}: {s:.3f} s, b={plan.split_size}, "
                  f"{plan.balance}")
    rng = np.random.default_rng(0)
    n = 1000
    per_sample = rng.uniform(0.5, 1.5, n)
    big = make_profile([4, 8], [[v, 0.9 * v] for v in per_sample], batch_size=64,
                       cut_bytes_per_sample=[int(x) for x in rng.integers(0, 10**6, n - 1)],
                       forward_share=rng.uniform(0.3, 0.4, n).tolist())
    for schedule in ("gpipe", "1f1b"):
        s, plan = timed(big, 8, schedule=schedule, bandwidth_bytes_per_s=1e9)
        print(f"1000 blocks {schedule} p=8: {s:.3f} s, b={plan.split_size}")


if __name__ == "__main__":
    main()
