"""The Hugging Face models the benchmarks train (random weights, their own causal-LM loss):
a tiny Llama (``LlamaForCausalLM``, examples/llama.py's sizes) and a tiny GPT-2
(``GPT2LMHeadModel``, tied embeddings: :data:`GPT2_SIZES`), inputs ``input_ids``,
``attention_mask`` and ``labels`` of :data:`SEQUENCE` tokens; rebuilt seeded in every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from common import load_example
from harness import ModelSpec
from torch import nn

SEQUENCE = 32
GPT2_SIZES = {
    # name: (layers, n_embd, heads, vocabulary)
    "tiny": (4, 64, 4, 256),
    "small": (8, 128, 4, 1024),
}


@dataclass(frozen=True)
class HFSpec(ModelSpec):
    """``hf-llama-<size>`` (examples/llama.py) or ``hf-gpt2-<size>`` (:data:`GPT2_SIZES`):
    keyword inputs, the model's own loss; rebuilt seeded in every rank."""

    @property
    def family(self) -> str:
        return self.key.split("-")[1]

    @property
    def size(self) -> str:
        return self.key.split("-", 2)[2]

    @property
    def describe(self) -> str:
        return f"B={self.batch} × {SEQUENCE} tokens"

    def config(self) -> dict[str, Any]:
        if self.family == "llama":
            layers, width, heads, kv, mlp, vocab = load_example("llama").SIZES[self.size]
            return {"layers": layers, "hidden": width, "heads": heads, "kv_heads": kv,
                    "mlp": mlp, "vocab": vocab, "tokens": SEQUENCE, "tied": False}
        layers, width, heads, vocab = GPT2_SIZES[self.size]
        return {"layers": layers, "hidden": width, "heads": heads, "mlp": 4 * width,
                "vocab": vocab, "tokens": SEQUENCE, "tied": True}

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        if self.family == "llama":
            return load_example("llama").build_model(self.size)
        from transformers import GPT2Config, GPT2LMHeadModel

        layers, width, heads, vocab = GPT2_SIZES[self.size]
        config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                            n_positions=2 * SEQUENCE, bos_token_id=0, eos_token_id=0,
                            tie_word_embeddings=True, attn_implementation="sdpa")
        return GPT2LMHeadModel(config)

    def make_inputs(self) -> tuple[torch.Tensor, ...]:
        return ()

    def make_kwargs(self) -> dict[str, torch.Tensor]:
        torch.manual_seed(self.seed + 1)
        vocab = self.config()["vocab"]
        ids = torch.randint(0, vocab, (self.batch, SEQUENCE))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
