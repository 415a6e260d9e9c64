"""torchtitan's own Llama 3 debug model (random weights), for ``--emit-torchtitan``.

A model file for ``autosplit``: ``build_model()`` and ``example_inputs(batch_size)``. autosplit
captures it as torchtitan names its modules (``tok_embeddings``, ``layers.0`` … ``layers.5``,
``norm``, ``output``), so a plan's stages are torchtitan's model parts::

    autosplit plan examples/torchtitan_llama3.py --gpus 2 --emit-torchtitan job.toml

Needs the optional extra: ``pip install -e '.[titan]'``.
"""

from __future__ import annotations

import dataclasses

import torch

SEQUENCE = 64  # tokens per sample
BATCH_SIZE = 16


def build_model() -> torch.nn.Module:
    """torchtitan's ``llama3_args["debugmodel"]`` (6 layers, width 256), its rotary table cut
    to :data:`SEQUENCE`, initialised as torchtitan initialises it."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    model = Transformer(dataclasses.replace(llama3_args["debugmodel"], max_seq_len=SEQUENCE))
    model.init_weights()
    return model


def example_inputs(batch_size: int = BATCH_SIZE) -> torch.Tensor:
    """A batch of random token ids."""
    from torchtitan.models.llama3 import llama3_args

    return torch.randint(0, llama3_args["debugmodel"].vocab_size, (batch_size, SEQUENCE))
