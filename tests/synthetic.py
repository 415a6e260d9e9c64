"""Hand-made profiles: exact numbers for planner tests, no model needed."""

from __future__ import annotations

from collections.abc import Sequence

from autosplit.records import BlockProfile, CutProfile, DeviceInfo, Profile


def make_profile(
    sizes: Sequence[int],
    ms_per_sample: Sequence[Sequence[float]],
    *,
    batch_size: int,
    param_bytes: Sequence[int] | None = None,
    saved_bytes_per_sample: Sequence[int] | None = None,
    cut_bytes_per_sample: Sequence[int] | None = None,
    fingerprint: str = "synthetic",
) -> Profile:
    """A profile of n blocks where block i costs ``ms_per_sample[i][k] · b`` ms at size index k.

    Forward takes a third of that time and backward two thirds.
    """
    n = len(ms_per_sample)
    params = param_bytes or [0] * n
    saved = saved_bytes_per_sample or [0] * n
    cuts = cut_bytes_per_sample or [0] * (n - 1)
    blocks = tuple(
        BlockProfile(
            name=f"block{i}",
            param_bytes=params[i],
            buffer_bytes=0,
            fwd_ms=tuple(ms_per_sample[i][k] * b / 3 for k, b in enumerate(sizes)),
            bwd_ms=tuple(ms_per_sample[i][k] * b * 2 / 3 for k, b in enumerate(sizes)),
            saved_bytes=tuple(saved[i] * b for b in sizes),
            output_bytes=tuple(0 for _ in sizes),
        )
        for i in range(n)
    )
    return Profile(
        model="Synthetic",
        fingerprint=fingerprint,
        blocks=blocks,
        cuts=tuple(CutProfile(i, (f"t{i}",), tuple(cuts[i] * b for b in sizes)) for i in range(n - 1)),
        microbatch_sizes=tuple(sizes),
        batch_size=batch_size,
        input_shapes=((batch_size, 1),),
        input_dtypes=("torch.float32",),
        device=DeviceInfo("cpu", "cpu worker (1 thread)", 1),
        torch_version="test",
    )
