"""Pipeline stages × data-parallel replicas: a 2-D DeviceMesh, DDP along "dp" (gloo, CPU).

Each launched run is compared with one process training the same model on the same m·d
micro-batches (replica r's are rows [r·B/d, (r+1)·B/d) of the batch, in order): the loss,
every parameter's gradient and the parameters after each SGD step. Every replica's copy of a
parameter, gradient or buffer is checked bit for bit equal to the others'. BatchNorm
statistics are replica 0's (broadcast to the others after every step), so their reference is
the one process's model run forward on replica 0's micro-batches only.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_distributed import (
    LONG_TIMEOUT_S,
    ROOT,
    TIMEOUT_S,
    _failing_worker,
    assert_same_training,
    batch,
    build,
    loss_fn,
    make_plan,
    one_rank_group,  # noqa: F401 - a fixture
    reference,
    train_and_gather,
)
from test_tied import LR, _merge

from autosplit import distributed
from autosplit.cli import main
from autosplit.errors import InvalidInputError
from autosplit.records import Plan


def hybrid_plan(name: str, balance: tuple[int, ...], replicas: int, split: int = 2,
                m: int = 2, schedule: str = "gpipe") -> Plan:
    """``balance`` stages × ``replicas`` replicas, m micro-batches of ``split`` per replica."""
    plan = make_plan(build(name), balance, split, m, schedule)
    return dataclasses.replace(plan, replicas=replicas, batch_size=replicas * m * split)


def _worker(cases: list[tuple[str, Plan, float]], steps: int) -> Any:
    """Train every (model, plan, learning rate); rank 0 returns the ranks' results merged
    (every copy held by two ranks checked bit for bit equal), the other ranks ``None``."""
    merged = []
    for name, plan, lr in cases:
        gathered = train_and_gather(name, plan, steps, lr)
        if gathered is not None:
            merged.append(_merge(gathered, len(plan.stages) - 1, steps))
    return merged if dist.get_rank() == 0 else None


def replica0_buffers(name: str, plan: Plan, expected: dict[str, Any]) -> list[dict[str, Any]]:
    """Buffers after each step when only replica 0's micro-batches update them: the one
    process's parameters of the step, run forward on those micro-batches (train mode)."""
    model = build(name)
    inputs, _ = batch(name, plan.batch_size)
    share = plan.microbatches * plan.split_size
    mbs = list(zip(*(x[:share].split(plan.split_size) for x in inputs)))
    params = dict(model.named_parameters())
    found = []
    with torch.no_grad():
        for step in expected["steps"]:
            for mb in mbs:
                model(*mb)
            found.append({n: b.clone() for n, b in model.named_buffers()})
            for n, value in step["params"].items():  # the next step starts from these
                params[n].copy_(value)
    return found


def check(cases: list[tuple[str, Plan, float]], ranks: int, steps: int = 2
          ) -> list[dict[str, Any]]:
    """Launch ``ranks`` ranks training every case; compare each with one process."""
    results = distributed.launch(_worker, ranks, cases, steps, timeout_s=TIMEOUT_S)
    for (name, plan, lr), got in zip(cases, results[0], strict=True):
        expected = reference(name, plan, steps, lr)
        for step, buffers in zip(expected["steps"], replica0_buffers(name, plan, expected)):
            step["buffers"] = buffers
        assert_same_training(got, expected)
    return results[0]


def test_two_stages_times_two_replicas_train_like_one_process() -> None:
    """4 ranks: replica 0 on ranks 0, 1, replica 1 on ranks 2, 3 (one launch, four runs).

    LongSkip under GPipe and 1F1B: a skip connection crosses the cut, BatchNorm keeps
    statistics. TiedLM: the embedding (stage 0) and the head (stage 1) share one weight,
    summed within each replica's pipeline and averaged by DDP over the replicas.
    """
    cases = [("skip", hybrid_plan("skip", (3, 4), 2, schedule=s), 0.1) for s in ("gpipe", "1f1b")]
    cases.append(("tied", hybrid_plan("tied", (3, 4), 2), LR))
    # 4 stages on 2 pipeline ranks × 2 replicas: interleaved schedule (ScheduleLoopedBFS)
    cases.append(("skip", hybrid_plan("skip", (2, 2, 2, 1), 2, m=4), 0.1))
    # a stage's replicas on consecutive ranks (the topology's "dp-inner"): mesh ("pp", "dp")
    cases.append(("tied", dataclasses.replace(hybrid_plan("tied", (3, 4), 2),
                                              placement="dp-inner", devices_per_node=2), LR))
    skip_gpipe, skip_1f1b, tied, looped, dp_inner = check(cases, 4)
    for got in (skip_gpipe, skip_1f1b, tied):
        assert got["stages_per_rank"] == [[0], [1], [0], [1]]
    assert dp_inner["stages_per_rank"] == [[0], [0], [1], [1]]
    assert "embed.weight" in dp_inner["copies"]
    assert looped["stages_per_rank"] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert {"norm.running_mean", "out.weight", "inp.weight"} <= skip_1f1b["copies"]
    assert "embed.weight" in tied["copies"]


