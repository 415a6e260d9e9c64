"""A plan as torchtitan's job config: the degrees, schedule, micro-batch size and model parts it
reads, read back by torchtitan's own config loader; plans it cannot express are refused."""

from __future__ import annotations

import dataclasses

import pytest
import tomllib
import torch
from synthetic import make_profile
from torch import nn

import autosplit
from autosplit import PlanOptions
from autosplit.errors import CodegenError
from autosplit.export import torchtitan_config
from autosplit.planner import plan_layouts
from autosplit.records import Profile


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(h))


class Tiny(nn.Module):
    """torchtitan's shape: embeddings, a ModuleList of layers, a norm and an output."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _profile(model: nn.Module, example: torch.Tensor, **options) -> Profile:
    graph = autosplit.trace(model, example_inputs=(example,), **options)
    n = len(graph.block_names)
    prof = make_profile([2, 4], [[1.0 + i % 3, 0.9 + i % 2] for i in range(n)], batch_size=8,
                        param_bytes=[1024] * n, cut_bytes_per_sample=[64] * (n - 1))
    blocks = tuple(dataclasses.replace(b, name=name)
                   for b, name in zip(prof.blocks, graph.block_names))
    return dataclasses.replace(prof, model=graph.model_name, fingerprint=graph.fingerprint,
                               blocks=blocks, allreduce_bytes_per_s=1e9,
                               allreduce_latency_ms=0.1, link_bytes_per_s=1e9)


def _parts_cover(parts: list[list[str]], model: nn.Module) -> None:
    """Every top-level module and every entry of a top-level ModuleList or ModuleDict in
    exactly one part."""
    units = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            units += [f"{name}.{key}" for key, _ in child.named_children()]
        else:
            units.append(name)
    assert sorted(m for part in parts for m in part) == sorted(units)


@pytest.mark.parametrize("schedule, stages_per_rank, name", [
    ("gpipe", 1, "GPipe"), ("1f1b", 1, "1F1B"), ("interleaved-1f1b", 2, "Interleaved1F1B"),
    ("zbv", 2, "ZBVZeroBubble")])
def test_a_pipeline_becomes_torchtitans_parallelism(schedule: str, stages_per_rank: int,
                                                    name: str) -> None:
    model = Tiny()
    prof = _profile(model, torch.randint(0, 32, (8, 5)))
    if schedule == "zbv":  # zero-bubble plans need the backward's split
        prof = dataclasses.replace(prof, blocks=tuple(dataclasses.replace(
            b, input_grad_ms=tuple(x / 2 for x in b.bwd_ms),
            weight_grad_ms=tuple(x / 2 for x in b.bwd_ms)) for b in prof.blocks))
    plan = autosplit.plan(prof, 2, options=PlanOptions(schedule=schedule))
    assert plan.stages_per_rank == stages_per_rank
    config = tomllib.loads(torchtitan_config(plan, model, source="autosplit plan tiny.py"))
    par = config["parallelism"]
    assert par["pipeline_parallel_degree"] == 2
    assert par["pipeline_parallel_schedule"] == name
    assert par["pipeline_parallel_microbatch_size"] == plan.split_size
    assert par["module_fqns_per_model_part"] == [list(s.blocks) for s in plan.stages]
    assert len(par["module_fqns_per_model_part"]) == 2 * stages_per_rank
    _parts_cover(par["module_fqns_per_model_part"], model)
    assert par["data_parallel_replicate_degree"] == 1 and par["data_parallel_shard_degree"] == 1
    assert config["training"]["local_batch_size"] == plan.batch_size
    assert config["activation_checkpoint"]["mode"] == "none"


def test_replicas_and_checkpointing_are_written() -> None:
    model = Tiny()
    prof = _profile(model, torch.randint(0, 32, (8, 5)))
    plan = plan_layouts(prof, 4, replicas=2, options=PlanOptions(schedule="gpipe")).best
    assert (len(plan.stages), plan.replicas) == (2, 2)
    checked = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, checkpoint=True) for s in plan.stages))
    config = tomllib.loads(torchtitan_config(checked, model))
    assert config["parallelism"]["data_parallel_replicate_degree"] == 2
    assert config["training"]["local_batch_size"] == plan.batch_size // 2
    assert config["activation_checkpoint"]["mode"] == "full"


def test_sharded_replicas_are_written_as_fsdp(tmp_path) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    model = Tiny()
    prof = _profile(model, torch.randint(0, 32, (8, 5)))
    for mode, policy in (("fsdp2", "always"), ("fsdp2-no-reshard", "never")):
        plan = plan_layouts(prof, 4, replicas=2,
                            options=PlanOptions(schedule="gpipe", replica_mode=mode)).best
        assert plan.replica_mode == mode
        path = tmp_path / f"{mode}.toml"
        path.write_text(torchtitan_config(plan, model))
        job = ConfigManager().parse_args(["--job.config_file", str(path)])
        assert job.parallelism.data_parallel_shard_degree == 2
        assert job.parallelism.data_parallel_replicate_degree == 1
        assert job.parallelism.fsdp_reshard_after_forward == policy


def test_what_torchtitan_cannot_express_is_refused() -> None:
    model = Tiny()
    x = torch.randint(0, 32, (8, 5))
    plan = autosplit.plan(_profile(model, x), 2, options=PlanOptions(schedule="gpipe"))
    mixed = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], checkpoint=True), *plan.stages[1:]))
    with pytest.raises(CodegenError, match="checkpoints some stages and not others"):
        torchtitan_config(mixed, model)
    fine = autosplit.plan(_profile(model, x, granularity="layer"), 2,
                          options=PlanOptions(schedule="gpipe"))
    assert any(b.count(".") == 2 for s in fine.stages for b in s.blocks)  # layers.0.lin …
    with pytest.raises(CodegenError, match="cannot keep apart"):
        torchtitan_config(fine, model)
    other = Tiny(layers=5)  # a module in no stage
    with pytest.raises(CodegenError, match="layers.4 is in no stage"):
        torchtitan_config(plan, other)


def test_torchtitans_loader_reads_the_file_and_its_llama3_splits_into_the_parts(
        tmp_path) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = dataclasses.replace(llama3_args["debugmodel"], max_seq_len=64)
    model = Transformer(args)
    prof = _profile(model, torch.randint(0, args.vocab_size, (8, 16)))
    plan = autosplit.plan(prof, 2, options=PlanOptions(schedule="1f1b"))
    path = tmp_path / "job.toml"
    path.write_text(torchtitan_config(plan, model))
    job = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert job.parallelism.pipeline_parallel_degree == 2
    assert job.parallelism.pipeline_parallel_schedule == "1F1B"
    assert job.parallelism.pipeline_parallel_microbatch_size == plan.split_size
    assert job.parallelism.module_fqns_per_model_part == [list(s.blocks) for s in plan.stages]
    assert job.training.local_batch_size == plan.batch_size
    assert job.activation_checkpoint.mode == "none"
    _parts_cover(job.parallelism.module_fqns_per_model_part, model)


MODEL_FILE = '''
import torch
from torch import nn

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h):
        return torch.relu(self.lin(h))

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 32)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

def build_model():
    return Tiny()

def example_inputs(batch_size=8):
    return torch.randint(0, 32, (batch_size, 5))
'''


def test_the_command_writes_the_job_file_or_says_in_one_line_why_not(tmp_path, capsys) -> None:
    from autosplit.cli import main
    from autosplit.modelfile import load_model_file

    path = tmp_path / "tiny.py"
    path.write_text(MODEL_FILE)
    model = load_model_file(str(path)).build()
    ids = torch.randint(0, 32, (8, 5))
    for granularity, ok in (("block", True), ("layer", False)):
        prof = tmp_path / f"{granularity}.json"
        _profile(model, ids, granularity=granularity).save(prof)
        job = tmp_path / f"{granularity}.toml"
        code = main(["plan", str(path), "--gpus", "2", "--profile", str(prof), "--granularity",
                     granularity, "--schedule", "1f1b", "--emit-torchtitan", str(job),
                     "-o", str(tmp_path / "plan.json")])
        _, err = capsys.readouterr()
        if ok:
            assert code == 0, err
            config = tomllib.loads(job.read_text())
            assert config["parallelism"]["pipeline_parallel_schedule"] == "1F1B"
            assert "made by: autosplit plan" in job.read_text()
        else:
            assert code == 2 and not job.exists()
            assert err.count("\n") == 1 and "cannot keep apart" in err
