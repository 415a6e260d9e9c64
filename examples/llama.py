"""A tiny Llama from Hugging Face transformers (random weights), trained on its own loss.

A model file for ``autosplit``: ``build_model(size)`` and ``example_inputs(batch_size)``.
``example_inputs`` returns keyword inputs, as a Hugging Face model is called:
``input_ids``, ``attention_mask`` and ``labels``; with ``labels`` the model returns its own
causal-language-model loss, which ``autosplit`` profiles and ``autosplit run`` trains on.
Needs the optional extra: ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import torch

SIZES = {
    # name: (layers, width, heads, key-value heads, MLP width, vocabulary)
    "tiny": (4, 64, 4, 2, 128, 256),
    "small": (8, 128, 4, 2, 352, 1024),
}
SEQUENCE = 32  # tokens per sample


def build_model(size: str = "small") -> torch.nn.Module:
    """A randomly initialised LlamaForCausalLM of one of :data:`SIZES`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, width, heads, kv_heads, mlp, vocab = SIZES[size]
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=mlp, vocab_size=vocab,
        max_position_embeddings=2 * SEQUENCE, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def example_inputs(batch_size: int = 16, size: str = "small") -> dict[str, torch.Tensor]:
    """A batch of random token ids, a full attention mask, and the ids as labels."""
    vocab = SIZES[size][5]
    ids = torch.randint(0, vocab, (batch_size, SEQUENCE))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
