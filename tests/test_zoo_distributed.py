"""Hugging Face GPT-2 (tied embeddings) and Llama, keyword inputs and their own loss, trained
on 2 gloo ranks with torch.distributed.pipelining: the loss, every gradient and the parameters
after one SGD step equal one process on the same micro-batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from synthetic import even_balance, plan_of
from zoo import build

from autosplit import distributed
from autosplit.capture.exported import hf_defaults
from autosplit.capture.trace import trace
from autosplit.measure.losses import model_loss
from autosplit.records import Plan
from autosplit.stages import split

pytest.importorskip("transformers")

ROWS, SPLIT, LR = 4, 2, 0.1


def _worker(name: str, plan: Plan) -> Any:
    model, call = build(name)
    args, kwargs = call(ROWS)
    trainer = distributed.Trainer(model, plan, model_loss,
                                  lambda ps: torch.optim.SGD(ps, lr=LR),
                                  example_inputs=args, example_kwargs=kwargs)
    grads: dict[str, torch.Tensor] = {}

    def keep() -> None:
        grads.update({n: p.grad.clone() for n, p in trainer.named_parameters()
                      if p.grad is not None})

    original = trainer._finish_gradients

    def finish() -> None:  # the gradients as the optimizer sees them
        original()
        keep()

    trainer._finish_gradients = finish  # type: ignore[method-assign]
    loss = trainer.step(args if trainer.holds_first else None, None,
                        kwargs=kwargs if trainer.holds_first else None)
    params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (None if loss is None else float(loss), grads, params))
    return gathered


def _reference(name: str) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every launched rank
    try:
        model, call = build(name)
        args, kwargs = call(ROWS)
        kwargs = {**hf_defaults(model, kwargs), **kwargs}
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        total = 0.0
        micro = split((args, kwargs), SPLIT)
        for a, k in micro:
            loss = model(*a, **k).loss / len(micro)
            loss.backward()
            total += float(loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        return total, grads, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama", "hf-albert"])
def test_two_gloo_ranks_train_like_one_process(name: str) -> None:
    model, call = build(name)
    args, kwargs = call(ROWS)
    graph = trace(model, example_inputs=args, example_kwargs=kwargs)
    plan = plan_of(graph, even_balance(len(graph.blocks), 2), SPLIT, ROWS // SPLIT)
    results = distributed.launch(_worker, 2, name, plan, timeout_s=240)
    ranks = results[0]
    losses = [loss for loss, _, _ in ranks if loss is not None]
    grads: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for _, g, p in ranks:
        grads.update(g)
        params.update(p)
    ref_loss, ref_grads, ref_params = _reference(name)
    assert len(losses) == 1
    torch.testing.assert_close(losses[0], ref_loss)
    if name == "hf-gpt2":  # the tied embedding is on both ranks: one name, summed gradient
        assert "transformer.wte.weight" in grads
    assert grads.keys() == {n for n, _ in model.named_parameters()}
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, msg=n)
        torch.testing.assert_close(params[n], ref_params[n], msg=n)
