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
    forward_share: Sequence[float] | None = None,
) -> Profile:
    """A profile of n blocks where block i costs ``ms_per_sample[i][k] · b`` ms at size index k.

    Forward takes ``forward_share[i]`` of that time (default a third) and backward the rest.
    """
    n = len(ms_per_sample)
    params = param_bytes or [0] * n
    saved = saved_bytes_per_sample or [0] * n
    cuts = cut_bytes_per_sample or [0] * (n - 1)

    def fwd(i: int, k: int, b: int) -> float:
        if forward_share is None:
            return ms_per_sample[i][k] * b / 3
        return ms_per_sample[i][k] * b * forward_share[i]

    def bwd(i: int, k: int, b: int) -> float:
        if forward_share is None:
            return ms_per_sample[i][k] * b * 2 / 3
        return ms_per_sample[i][k] * b * (1 - forward_share[i])

    blocks = tuple(
        BlockProfile(
            name=f"block{i}",
            param_bytes=params[i],
            buffer_bytes=0,
            fwd_ms=tuple(fwd(i, k, b) for k, b in enumerate(sizes)),
            bwd_ms=tuple(bwd(i, k, b) for k, b in enumerate(sizes)),
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


def plan_of(graph: object, balance: Sequence[int], split_size: int = 1,
            microbatches: int = 1) -> object:
    """A plan of ``graph`` (a BlockGraph) with ``balance`` blocks per stage, without profiling:
    its numbers are placeholders."""
    from autosplit.records import Plan, Stage

    names, stages, first = graph.block_names, [], 0  # type: ignore[attr-defined]
    for i, count in enumerate(balance):
        stages.append(Stage(i, "cpu", tuple(names[first:first + count]), 1.0, 0.5, 0, 0.0, 0))
        first += count
    assert first == len(names), names
    return Plan(graph.model_name, graph.fingerprint, tuple(stages), split_size,  # type: ignore[attr-defined]
                microbatches, split_size * microbatches, "gpipe", 1.0, 1.0, "manual",
                (split_size,), "test")


def even_balance(blocks: int, stages: int) -> tuple[int, ...]:
    """``blocks`` shared out over ``stages`` as evenly as they go, the first stages longer."""
    return tuple(blocks // stages + (i < blocks % stages) for i in range(stages))


def format_1(saved: dict) -> dict:
    """A plan file's JSON (format 2: fields in groups) as an older autosplit wrote it: format
    1, every field at the top level (for the tests of files saved before a field existed)."""
    from autosplit.records import PLAN_GROUPS

    fields = {k: v for group in PLAN_GROUPS for k, v in saved[group].items()}
    return {"kind": "plan", "format_version": 1, **fields}
