"""The PyTorch tutorial's one-process model parallelism (what ``tutorial.py`` runs on two GPUs):
its hand split of a ResNet over two devices, and the timing of it in this process."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from harness import LR, ModelSpec, add_machine_load, start_marks, sync
from torch import nn

from autosplit import distributed
from autosplit.measure import steal_time


class TwoDeviceResNet(nn.Module):
    """The tutorial's hand split of a torchvision ResNet in one process: ``conv1 … layer2`` on
    ``devices[0]``, ``layer3 … fc`` on ``devices[1]``. ``split_size=None`` runs the whole batch
    through (ModelParallelResNet50); a split size pipelines micro-batches: while the second half
    runs micro-batch i, the first half is launched on micro-batch i + 1
    (PipelineParallelResNet50; the overlap comes from CUDA's asynchronous launches)."""

    def __init__(self, resnet: nn.Module, devices: Sequence[torch.device],
                 split_size: int | None = None) -> None:
        super().__init__()
        self.devices = tuple(torch.device(d) for d in devices)
        r: Any = resnet
        self.front = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2).to(self.devices[0])
        self.back = nn.Sequential(r.layer3, r.layer4, r.avgpool, nn.Flatten(1), r.fc).to(self.devices[1])
        self.split_size = split_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_size is None:
            return self.back(self.front(x).to(self.devices[1]))
        chunks = iter(x.split(self.split_size))
        ahead = self.front(next(chunks)).to(self.devices[1])
        outputs = []
        for chunk in chunks:
            outputs.append(self.back(ahead))  # queued on the second device …
            ahead = self.front(chunk).to(self.devices[1])  # … while the first takes the next
        outputs.append(self.back(ahead))
        return torch.cat(outputs)


def time_in_process(spec: ModelSpec, configs: list[tuple[str, int | None]], devices: list[torch.device],
                repeats: int, batches: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """The tutorial on two devices in this process. ``configs``: (label, split size or None for
    the model-parallel version, or -1 for one device)."""
    if any(d.type == "cpu" for d in devices):
        torch.set_num_threads(1)  # a CPU "device" is one worker of one thread, as in process mode
    inputs = spec.make_inputs()[0]
    single = spec.build().to(devices[0])
    split = TwoDeviceResNet(spec.build(), devices)
    targets = distributed.tutorial_targets(single, (inputs,))[0]
    models = {"single": (single, torch.optim.SGD(single.parameters(), lr=LR)),
              "split": (split, torch.optim.SGD(split.parameters(), lr=LR))}

    def timing(label: str, split_size: int | None) -> float:
        model, optimizer = models["single" if split_size == -1 else "split"]
        if split_size != -1:
            split.split_size = split_size
        for d in devices:
            sync(d)
        start = time.perf_counter()
        for _ in range(batches):
            optimizer.zero_grad(set_to_none=True)
            out = model(inputs.to(devices[0]))
            distributed.tutorial_loss(out, (targets.to(out.device),)).backward()
            optimizer.step()
        for d in devices:
            sync(d)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {label: [] for label, _ in configs}
    marks: dict[str, Any] = {}
    for r in range(repeats + 1):  # round 0: warm-up
        if r == 1:
            marks = start_marks()
        order = configs if r % 2 == 0 else list(reversed(configs))
        for label, split_size in order:
            seconds = timing(label, split_size)
            if r:
                times[label].append(seconds)
        print(f"  {'warm-up' if r == 0 else f'round {r}/{repeats}'} done", flush=True)
    wall = time.perf_counter() - marks["wall"]
    load: dict[str, Any] = {"wall_s": wall, "ranks_cpu_s": time.process_time() - marks["own"]}
    after = steal_time.cpu_seconds()
    add_machine_load(load, marks, after)
    return times, load
