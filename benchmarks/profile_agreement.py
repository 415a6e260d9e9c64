"""Do two successive profiles agree, and how far are block sums from stages run together?

ResNet50 at 64×64, batch 48, micro-batch sizes 8, 12, 16, 24, one CPU worker (1 thread):
profile twice in a row and print, per size, each profile's whole-model time (Σ fwd + bwd of
the blocks) and their difference; then plan for 2 devices and print the block-sum prediction
beside the verified one (each stage timed as it runs, interleaved with the others).

    PYTHONPATH=. python benchmarks/profile_agreement.py [--budget 60]

Numbers depend on the machine and its load: note both with the result.
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import os
import time

import torch
import torchvision

import autosplit
from autosplit import ProfileOptions
from autosplit.capture.trace import trace
from autosplit.comparison import manual_plan
from autosplit.planner import plan_candidates
from autosplit.verify.choice import verify_and_choose
from autosplit.verify.options import TimingOptions

SIZES = [8, 12, 16, 24]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per profile")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=10)
    x = torch.randn(48, 3, 64, 64)
    print(f"load average before: {os.getloadavg()}")
    profiles = []
    for run in (1, 2):
        start = time.perf_counter()
        profiles.append(autosplit.profile(model, x,
                                          options=ProfileOptions(microbatch_sizes=SIZES,
                                                                 budget_s=args.budget)))
        print(f"profile {run}: {time.perf_counter() - start:.0f} s")
    print("size  profile 1 (ms)  profile 2 (ms)  difference  median IQR/median of blocks")
    for k, b in enumerate(SIZES):
        totals = [sum(blk.fwd_ms[k] + blk.bwd_ms[k] for blk in p.blocks) for p in profiles]
        spread = sorted(
            (blk.fwd_iqr_ms[k] + blk.bwd_iqr_ms[k]) / (blk.fwd_ms[k] + blk.bwd_ms[k])
            for blk in profiles[1].blocks
        )[len(profiles[1].blocks) // 2]
        diff = totals[1] / totals[0] - 1
        print(f"{b:4d}  {totals[0]:14.1f}  {totals[1]:14.1f}  {diff:+10.1%}  {spread:.1%}")
    for run, p in enumerate(profiles, start=1):
        per_sample = ", ".join(
            f"b={b}: {p.blocks[0].fwd_ms[k] / b:.2f}" for k, b in enumerate(SIZES)
        )
        print(f"profile {run}, first block forward per sample (ms): {per_sample}")
    prof = profiles[1]
    candidates = plan_candidates(prof, 2, top_k=3)
    hand = manual_plan(prof, ["layer3"], 8)
    shown = {f"candidate b={c.split_size} {c.balance}": c for c in candidates}
    shown["hand split (layer3)"] = hand
    best, others = verify_and_choose(trace(model, example_inputs=(x,)), (x,), prof, candidates,
                                     shown, options=TimingOptions(budget_s=args.budget))
    print(f"\nchosen: b={best.split_size}, balance {best.balance}")
    print("plan                           b   block sums (ms)  verified (ms)")
    for label, before in shown.items():
        after = others[label]
        print(f"{label:30s} {after.split_size:<3d} {before.predicted_step_ms:15.0f}  "
              f"{after.predicted_step_ms:11.0f} ± {after.step_spread:.0%}")
        for s in after.stages:
            print(f"   stage {s.index}: block sum {s.block_sum_ms:.1f} ms, run together "
                  f"{s.compute_ms:.1f} ms ± {s.verified_spread:.0%}")
    print()
    print(best)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
