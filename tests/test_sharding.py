"""Sharded replicas (FSDP2 along "dp") in the planner: the memory and collective formulas on
hand-made numbers, the choice where DDP does not fit, the Plan's ``replica_mode`` field (old
files load as DDP), the plan text and the layouts table. The brute force over every mode on
random instances is ``tests/test_layouts.py::test_plan_layouts_equals_brute_force``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from synthetic import format_1, make_profile
from test_layouts import _model_and_profile

from autosplit import PlanOptions
from autosplit.cli import main
from autosplit.cost import replica_sync_ms
from autosplit.errors import InfeasiblePlanError, InvalidInputError
from autosplit.planner import plan_layouts, plan_replicated
from autosplit.records import Plan, Profile, SharedParam
from autosplit.sharding import (
    fsdp_sync_ms,
    gather_count,
    gather_transient_bytes,
    mode_label,
    replica_param_factor,
)
from autosplit.validation import RecordError

MB = 10**6
BANDWIDTH = 1e9  # bytes/s: 1 ms per MB


def test_a_sharded_replica_holds_its_shard_plus_the_gathered_weights_and_gradients() -> None:
    # Adam: DDP holds weights, gradients and two moments (4 parameter sizes); FSDP2 under
    # torch's PipelineStage holds the gathered weights and unsharded gradients whole and
    # the weights' and moments' shards: 2 + 3/d
    assert replica_param_factor("ddp", 2, 4) == 4.0
    assert replica_param_factor("fsdp2", 2, 4) == pytest.approx(2.75)
    assert replica_param_factor("fsdp2-no-reshard", 6, 8) == pytest.approx(2 + 7 / 8)
    assert replica_param_factor("fsdp2", 2, 1) == 4.0  # one replica: nothing to shard
    # with SGD (no state) sharding holds more than DDP: the shard comes on top
    assert replica_param_factor("fsdp2", 0, 2) > replica_param_factor("ddp", 0, 2)
    assert gather_transient_bytes("fsdp2", 3 * MB, 2) == 3 * MB
    assert gather_transient_bytes("ddp", 3 * MB, 2) == 0.0


def test_all_gathers_and_reduce_scatter_move_half_an_all_reduce_each() -> None:
    assert gather_count("fsdp2-no-reshard", 5) == 1
    assert gather_count("fsdp2", 5) == 6  # every forward after a forward, and one backward
    # no reshard: one all-gather and one reduce-scatter, (d − 1)/d of 1 GB each at 1 GB/s
    assert fsdp_sync_ms("fsdp2-no-reshard", 1e9, 2, 5, 1e9) == pytest.approx(1000.0)
    assert fsdp_sync_ms("fsdp2-no-reshard", 1e9, 2, 5, 1e9) == pytest.approx(
        replica_sync_ms(1e9, 2, 1e9))  # as much as DDP's all-reduce
    assert fsdp_sync_ms("fsdp2", 1e9, 4, 3, 1e9) == pytest.approx(5 * 750.0)
    # each collective pays the latency; the overlap hides a share of the all-gathers only
    assert fsdp_sync_ms("fsdp2", 0.0, 2, 3, 1e9, latency_ms=2.0) == pytest.approx(10.0)
    assert fsdp_sync_ms("fsdp2", 1e9, 2, 3, 1e9, overlap=1.0) == pytest.approx(500.0)
    assert fsdp_sync_ms("fsdp2", 1e9, 1, 3, 1e9) == 0.0
    with pytest.raises(InvalidInputError, match="replica_mode='zero3'"):
        fsdp_sync_ms("zero3", 1e9, 2, 3, 1e9)
    with pytest.raises(InvalidInputError, match="replica_mode='ddp'"):
        fsdp_sync_ms("ddp", 1e9, 2, 3, 1e9)
    assert mode_label("fsdp2-no-reshard") == "FSDP2 (no reshard)"


def _heavy_profile():
    """Four blocks of 4 MB weights, big activations across the cuts (a pipeline pays them),
    ms per sample equal: with Adam in mixed precision (16 bytes per 2-byte weight) one device
    holds 128 MB under DDP."""
    return make_profile([1, 2], [[1.0, 1.0]] * 4, batch_size=8, param_bytes=[4 * MB] * 4,
                        saved_bytes_per_sample=[10**4] * 4, cut_bytes_per_sample=[10**7] * 3)


def test_fsdp2_is_chosen_where_ddp_does_not_fit() -> None:
    prof = _heavy_profile()
    base = PlanOptions(bandwidth_bytes_per_s=BANDWIDTH,
                       allreduce_bandwidth_bytes_per_s=BANDWIDTH, optimizer="adam-mixed")
    free = plan_layouts(prof, 4, base)
    assert free.option(1, 4).plan.replica_mode == "ddp"  # no limit: DDP is as fast or faster
    layouts = plan_layouts(prof, 4, dataclasses.replace(base, memory_per_gpu=80 * MB))
    dp = layouts.option(1, 4)
    assert dp.plan is not None and dp.plan.replica_mode == "fsdp2-no-reshard"
    modes = {m.mode: m for m in dp.modes}
    assert set(modes) == {"ddp", "fsdp2", "fsdp2-no-reshard"}
    assert modes["ddp"].plan is None and modes["ddp"].need_bytes >= 128 * MB
    # 16 MB of weights × (2 + 7/4) + the largest unit's 4 MB + what the micro-batches save
    held = max(s.memory_bytes for s in dp.plan.stages)
    assert 64 * MB <= held <= 80 * MB
    assert layouts.best.replica_mode == "fsdp2-no-reshard" and layouts.best.replicas == 4
    # the resharding mode holds the same at its peak and gathers m + 1 times: slower
    assert modes["fsdp2"].plan.predicted_step_ms > dp.plan.predicted_step_ms
    with pytest.raises(InfeasiblePlanError):
        plan_replicated(prof, 1, 4, dataclasses.replace(base, memory_per_gpu=80 * MB,
                                                        replica_mode="ddp"))
    with pytest.raises(InvalidInputError, match="replica_mode 'zero3'"):
        plan_replicated(prof, 1, 4, options=PlanOptions(replica_mode="zero3"))
    with pytest.raises(InvalidInputError, match="replica_mode 'zero3'"):
        plan_replicated(prof, 1, 1, options=PlanOptions(replica_mode="zero3"))


def test_the_sharded_update_is_a_replicas_share() -> None:
    prof = dataclasses.replace(_heavy_profile(), blocks=tuple(
        dataclasses.replace(blk, update_ms=(("adam-mixed", 2.0),))
        for blk in _heavy_profile().blocks))
    base = PlanOptions(bandwidth_bytes_per_s=BANDWIDTH,
                       allreduce_bandwidth_bytes_per_s=BANDWIDTH, optimizer="adam-mixed")
    ddp = plan_replicated(prof, 1, 4, dataclasses.replace(base, replica_mode="ddp"))
    sharded = plan_replicated(prof, 1, 4,
                              dataclasses.replace(base, replica_mode="fsdp2-no-reshard"))
    assert ddp.update_ms == pytest.approx(8.0)
    assert sharded.update_ms == pytest.approx(2.0)  # each replica updates a quarter


def test_replica_mode_round_trips_and_old_files_load_as_ddp(tmp_path) -> None:
    sharded = plan_replicated(_heavy_profile(), 1, 4,
                              options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH,
                                                  optimizer="adam-mixed", replica_mode="fsdp2"))
    path = tmp_path / "plan.json"
    sharded.save(path)
    assert Plan.load(path) == sharded and Plan.load(path).replica_mode == "fsdp2"
    text = str(sharded)
    assert "replicas: FSDP2 (fully_shard along dp, resharding after forward)" in text
    data = format_1(json.loads(path.read_text()))
    del data["replica_mode"]
    path.write_text(json.dumps(data))
    assert Plan.load(path).replica_mode == "ddp"
    assert "replicas: DDP" in str(Plan.load(path))
    with pytest.raises(InvalidInputError, match="replica_mode"):
        dataclasses.replace(sharded, replica_mode="zero3")


def test_cli_table_shows_each_mode_of_a_layout(tmp_path, capsys) -> None:
    # three blocks of 4 MB weights: DDP holds 12 MB × 8 = 96 MB, FSDP2 over 2 replicas
    # 12 MB × (2 + 7/2) + 4 MB; 10 MB per sample across each cut makes a pipeline slow
    model, prof = _model_and_profile(tmp_path, param_bytes=4 * MB, saved_bytes=10**4,
                                     cut_bytes=10**7)
    out_plan = tmp_path / "plan.json"
    common = ["plan", model, "--profile", prof, "--gpus", "2", "--memory", "80000000",
              "--optimizer", "adam-mixed", "--bandwidth", "1GB", "--allreduce-bandwidth", "1GB",
              "-o", str(out_plan)]
    assert main(common) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("data parallel ×2"))
    assert "FSDP2 (no reshard) gathers" in row and "DDP does not fit: needs" in row, row
    assert Plan.load(out_plan).replica_mode == "fsdp2-no-reshard"
    assert "replicas: FSDP2" in out
    assert main([*common, "--replica-mode", "ddp", "--replicas", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit" in err[0], err


RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def test_predicted_fsdp2_memory_is_within_10_percent_of_one_measured_step() -> None:
    """``benchmarks/fsdp_check.py`` measured each plan's second step on gloo CPU ranks
    (torch's profiler) and saved the profiles it planned from: planned again here, every
    FSDP2 plan predicts what was measured beside it, each stage within 10 % of its ranks'."""
    data = json.loads((RESULTS / "fsdp_check.json").read_text())
    rows = [r for r in data["memory"] if r["mode"] != "ddp"]
    assert {r["stages"] for r in rows} == {1, 2} and len(rows) >= 4
    for r in rows:
        prof = Profile.load(RESULTS / r["profile"])
        plan = plan_replicated(prof, r["stages"], r["replicas"],
                               options=PlanOptions(optimizer="adam", split_size=r["split"],
                                                   replica_mode=r["mode"], schedule="gpipe"))
        predicted = [s.memory_bytes for s in plan.stages]
        assert predicted == r["predicted_bytes"], r["mode"]  # what was set beside the step
        p = r["stages"]
        for j, stage_bytes in enumerate(predicted):  # rank r · p + j runs stage j of replica r
            measured = max(r["measured_bytes"][j::p])
            assert stage_bytes == pytest.approx(measured, rel=0.10), (r["mode"], p, j)


def test_weights_shared_across_stages_keep_ddp() -> None:
    """The runtime keeps a tied weight's copies on several ranks equal on plain tensors: a
    layout of several stages with one is planned with DDP only; one stage holds every user."""
    tied = dataclasses.replace(_heavy_profile(), shared=(SharedParam("embed.weight", (0, 3),
                                                                     4 * MB),))
    layouts = plan_layouts(tied, 4,
                           options=PlanOptions(bandwidth_bytes_per_s=BANDWIDTH,
                                               optimizer="adam-mixed"))
    assert [m.mode for m in layouts.option(2, 2).modes] == ["ddp"]
    assert [m.mode for m in layouts.option(1, 4).modes] == ["ddp", "fsdp2",
                                                            "fsdp2-no-reshard"]


def test_sharding_refuses_a_mode_that_is_not_fsdp2() -> None:
    from autosplit.distributed.sharding import shard_stages

    with pytest.raises(InvalidInputError, match="mode='ddp'"):
        shard_stages([], None, "ddp")


def test_blocks_fsdp2_cannot_shard_keep_ddp(tmp_path: Path) -> None:
    """Where a block's graph reads weights directly (an unshardable graph reads every one), FSDP2
    has no module per block to gather in: the planner keeps DDP, and refuses FSDP2 asked for by
    name. The profile file keeps the fact; a file from before says nothing and loads as True."""
    unshardable = dataclasses.replace(_heavy_profile(), fsdp_units=False)
    unshardable.save(tmp_path / "unshardable.json")
    assert Profile.load(tmp_path / "unshardable.json").fsdp_units is False
    data = json.loads((tmp_path / "unshardable.json").read_text())
    del data["fsdp_units"]
    (tmp_path / "older.json").write_text(json.dumps(data))
    assert Profile.load(tmp_path / "older.json").fsdp_units is True
    base = PlanOptions(bandwidth_bytes_per_s=BANDWIDTH,
                       allreduce_bandwidth_bytes_per_s=BANDWIDTH, optimizer="adam-mixed")
    layouts = plan_layouts(unshardable, 4, base)
    assert [m.mode for m in layouts.option(1, 4).modes] == ["ddp"]
    assert {o.plan.replica_mode for o in layouts.options if o.plan is not None} == {"ddp"}
    with pytest.raises(InfeasiblePlanError):  # where only FSDP2 would fit
        plan_replicated(unshardable, 1, 4, dataclasses.replace(base, memory_per_gpu=80 * MB))
    with pytest.raises(InvalidInputError, match="no module its graph calls.*replica_mode='ddp'"):
        plan_replicated(unshardable, 1, 4, dataclasses.replace(base, replica_mode="fsdp2"))
    with pytest.raises(RecordError, match="fsdp_units"):
        dataclasses.replace(unshardable, fsdp_units="no")


def test_a_block_whose_graph_reads_its_weights_is_refused_by_fsdp2() -> None:
    """The runtime side: a stage whose graph reads a block's weights without calling the
    module holding them (torch.export's graphs) cannot be sharded block by block."""
    import torch
    from torch import fx, nn

    from autosplit.fsdp_units import block_units, shardable

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return x @ self.lin.weight.t()

    stage = nn.Module()
    stage.body = fx.symbolic_trace(nn.Sequential(Reads()))
    stage.blocks = ("0",)
    assert not [n for n in stage.body.graph.nodes if n.op == "call_module"]
    with pytest.raises(InvalidInputError, match="block '0'.*replica_mode='ddp'"):
        block_units(stage.body, stage.blocks)
    assert not shardable(stage.body, stage.blocks)
    called = nn.Module()
    called.body = fx.symbolic_trace(nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.ReLU())))
    called.blocks = ("0",)
    (unit,) = block_units(called.body, called.blocks)  # it calls 0.0 (0.1 holds nothing)
    assert unit is called.body.get_submodule("0.0")
    assert torch.is_tensor(unit.weight)
