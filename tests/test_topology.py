"""Devices in nodes: the Topology's checks, which placement the planner picks (hand-computed),
the planner against brute force over (p, d, placement, cuts, b), the CLI's --nodes, and the
measured all-reduce (structure only: no figure is asserted)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
from synthetic import format_1, make_profile
from test_layouts import _brute_force, _random_profile

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.cli import main
from autosplit.cost import replica_sync_ms
from autosplit.errors import (
    ArgumentTypeError,
    InfeasiblePlanError,
    InvalidInputError,
    ScheduleUnavailableError,
)
from autosplit.measure.collectives import (
    LATENCY_BYTES,
    bus_bandwidth,
    measure_allreduce,
    measure_allreduce_bandwidth,
    measure_link_bandwidth,
)
from autosplit.planner import plan_layouts
from autosplit.records import Plan, Profile
from autosplit.topology import PLACEMENTS, Topology, device_of, placement_text, placements

ROOT = Path(__file__).resolve().parent.parent
W_IN, W_OUT = 1e9, 1e8  # bytes/s: 1 ms per MB inside a node, 10 ms per MB between nodes


@pytest.mark.parametrize("args, error", [
    ((0, 8, 1e9, 1e8), InvalidInputError),
    ((2, -1, 1e9, 1e8), InvalidInputError),
    ((2, 4, 0.0, 1e8), InvalidInputError),
    ((2, 4, 1e9, math.inf), InvalidInputError),
    ((2, 4, 1e9, math.nan), InvalidInputError),
    ((True, 4, 1e9, 1e8), ArgumentTypeError),
    ((2, 4.0, 1e9, 1e8), ArgumentTypeError),
    ((2, 4, "1e9", 1e8), ArgumentTypeError),
])
def test_topology_rejects_bad_values(args: tuple, error: type) -> None:
    with pytest.raises(error):
        Topology(*args)


def test_device_numbering_and_what_stays_inside_a_node() -> None:
    # 2 stages × 2 replicas on 2 nodes of 2: pp-inner puts a replica's stages on one node
    assert [device_of("pp-inner", s, r, 2, 2) for r in range(2) for s in range(2)] == [0, 1, 2, 3]
    assert [device_of("dp-inner", s, r, 2, 2) for s in range(2) for r in range(2)] == [0, 1, 2, 3]
    assert placement_text("pp-inner", 2, 2, 2) == (
        "pp-inner: each pipeline inside a node, each stage's all-reduce across nodes")
    assert placement_text("dp-inner", 2, 2, 2) == (
        "dp-inner: each pipeline across nodes, each stage's all-reduce inside a node")
    topo = Topology(2, 2, W_IN, W_OUT)
    both = placements(topo, 2, 2)
    assert [(p.order, p.link_bytes_per_s, p.allreduce_bytes_per_s) for p in both] == [
        ("pp-inner", W_IN, W_OUT), ("dp-inner", W_OUT, W_IN)]
    # on one node nothing crosses: one placement, every link fast
    (one,) = placements(Topology(1, 4, W_IN, W_OUT), 2, 2)
    assert (one.order, one.link_bytes_per_s, one.allreduce_bytes_per_s) == ("pp-inner", W_IN, W_IN)
    # a measured all-reduce is used inside a node, capped by the network between nodes
    assert placements(topo, 2, 2, 5e8)[1].allreduce_bytes_per_s == 5e8
    assert placements(topo, 2, 2, 5e9)[0].allreduce_bytes_per_s == W_OUT
    with pytest.raises(InvalidInputError, match="need 8 devices"):
        placements(topo, 4, 2)


def _two_blocks(param_bytes: int, cut_bytes_per_sample: int) -> autosplit.Profile:
    """Two blocks of 1 ms per sample (a third forward), batch 4, one size b = 2."""
    return make_profile([2], [[1.0], [1.0]], batch_size=4, param_bytes=[param_bytes] * 2,
                        cut_bytes_per_sample=[cut_bytes_per_sample])


def test_heavy_gradients_keep_the_all_reduce_inside_a_node() -> None:
    # 2 × 2 on 2 nodes of 2, each replica 2 samples = 1 micro-batch of 2: the pipeline takes
    # f0 + f1 + b1 + b0 = 2/3 + 2/3 + 4/3 + 4/3 = 4 ms; each stage all-reduces 1 MB over 2
    # ranks, 2 · 1/2 · 1e6 bytes / W: 10 ms between nodes (pp-inner), 1 ms inside (dp-inner)
    layouts = plan_layouts(_two_blocks(10**6, 0), topology=Topology(2, 2, W_IN, W_OUT),
                           replicas=2)
    best = layouts.best
    assert (len(best.stages), best.replicas, best.placement) == (2, 2, "dp-inner")
    assert best.predicted_step_ms == pytest.approx(4.0 + 1.0)
    assert best.replica_sync_ms == pytest.approx(1.0)
    assert best.allreduce_bytes_per_s == W_IN and best.devices_per_node == 2


def test_the_measured_latency_is_paid_on_a_topology_too() -> None:
    # as above, with the profile's measured all-reduce (W_in inside a node) and its latency of
    # 3 ms: paid by every placement's all-reduce; a bandwidth given by hand comes without it
    import dataclasses

    measured = dataclasses.replace(_two_blocks(10**6, 0), allreduce_bytes_per_s=W_IN,
                                   allreduce_latency_ms=3.0)
    best = plan_layouts(measured, topology=Topology(2, 2, W_IN, W_OUT), replicas=2).best
    assert best.placement == "dp-inner"
    assert best.replica_sync_ms == pytest.approx(1.0 + 3.0)
    assert best.predicted_step_ms == pytest.approx(4.0 + 1.0 + 3.0)
    given = plan_layouts(measured, topology=Topology(2, 2, W_IN, W_OUT), replicas=2,
                         options=PlanOptions(allreduce_bandwidth_bytes_per_s=W_IN)).best
    assert given.replica_sync_ms == pytest.approx(1.0)


def test_heavy_activations_keep_the_pipeline_inside_a_node() -> None:
    # 100 kB per sample cross the cut, 200 kB at b = 2, forward and back: 0.4 ms at W_in,
    # 4 ms at W_out; 100 kB of gradients per stage: 1 ms at W_out, 0.1 ms at W_in.
    # pp-inner: 4 + 0.4 + 1 = 5.4 ms; dp-inner: 4 + 4 + 0.1 = 8.1 ms
    best = plan_layouts(_two_blocks(10**5, 10**5), topology=Topology(2, 2, W_IN, W_OUT),
                        replicas=2).best
    assert best.placement == "pp-inner"
    assert best.predicted_step_ms == pytest.approx(5.4)
    assert "placement pp-inner: each pipeline inside a node" in str(best)


def _links(topology: Topology, measured: float | None):
    """Each placement's (transfer, all-reduce) bandwidths, from device numbers alone."""

    def node(order: str, s: int, r: int, p: int, d: int) -> int:
        return (r * p + s if order == "pp-inner" else s * d + r) // topology.per_node

    def links(p: int, d: int) -> list[tuple[float, float]]:
        inside = measured or W_IN
        out = []
        for order in PLACEMENTS:
            cross = any(node(order, s, r, p, d) != node(order, s + 1, r, p, d)
                        for s in range(p - 1) for r in range(d))
            spread = any(node(order, s, r, p, d) != node(order, s, 0, p, d)
                         for s in range(p) for r in range(d))
            out.append((W_OUT if cross else W_IN, min(inside, W_OUT) if spread else inside))
        return out

    return links


