"""Layouts of p stages × d data-parallel replicas: the planner against brute force, the choice
of pure data parallelism, memory limits, the Plan's ``replicas`` field and the CLI table."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest
from synthetic import make_profile

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.cli import main
from autosplit.cost import OPTIMIZER_STATE, in_flight, replica_sync_ms
from autosplit.errors import InfeasiblePlanError, InvalidInputError, ScheduleUnavailableError
from autosplit.one_process import require_pipeline_only
from autosplit.planner import plan, plan_layouts, plan_replicated
from autosplit.records import Plan
from autosplit.simulator import simulate

BANDWIDTH = 1e9  # bytes/s: 1 ms per MB


def _compositions(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(p))


def _brute_force(prof, devices: int, batch: int, capacity: float | None, schedule: str,
                 allreduce: float, links=None, optimizer: str = "sgd") -> float:
    """The smallest step over every (p, d, replica mode, cuts, b), from the simulator and the
    cost formulas written out here: pipeline step of B/d + the largest stage's
    synchronisation — DDP's gradient all-reduce, or FSDP2's all-gathers (once, or m + 1 times
    when resharding after forward) and reduce-scatter, each (d − 1)/d of the bytes — + the
    slowest stage's update (its 1/d when sharded). A sharded replica holds
    2 + (1 + state)/d parameter sizes per parameter byte (DDP: 2 + state) and keeps the
    largest block's parameter bytes free. ``links(p, d)`` lists the (transfer, all-reduce)
    bandwidths of each placement of the layout (default: one placement, ``BANDWIDTH`` and
    ``allreduce``)."""
    n = len(prof.blocks)
    state = OPTIMIZER_STATE[optimizer]
    largest = max(blk.param_bytes for blk in prof.blocks)
    used = devices
    while True:
        pairs = [(used // d, d) for d in range(1, used + 1)
                 if used % d == 0 and batch % d == 0 and used // d <= n
                 and batch // d >= prof.microbatch_sizes[0]]
        if pairs:
            break
        used -= 1
    best = math.inf
    placed = [(p, d, lw) for p, d in pairs
              for lw in (links(p, d) if links else [(BANDWIDTH, allreduce)])]
    modes = ("ddp", "fsdp2", "fsdp2-no-reshard")
    for (p, d, (link, width)), k, mode in itertools.product(
            placed, range(len(prof.microbatch_sizes)), modes):
        sharded = mode != "ddp" and d > 1
        if mode != "ddp" and d == 1:
            continue  # one replica: nothing to shard
        factor = 2 + (1 + state) / d if sharded else 2 + state
        room = None if capacity is None else capacity - (largest if sharded else 0)
        b = prof.microbatch_sizes[k]
        share = batch // d
        if b > share:
            continue
        m = math.ceil(share / b)
        if schedule == "1f1b" and m < p:
            continue  # torch's Schedule1F1B refuses fewer micro-batches than stages
        for balance in _compositions(n, p):
            ends = list(itertools.accumulate(balance))
            starts = [e - c for e, c in zip(ends, balance)]
            blocks = [prof.blocks[s:e] for s, e in zip(starts, ends)]
            # weights and gradients, activations in flight, and m receive buffers for the
            # input (after a cut) and for the output's gradient (before one)
            memory = [sum(blk.param_bytes * factor
                          + blk.saved_bytes[k] * in_flight(schedule, m, p, s)
                          for blk in stage)
                      + m * ((prof.cuts[a - 1].bytes[k] if a else 0)
                             + (prof.cuts[e - 1].bytes[k] if e < n else 0))
                      for s, (stage, a, e) in enumerate(zip(blocks, starts, ends))]
            if room is not None and max(memory) > room:
                continue
            fwd = [sum(blk.fwd_ms[k] for blk in stage) for stage in blocks]
            bwd = [sum(blk.bwd_ms[k] for blk in stage) for stage in blocks]
            comm = [prof.cuts[e - 1].bytes[k] / link * 1000 for e in ends[:-1]]
            step = simulate(fwd, bwd, m, schedule, comm, comm,  # CPU workers: cores copy
                            transfers_on_cores=prof.device.kind == "cpu").step_ms
            grads = max(sum(blk.param_bytes for blk in stage) for stage in blocks)
            # then every stage's optimizer update, the slowest last
            update = max(math.fsum(dict(blk.update_ms or ())[optimizer] if blk.update_ms
                                   else 0.0 for blk in stage) for stage in blocks)
            if not sharded:
                sync = replica_sync_ms(grads, d, width)
            else:
                gathers = 1 if mode == "fsdp2-no-reshard" else m + 1
                sync = (gathers + 1) * (d - 1) / d * grads / width * 1000
                update /= d
            best = min(best, step + sync + update)
    return best


def _random_profile(rng: random.Random, n: int, batch: int):
    sizes = sorted(rng.sample([1, 2, 3, 4, 6], rng.randint(1, 3)))
    prof = make_profile(
        sizes,
        [[rng.uniform(0.2, 2.0) for _ in sizes] for _ in range(n)],
        batch_size=batch,
        param_bytes=[rng.choice([0, 10**5, 10**6, 4 * 10**6]) for _ in range(n)],
        saved_bytes_per_sample=[rng.choice([0, 10**5, 10**6]) for _ in range(n)],
        cut_bytes_per_sample=[rng.choice([0, 10**4, 10**5, 10**6]) for _ in range(n - 1)],
    )
    if rng.random() < 0.5:  # each block's optimizer update, timed (ms per step)
        prof = dataclasses.replace(prof, blocks=tuple(
            dataclasses.replace(blk, update_ms=(("adam", rng.uniform(0.0, 6.0)),
                                                ("sgd", rng.uniform(0.0, 3.0))))
            for blk in prof.blocks))
    return prof


@pytest.mark.parametrize("seed", range(8))
def test_plan_layouts_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(30):  # 8 × 30 = 240 random instances
        n, devices = rng.randint(1, 8), rng.randint(1, 6)
        batch = rng.choice([6, 8, 12])
        prof = _random_profile(rng, n, batch)
        schedule = rng.choice(["gpipe", "1f1b"])
        capacity = rng.choice([None, 4e6, 1.2e7, 3e7])
        allreduce = rng.choice([2e8, 1e9, 1e10])
        optimizer = rng.choice(["sgd", "adam"])
        expected = _brute_force(prof, devices, batch, capacity, schedule, allreduce,
                                optimizer=optimizer)
        kwargs = dict(memory_per_gpu=capacity, schedule=schedule, bandwidth_bytes_per_s=BANDWIDTH,
                      allreduce_bandwidth_bytes_per_s=allreduce, optimizer=optimizer)
        if math.isinf(expected):  # nothing fits, or torch runs none (1F1B with m < p)
            with pytest.raises((InfeasiblePlanError, ScheduleUnavailableError)):
                plan_layouts(prof, devices, PlanOptions(**kwargs))
            continue
        got = plan_layouts(prof, devices, PlanOptions(**kwargs)).best
        assert got.predicted_step_ms == pytest.approx(expected, rel=1e-9, abs=1e-9), (
            seed, n, devices, batch, schedule, capacity)


def _dp_wins_profile(**extra):
    """Four equal blocks, big activations crossing every cut, small weights: pipelining pays
    transfers and a bubble that data parallelism does not."""
    return make_profile([1, 2, 4, 8], [[1.0, 1.0, 1.0, 1.0]] * 4, batch_size=8,
                        param_bytes=[10**5] * 4, saved_bytes_per_sample=[10**6] * 4,
                        cut_bytes_per_sample=[10**7] * 3, **extra)


def test_pure_data_parallel_is_chosen_when_fastest() -> None:
    layouts = plan_layouts(_dp_wins_profile(), 2,
                           options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH))
    assert [(o.stages, o.replicas) for o in layouts.options] == [(1, 2), (2, 1)]
    dp = layouts.option(1, 2).plan
    pipe = layouts.option(2, 1).plan
    assert layouts.best == dp and dp.replicas == 2 and len(dp.stages) == 1
    assert dp.predicted_step_ms < pipe.predicted_step_ms
    # one device's step on B/2 = 4 samples (4 blocks × 1 ms per sample) + the all-reduce of
    # every gradient (4e5 bytes over 2 ranks at 1 GB/s: 0.4 ms)
    assert dp.replica_sync_ms == pytest.approx(0.4)
    assert dp.predicted_step_ms == pytest.approx(16.0 + 0.4)
    assert dp.batch_size == 8 and dp.microbatches * dp.split_size == 4
    assert pipe == plan(_dp_wins_profile(), 2, options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH))


def test_the_all_reduce_can_make_the_pipeline_win() -> None:
    heavy = make_profile([1, 2, 4], [[1.0, 1.0, 1.0]] * 4, batch_size=8,
                         param_bytes=[10**9] * 4)
    layouts = plan_layouts(heavy, 2, options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH))
    assert layouts.best.replicas == 1
    # the same all-reduce, fully overlapped, no longer costs anything
    hidden = plan_layouts(heavy, 2,
                          options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH,
                                              allreduce_overlap=1.0))
    assert hidden.best.replicas == 2 and hidden.best.replica_sync_ms == 0.0


def test_does_not_fit_when_one_device_cannot_hold_the_model() -> None:
    # 4 blocks of 4 MB weights (16 MB held with SGD): a stage of two fits 20 MB, all four do not
    prof = make_profile([1, 2], [[1.0, 1.0]] * 4, batch_size=4, param_bytes=[4 * 10**6] * 4)
    layouts = plan_layouts(prof, 2,
                           options=PlanOptions(memory_per_gpu=20e6,
                                               bandwidth_bytes_per_s=BANDWIDTH))
    dp = layouts.option(1, 2)
    assert dp.plan is None and dp.need_bytes == pytest.approx(32e6)
    assert layouts.best.replicas == 1 and len(layouts.best.stages) == 2
    with pytest.raises(InfeasiblePlanError, match="does not fit"):
        plan_replicated(prof, 1, 2, options=PlanOptions(memory_per_gpu=20e6))


def test_fewer_devices_when_no_layout_uses_all() -> None:
    prof = make_profile([1], [[1.0]] * 2, batch_size=4)  # 2 blocks, batch 4: not 3, 5 devices
    layouts = plan_layouts(prof, 3, options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH))
    assert layouts.devices == 2 and "no layout uses all 3 devices" in layouts.note
    assert plan_layouts(prof, 4).devices == 4  # 1 × 4 replicas: 4 divides the batch


def test_fixed_replicas_and_bad_values() -> None:
    prof = _dp_wins_profile()
    only = plan_layouts(prof, 4, replicas=2, options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH))
    assert [(o.stages, o.replicas) for o in only.options] == [(2, 2)]
    assert only.best.replicas == 2 and len(only.best.stages) == 2
    assert plan_layouts(prof, 2, pipeline_only=True).best.replicas == 1
    with pytest.raises(InvalidInputError, match="replicas=3"):
        plan_layouts(prof, 6, replicas=3)  # 3 does not divide the batch 8
    with pytest.raises(InvalidInputError, match="allreduce_overlap"):
        plan_replicated(prof, 1, 2, options=PlanOptions(allreduce_overlap=1.5))


def test_plan_replicas_round_trips_and_old_files_load(tmp_path) -> None:
    dp = plan_replicated(_dp_wins_profile(), 1, 2,
                         options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH))
    path = tmp_path / "plan.json"
    dp.save(path)
    assert Plan.load(path) == dp
    assert "layout 1 stage × 2 replicas" in str(dp)
    pipe = plan(_dp_wins_profile(), 2)
    assert "layout 2 stages × 1 replica" in str(pipe)
    data = json.loads(path.read_text())
    layout = data["layout"]
    del layout["replicas"], data["prediction"]["replica_sync_ms"]
    layout["microbatches"] = math.ceil(layout["batch_size"] / layout["split_size"])
    path.write_text(json.dumps(data))
    assert Plan.load(path).replicas == 1
    with pytest.raises(InvalidInputError, match="replicas"):
        dataclasses.replace(dp, replicas=3)  # does not divide the batch 8
    with pytest.raises(InvalidInputError, match="microbatches"):
        dataclasses.replace(dp, replicas=4)  # m no longer ceil(B / d / b)


def test_one_process_refuses_replicas() -> None:
    dp = plan_replicated(_dp_wins_profile(), 1, 2)
    with pytest.raises(InvalidInputError, match=r"needs 2 processes: train it with `autosplit run"):
        require_pipeline_only(dp, "partition()")
    require_pipeline_only(plan(_dp_wins_profile(), 2), "partition()")


MODEL = '''
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))

def example_inputs(batch_size=8):
    return torch.randn(batch_size, 4)
'''


def _model_and_profile(tmp_path, param_bytes: int = 10**5, saved_bytes: int = 10**6,
                       cut_bytes: int = 10**7):
    from autosplit.capture.trace import trace
    from autosplit.modelfile import load_model_file

    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL)
    graph = trace(load_model_file(str(model_file), None).build())
    n = len(graph.block_names)
    prof = make_profile([1, 2, 4, 8], [[1.0] * 4] * n, batch_size=8,
                        param_bytes=[param_bytes] * n, saved_bytes_per_sample=[saved_bytes] * n,
                        cut_bytes_per_sample=[cut_bytes] * (n - 1), fingerprint=graph.fingerprint)
    prof = dataclasses.replace(prof, blocks=tuple(
        dataclasses.replace(blk, name=name) for blk, name in zip(prof.blocks, graph.block_names)))
    path = tmp_path / "profile.json"
    prof.save(path)
    return str(model_file), str(path)


def test_cli_chooses_data_parallel_when_it_is_faster(tmp_path, capsys) -> None:
    model, prof = _model_and_profile(tmp_path)
    out_plan = tmp_path / "plan.json"
    assert main(["plan", model, "--gpus", "2", "--profile", prof, "--bandwidth", "1GB",
                 "-o", str(out_plan)]) == 0
    out = capsys.readouterr().out
    assert "layout 1 stage × 2 replicas" in out  # data parallelism is chosen: it is faster
    assert "data parallel ×2" in out and "pipeline 2 stages" in out
    assert "vs the best pipeline: ×" in out
    chosen = Plan.load(out_plan)
    assert chosen.replicas == 2 and len(chosen.stages) == 1
    rows = {line.split()[0] + " " + line.split()[1]: line for line in out.splitlines()
            if line.startswith(("data parallel", "pipeline 2"))}
    assert "chosen" in rows["data parallel"] and "chosen" not in rows["pipeline 2"]

    assert main(["plan", model, "--gpus", "2", "--profile", prof, "--pipeline-only",
                 "-o", str(out_plan)]) == 0
    out = capsys.readouterr().out
    assert "data parallel" not in out and "layout 2 stages × 1 replica" in out
    assert Plan.load(out_plan).replicas == 1

    emitted = tmp_path / "pipelined.py"
    assert main(["plan", model, "--gpus", "2", "--profile", prof, "--emit", str(emitted),
                 "-o", str(out_plan)]) == 0
    out = capsys.readouterr().out
    assert "only pipelines of 2 stages were considered" in out
    assert Plan.load(out_plan).replicas == 1 and emitted.exists()

    assert main(["plan", model, "--gpus", "2", "--profile", prof, "--replicas", "2",
                 "-o", str(out_plan)]) == 0
    assert "layout 1 stage × 2 replicas" in capsys.readouterr().out
    assert Plan.load(out_plan).replicas == 2

    assert main(["run", model, "--plan", str(out_plan), "--nproc", "3"]) == 2  # before launching
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs on a multiple of 2 ranks" in err[0], err


def test_cli_memory_limit_shows_does_not_fit(tmp_path, capsys) -> None:
    model, prof = _model_and_profile(tmp_path, param_bytes=3 * 10**6, saved_bytes=10**5,
                                     cut_bytes=10**3)
    # 3 blocks (the ReLU joins a Linear); with SGD a block holds 6 MB of weights and gradients
    # + 0.1 MB saved per sample in flight: one device holding all three needs ≥ 18 MB, a stage
    # of two blocks at b = 1 with 8 in flight 13.6 MB (and 8 receive buffers of 1 kB)
    assert main(["plan", model, "--gpus", "2", "--profile", prof, "--memory", "15000000",
                 "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("data parallel ×2"))
    assert "does not fit: needs" in row


def test_partition_refuses_a_plan_with_replicas() -> None:
    import torch
    from torch import nn

    from autosplit.planner import plan_with_balance

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    prof = autosplit.profile(model, (x,),
                             options=ProfileOptions(microbatch_sizes=[2], repeats=1, budget_s=0))
    plan = dataclasses.replace(plan_with_balance(prof, (1, 1), 2), replicas=2, microbatches=2)
    with pytest.raises(autosplit.InvalidInputError, match=r"partition\(\) runs one pipeline in one"):
        autosplit.partition(model, plan=plan)
    with pytest.raises(autosplit.InvalidInputError, match=r"emit\(\) runs one pipeline in one"):
        autosplit.emit(plan, "examples/toy.py")


def test_no_layout_fits_names_the_smallest_need() -> None:
    # 4 blocks of 4 MB weights: neither 2 stages (16 MB on a stage) nor 2 replicas fit 1 MB
    prof = make_profile([1, 2], [[1.0, 1.0]] * 4, batch_size=4, param_bytes=[4 * 10**6] * 4)
    with pytest.raises(InfeasiblePlanError) as info:
        plan_layouts(prof, 2,
                     options=PlanOptions(memory_per_gpu=1e6, bandwidth_bytes_per_s=BANDWIDTH))
    need = info.value.min_capacity_bytes
    assert need == pytest.approx(16e6, rel=0.05)  # two blocks' weights and gradients
    assert info.value.finding.startswith("no layout of 2 devices fits: the smallest needs ")
    assert str(info.value).startswith(info.value.finding + "; try more devices")
    plan_layouts(prof, 2,
                 options=PlanOptions(memory_per_gpu=need,
                                     bandwidth_bytes_per_s=BANDWIDTH))  # it fits


def test_the_measured_latency_and_the_one_stage_runtime_enter_data_parallel() -> None:
    measured = dataclasses.replace(_dp_wins_profile(), allreduce_bytes_per_s=BANDWIDTH,
                                   allreduce_latency_ms=2.0, one_stage_action_ms=0.25,
                                   one_stage_action_spread=0.05)
    dp = plan_replicated(measured, 1, 2, options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH))
    # the all-reduce of 4e5 bytes at 1 GB/s (0.4 ms) after its 2 ms latency; the one stage's
    # forwards and backwards each cost the runtime 0.25 ms more, one after the other
    assert dp.replica_sync_ms == pytest.approx(0.4 + 2.0)
    assert dp.action_ms == 0.25
    assert dp.predicted_step_ms == pytest.approx(16.0 + 2 * dp.microbatches * 0.25 + 2.4)
    # a bandwidth given by hand comes without the measured latency
    given = plan_replicated(measured, 1, 2, options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH,
                                                                allreduce_bandwidth_bytes_per_s=BANDWIDTH))
    assert given.replica_sync_ms == pytest.approx(0.4)
    # a profile that measured the pipelines' runtime but not one stage's: GPipe's cost
    older = dataclasses.replace(measured, one_stage_action_ms=None, one_stage_action_spread=None,
                                action_ms=(("gpipe", 0.7), ("1f1b", 0.2)))
    assert older.one_stage_action() == (0.7, 0.0)
    assert plan_replicated(older, 1, 2,
                           options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH)).action_ms == 0.7
    # nothing measured: nothing added, as before
    assert _dp_wins_profile().one_stage_action() == (0.0, 0.0)
    # a synchronisation slow enough whatever its bytes makes the pipeline win
    layouts = plan_layouts(measured, 2, options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH))
    pipeline = layouts.option(2, 1).plan
    assert layouts.best.replicas == 2 and pipeline is not None
    slow = dataclasses.replace(
        measured, allreduce_latency_ms=pipeline.predicted_step_ms - dp.predicted_step_ms + 2.5)
    assert plan_layouts(slow, 2,
                        options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH)).best.replicas == 1


def test_replica_sync_adds_the_latency_once_per_step() -> None:
    assert replica_sync_ms(10**6, 2, 1e9, latency_ms=0.5) == pytest.approx(1.0 + 0.5)
    assert replica_sync_ms(10**6, 4, 1e9, overlap=0.5, latency_ms=1.0) == pytest.approx(
        0.5 * (1.5 + 1.0))
    assert replica_sync_ms(10**6, 1, 1e9, latency_ms=5.0) == 0.0  # one replica: no sync
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(InvalidInputError, match="latency_ms"):
            replica_sync_ms(10**6, 2, 1e9, latency_ms=bad)


def test_1f1b_is_planned_only_with_as_many_micro_batches_as_stages() -> None:
    """torch's Schedule1F1B refuses fewer micro-batches than stages, so the planner does not
    choose them, with replicas or without; where no size leaves enough, it says so. (A plan of
    2 stages × 2 replicas for examples/toy.py chose 1F1B with one micro-batch, which
    ``autosplit run`` then refused.)"""
    from autosplit.distributed.stage_module import check_schedule
    from autosplit.errors import ScheduleUnavailableError

    # b = 10 is half the cost per sample of b = 5: one micro-batch would be predicted fastest
    prof = make_profile([5, 10], [[2.0, 1.0], [2.0, 1.0]], batch_size=20)
    for found in (plan_replicated(prof, 2, 2, options=PlanOptions(schedule="1f1b")),
                  plan(prof, 2, options=PlanOptions(batch_size=10, schedule="1f1b"))):
        assert found.schedule == "1f1b" and found.split_size == 5 and found.microbatches == 2
        check_schedule(found, 2, replicas=found.replicas)  # autosplit run takes it
    best = plan_replicated(prof, 2, 2)  # auto: GPipe's one micro-batch or 1F1B's two
    assert best.schedule == "gpipe" or best.microbatches >= 2
    check_schedule(best, 2, replicas=2)
    only_large = make_profile([10], [[1.0], [1.0]], batch_size=20)
    with pytest.raises(ScheduleUnavailableError, match="at least as many micro-batches as stages"):
        plan_replicated(only_large, 2, 2, options=PlanOptions(schedule="1f1b"))
    with pytest.raises(ScheduleUnavailableError,
                       match=r"stages \(2\), and the batch 10 in micro-batches of 10 makes at most 1"):
        plan(only_large, 2, options=PlanOptions(batch_size=10, schedule="1f1b"))
    assert plan_replicated(only_large, 2, 2).schedule == "gpipe"


def test_a_layout_that_torch_cannot_run_says_why() -> None:
    """4 devices, 1F1B, a batch of 12 in micro-batches of 4: a pipeline of 4 stages would have
    3 micro-batches, fewer than its stages, which torch refuses; 2 stages × 2 replicas have 2
    each and run. The layouts table names the refusal."""
    import io

    from rich.console import Console

    from autosplit.report import layout_table

    prof = make_profile([4], [[1.0]] * 4, batch_size=12)
    layouts = plan_layouts(prof, 4,
                           options=PlanOptions(schedule="1f1b", bandwidth_bytes_per_s=BANDWIDTH))
    options = {(o.stages, o.replicas): o for o in layouts.options}
    assert options[(4, 1)].plan is None and options[(4, 1)].need_bytes is None
    assert options[(4, 1)].why == "1f1b: fewer micro-batches than stages"
    best = layouts.best
    assert (len(best.stages), best.replicas, best.microbatches) == (2, 2, 2)
    out = io.StringIO()
    Console(file=out, width=200).print(layout_table(layouts, best))
    assert "pipeline 4 stages" in out.getvalue()
    assert "1f1b: fewer micro-batches than stages" in out.getvalue()


def test_what_does_not_fit_is_said_before_what_torch_refuses() -> None:
    """GPipe does not fit the memory and 1F1B cannot run (one micro-batch for 2 stages): the
    error is the memory's, which says what would fit, with replicas or devices of two speeds."""
    from autosplit.errors import InfeasiblePlanError as Infeasible

    prof = make_profile([10], [[1.0], [1.0]], batch_size=20, saved_bytes_per_sample=[10**6] * 2)
    with pytest.raises(Infeasible):
        plan_replicated(prof, 2, 2, options=PlanOptions(memory_per_gpu=1000))
    with pytest.raises(Infeasible):
        plan(prof, 2,
             options=PlanOptions(batch_size=10, schedule="auto", speeds=[1.0, 2.0],
                                 memory_per_gpu=1000))