def test_pure_data_parallel_trains_like_one_process() -> None:
    """p = 1, d = 2: one stage per rank, a 1-stage schedule, DDP with no_sync accumulation."""
    (got,) = check([("toy", hybrid_plan("toy", (2,), 2, m=3), 0.1)], 2)
    assert got["stages_per_rank"] == [[0], [0]]
    assert got["copies"] == {"net1.weight", "net1.bias", "net2.weight", "net2.bias"}


def _loss_worker(plan: Plan, steps: int) -> Any:
    """Each rank's step losses with the replicas' losses averaged every step and without."""
    found = {}
    for reduce in (True, False):
        inputs, targets = batch("toy", plan.batch_size)
        trainer = distributed.Trainer(build("toy"), plan, loss_fn,
                                      lambda ps: torch.optim.SGD(ps, lr=0.1), reduce_loss=reduce)
        found[reduce] = [float(trainer.step(inputs, targets)) for _ in range(steps)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    return gathered if dist.get_rank() == 0 else None


def test_the_replicas_losses_are_averaged_by_the_caller_when_asked() -> None:
    # reduce_loss=False spares a synchronisation per step: each replica returns its own mean,
    # and their mean is the loss every replica returns by default (the same training)
    plan = hybrid_plan("toy", (2,), 2, m=3)
    ranks = distributed.launch(_loss_worker, 2, plan, 3, timeout_s=TIMEOUT_S)[0]
    reduced = [r[True] for r in ranks]
    own = [r[False] for r in ranks]
    assert reduced[0] == reduced[1]
    assert own[0] != own[1]  # replica 0's rows are not replica 1's
    for step, (a, b) in enumerate(zip(*own)):
        assert (a + b) / 2 == pytest.approx(reduced[0][step], rel=1e-6)


def test_dead_rank_ends_a_hybrid_run() -> None:
    plan = hybrid_plan("toy", (1, 1), 2, m=3)
    start = time.monotonic()
    with pytest.raises(distributed.RankFailedError) as info:
        distributed.launch(_failing_worker, 4, plan, "raise", timeout_s=LONG_TIMEOUT_S)
    assert info.value.rank == 1 and "injected failure" in str(info.value)
    assert time.monotonic() - start < LONG_TIMEOUT_S  # ended by the failure, not the timeout


def test_bad_replica_layouts_are_refused(one_rank_group: None) -> None:  # noqa: F811
    plan = hybrid_plan("toy", (1, 1), 2)
    with pytest.raises(InvalidInputError, match="multiple of 2 ranks"):
        distributed.Trainer(build("toy"), plan, lambda out, y: out.sum())
    with pytest.raises(InvalidInputError, match="mesh="):
        distributed.Trainer(build("toy"), plan, lambda out, y: out.sum(), group=dist.group.WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    from autosplit.distributed.replicas import replicate_stages

    flat = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    with pytest.raises(InvalidInputError, match=r"dimensions \('dp', 'pp'\)"):
        distributed.mesh_place(1, torch.device("cpu"), mesh=flat)
    square = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    place = distributed.mesh_place(1, torch.device("cpu"), mesh=square)
    shared = torch.nn.Linear(2, 2)  # one layer in two stages held by this rank
    with pytest.raises(InvalidInputError, match="used by two stages of one rank"):
        replicate_stages([torch.nn.Sequential(shared), torch.nn.Sequential(shared)], place,
                         torch.device("cpu"))


def test_cli_run_trains_a_hybrid_plan_on_four_ranks(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import toy  # examples/toy.py

        model = toy.build_model()
    finally:
        sys.path.remove(str(ROOT / "examples"))
    plan = make_plan(model, (1, 1), 2, 2)
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, replicas=2, batch_size=8).save(path)
    code = main(["run", str(ROOT / "examples" / "toy.py"), "--plan", str(path), "--steps", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "2 stages × 2 replicas" in out and "4 ranks" in out and "step 2" in out
    assert main(["run", str(ROOT / "examples" / "toy.py"), "--plan", str(path),
                 "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --nproc 3") and len(err.strip().splitlines()) == 1
    assert main(["run", str(ROOT / "examples" / "toy.py"), "--plan", str(path),
                 "--batch-size", "4"]) == 2
    assert "2 replicas × 2 micro-batches of 2 = 8 rows" in capsys.readouterr().err


@pytest.mark.long
def test_torchrun_launches_a_two_by_two_plan_on_four_local_ranks(tmp_path) -> None:
    import shutil
    import subprocess

    toy = str(Path(__file__).resolve().parent.parent / "examples" / "toy.py")
    plan = tmp_path / "plan.json"
    assert main(["plan", toy, "--gpus", "4", "--replicas", "2", "--microbatch-sizes", "2,5",
                 "--repeats", "1", "--no-verify", "-o", str(plan)]) == 0
    saved = Plan.load(plan)
    assert (len(saved.stages), saved.replicas) == (2, 2)
    torchrun = shutil.which("torchrun") or pytest.skip("no torchrun on PATH")
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "4", "-m", "autosplit", "run", toy,
         "--plan", str(plan), "--steps", "2", "--timeout", "120"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "on 4 ranks (torchrun)" in done.stdout
    assert [line.split()[0] for line in done.stdout.splitlines()
            if line.startswith("step ")] == ["step", "step"]
    assert done.stderr.count("joining the rendezvous") == 4  # every rank says where it joins