@pytest.mark.parametrize("seed", range(4))
def test_planner_equals_brute_force_over_placements(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(20):  # 4 × 20 = 80 random instances
        n, per_node, nodes = rng.randint(1, 6), rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
        batch = rng.choice([6, 8, 12])
        prof = _random_profile(rng, n, batch)
        schedule = rng.choice(["gpipe", "1f1b"])
        capacity = rng.choice([None, 1.2e7, 3e7])
        measured = rng.choice([None, 3e8])
        topology = Topology(nodes, per_node, W_IN, W_OUT)
        expected = _brute_force(prof, topology.devices, batch, capacity, schedule, 0.0,
                                links=_links(topology, measured))
        kwargs = {"memory_per_gpu": capacity, "schedule": schedule,
                  "allreduce_bandwidth_bytes_per_s": measured}
        if math.isinf(expected):  # nothing fits, or torch runs none (1F1B with m < p)
            with pytest.raises((InfeasiblePlanError, ScheduleUnavailableError)):
                plan_layouts(prof, options=PlanOptions(**kwargs), topology=topology)
            continue
        got = plan_layouts(prof, options=PlanOptions(**kwargs), topology=topology).best
        assert got.predicted_step_ms == pytest.approx(expected, rel=1e-9, abs=1e-9), (
            seed, n, nodes, per_node, batch, schedule, capacity, measured)


def test_plan_layouts_checks_the_topology_against_its_arguments() -> None:
    prof = _two_blocks(10**5, 10**5)
    with pytest.raises(InvalidInputError, match="differs from the topology"):
        plan_layouts(prof, 8, topology=Topology(2, 2, W_IN, W_OUT))
    with pytest.raises(InvalidInputError, match="bandwidth_bytes_per_s with a topology"):
        plan_layouts(prof, topology=Topology(2, 2, W_IN, W_OUT),
                     options=PlanOptions(bandwidth_bytes_per_s=1e9))
    with pytest.raises(ArgumentTypeError, match="topology"):
        plan_layouts(prof, topology=(2, 2))  # type: ignore[arg-type]


def test_max_stages_leaves_deep_pipelines_out_and_says_so() -> None:
    prof = make_profile([1, 2], [[1.0, 1.0]] * 4, batch_size=4)
    layouts = plan_layouts(prof, 4, max_stages=2, options=PlanOptions(bandwidth_bytes_per_s=W_IN))
    assert [(o.stages, o.replicas) for o in layouts.options] == [(1, 4), (2, 2)]
    assert "layouts of 4 stages not searched (max_stages 2)" in layouts.note


def test_old_plan_files_load_without_the_new_fields(tmp_path: Path) -> None:
    plan = plan_layouts(_two_blocks(10**6, 0), topology=Topology(2, 2, W_IN, W_OUT),
                        replicas=2).best
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    data = format_1(json.loads(path.read_text()))
    for field in ("placement", "devices_per_node", "allreduce_bytes_per_s"):
        del data[field]
    path.write_text(json.dumps(data))
    old = Plan.load(path)
    assert (old.placement, old.devices_per_node, old.allreduce_bytes_per_s) == ("", None, None)
    data["placement"] = "sideways"
    path.write_text(json.dumps(data))
    with pytest.raises(autosplit.PlanFileError, match="placement"):
        Plan.load(path)


def test_cli_plans_for_nodes_and_records_the_placement(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from autosplit.modelfile import load_model_file

    source = load_model_file(str(ROOT / "examples" / "toy.py"))
    model = source.build()
    prof = autosplit.profile(model, source.example_inputs(8),
                             options=ProfileOptions(microbatch_sizes=[2, 4], repeats=1,
                                                    budget_s=None))
    prof.save(tmp_path / "prof.json")
    monkeypatch.chdir(tmp_path)
    argv = ["plan", str(ROOT / "examples" / "toy.py"), "--profile", "prof.json", "--nodes", "2",
            "--gpus-per-node", "1", "--inter-node-bandwidth", "1GB", "--pipeline-only",
            "-o", "plan.json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "placement each pipeline across nodes (nodes of 1 devices)" in out
    plan = Plan.load(tmp_path / "plan.json")
    assert (len(plan.stages), plan.placement, plan.devices_per_node) == (2, "pp-inner", 1)


def test_measured_all_reduce_bandwidth_structure() -> None:
    assert bus_bandwidth(4e6, 2, 0.004) == pytest.approx(1e9)  # 2 · 1/2 · 4 MB in 4 ms
    assert bus_bandwidth(3e6, 4, 0.0045) == pytest.approx(1e9)  # 2 · 3/4 · 3 MB in 4.5 ms
    width = measure_allreduce_bandwidth(2, nbytes=2**16, repeats=1, backend="gloo")
    assert math.isfinite(width) and width > 0
    assert measure_allreduce_bandwidth(2, nbytes=2**16, repeats=1, backend="gloo") == width
    with pytest.raises(InvalidInputError, match="2 ranks"):
        measure_allreduce_bandwidth(1)
    with pytest.raises(InvalidInputError, match="backend"):
        measure_allreduce_bandwidth(2, backend="mpi")


def test_measured_link_bandwidth_structure() -> None:
    link = measure_link_bandwidth(nbytes=2**16, repeats=1, backend="gloo")
    assert math.isfinite(link) and link > 0
    assert measure_link_bandwidth(nbytes=2**16, repeats=1, backend="gloo") == link  # kept
    with pytest.raises(InvalidInputError, match="backend"):
        measure_link_bandwidth(backend="mpi")


def test_a_measured_link_is_the_planners_default_and_an_old_profile_keeps_the_kinds(
        tmp_path: Path) -> None:
    prof = _two_blocks(param_bytes=4, cut_bytes_per_sample=10**6)
    assert prof.link_bytes_per_s is None
    assumed = autosplit.plan(prof, 2)  # no measurement: the CPU default, 1.7 GB/s
    slow = dataclasses.replace(prof, link_bytes_per_s=1e9)
    measured = autosplit.plan(slow, 2)
    given = autosplit.plan(slow, 2,
                           options=PlanOptions(bandwidth_bytes_per_s=5e9))  # an explicit link wins
    # a transfer is forward + backward over the cut: 2 · bytes / bandwidth
    nbytes = prof.cuts[0].bytes[prof.size_index(measured.split_size)]
    assert measured.stages[0].send_ms == pytest.approx(2 * nbytes / 1e9 * 1000)
    assert given.stages[0].send_ms == pytest.approx(2 * nbytes / 5e9 * 1000)
    assert assumed.stages[0].send_ms == pytest.approx(
        2 * prof.cuts[0].bytes[prof.size_index(assumed.split_size)] / 1.7e9 * 1000)
    slow.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").link_bytes_per_s == 1e9


def test_the_collectives_measured_at_once_are_the_figures_each_measurer_keeps(
        monkeypatch) -> None:
    """One start of the ranks times the synchronisation at two sizes and the link; each figure
    is then the one its own measurer returns, without measuring again."""
    from autosplit.measure import collectives

    monkeypatch.setattr(collectives, "_MEASURED", {})
    found = collectives.measure_collectives(2, nbytes=2**17, link_bytes=2**16, repeats=1,
                                            backend="gloo")
    assert found.link_bytes_per_s > 0 and found.allreduce.latency_ms > 0
    assert len(collectives._MEASURED) == 3

    def no_start(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(collectives, "_measure", no_start)
    assert measure_allreduce(2, nbytes=2**17, repeats=1, backend="gloo") == found.allreduce
    assert measure_link_bandwidth(nbytes=2**16, repeats=1,
                                  backend="gloo") == found.link_bytes_per_s
    with pytest.raises(InvalidInputError, match="latency"):
        collectives.measure_collectives(2, nbytes=LATENCY_BYTES, backend="gloo")


def test_a_rank_aborting_after_the_figure_keeps_the_figure(monkeypatch) -> None:
    """A rank killed at teardown after rank 0 put its timing (DDP's threads now and then abort
    there) leaves the figure standing; killed before it, the failure is raised."""
    import torch.multiprocessing as mp

    from autosplit.measure import collectives

    def dying(put: bool):
        def start(fn, args, **kwargs):
            if put:
                args[-1].put(0.25)
            raise mp.ProcessExitedException("process 0 terminated with signal SIGABRT",
                                            error_index=0, error_pid=1, exit_code=-6,
                                            signal_name="SIGABRT")
        return start

    monkeypatch.setattr(mp, "start_processes", dying(True))
    assert collectives._measure(None, 2, 8, 1, "gloo") == 0.25
    monkeypatch.setattr(mp, "start_processes", dying(False))
    with pytest.raises(mp.ProcessExitedException):
        collectives._measure(None, 2, 8, 1, "gloo")


@pytest.mark.long
def test_measured_all_reduce_latency_and_bandwidth_give_back_the_time_measured() -> None:
    cost = measure_allreduce(2, nbytes=2**18, repeats=1, backend="gloo")
    assert math.isfinite(cost.latency_ms) and cost.latency_ms > 0
    assert math.isfinite(cost.bus_bytes_per_s) and cost.bus_bytes_per_s > 0
    # α at LATENCY_BYTES is the small model's whole synchronisation
    small = measure_allreduce_bandwidth(2, nbytes=LATENCY_BYTES, repeats=3, backend="gloo")
    assert cost.latency_ms == pytest.approx(bus_bandwidth(LATENCY_BYTES, 2, 1.0) / small * 1e3)
    # α + 2 (k − 1)/k · n / W is the time measured at n bytes (unless α was above half of it)
    whole = bus_bandwidth(2**18, 2, 1.0) / measure_allreduce_bandwidth(
        2, nbytes=2**18, repeats=1, backend="gloo") * 1e3
    rebuilt = cost.latency_ms + replica_sync_ms(2**18, 2, cost.bus_bytes_per_s)
    if cost.latency_ms <= whole / 2:
        assert rebuilt == pytest.approx(whole)
    else:
        assert replica_sync_ms(2**18, 2, cost.bus_bytes_per_s) == pytest.approx(whole / 2)
    with pytest.raises(InvalidInputError, match="nbytes"):
        measure_allreduce(2, nbytes=LATENCY_BYTES, backend="gloo")
