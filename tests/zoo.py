"""Models nobody here wrote, at tiny configurations with random weights: Hugging Face
transformers, timm and torchvision. Each entry builds a fresh model (seeded) and one call of it
as ``(args, kwargs)`` with ``rows`` rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _ids(rows: int, vocab: int, length: int = 8) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))


def gpt2() -> tuple[nn.Module, Callable[[int], Call]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg), lambda rows: ((), {"input_ids": _ids(rows, 64),
                                                    "labels": _ids(rows, 64)})


def llama() -> tuple[nn.Module, Callable[[int], Call]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=16, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, vocab_size=64,
                      max_position_embeddings=16)

    def call(rows: int) -> Call:
        ids = _ids(rows, 64)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # one row padded on the left
        return (), {"input_ids": ids, "attention_mask": mask, "labels": ids}

    return LlamaForCausalLM(cfg), call


def bert() -> tuple[nn.Module, Callable[[int], Call]]:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_hidden_layers=4, hidden_size=16, num_attention_heads=2,
                     intermediate_size=32, vocab_size=64, max_position_embeddings=16,
                     num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def call(rows: int) -> Call:
        ids = _ids(rows, 64)
        labels = torch.arange(rows) % 3
        return (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    return BertForSequenceClassification(cfg), call


def albert() -> tuple[nn.Module, Callable[[int], Call]]:
    """ALBERT runs one layer for all its depth: each call is a block, the layer's weights
    shared by every stage that calls it."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    cfg = AlbertConfig(num_hidden_layers=4, hidden_size=16, num_attention_heads=2,
                       intermediate_size=32, vocab_size=64, embedding_size=8,
                       max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)

    def call(rows: int) -> Call:
        ids = _ids(rows, 64)
        return (), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "labels": torch.arange(rows) % 3}

    return AlbertForSequenceClassification(cfg), call


def t5() -> tuple[nn.Module, Callable[[int], Call]]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(num_layers=2, num_decoder_layers=2, d_model=16, d_kv=8, d_ff=32, num_heads=2,
                   vocab_size=64, dropout_rate=0.0, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg), lambda rows: ((), {"input_ids": _ids(rows, 64),
                                                               "labels": _ids(rows, 64, 6)})


def hf_vit() -> tuple[nn.Module, Callable[[int], Call]]:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(num_hidden_layers=4, hidden_size=16, num_attention_heads=2,
                    intermediate_size=32, image_size=16, patch_size=8, num_labels=3,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg), lambda rows: (
        (), {"pixel_values": torch.randn(rows, 3, 16, 16), "labels": torch.arange(rows) % 3})


def timm_vit() -> tuple[nn.Module, Callable[[int], Call]]:
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16,
                              patch_size=8, depth=4, embed_dim=16, num_heads=2, num_classes=3)
    return model, lambda rows: ((torch.randn(rows, 3, 16, 16),), {})


def timm_efficientnet() -> tuple[nn.Module, Callable[[int], Call]]:
    import timm

    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=3)
    return model, lambda rows: ((torch.randn(rows, 3, 32, 32),), {})


def timm_efficientvit() -> tuple[nn.Module, Callable[[int], Call]]:
    """EfficientViT's attention runs in an autocast region: torch.export's higher-order
    operation, whose body is a module of the graph."""
    import timm

    model = timm.create_model("efficientvit_b0", pretrained=False, num_classes=3,
                              widths=(4, 8, 16, 32, 64), depths=(1, 1, 1, 2, 2), head_dim=8,
                              head_widths=(64, 80))
    return model, lambda rows: ((torch.randn(rows, 3, 32, 32),), {})


def tv_vit() -> tuple[nn.Module, Callable[[int], Call]]:
    from torchvision.models.vision_transformer import VisionTransformer

    model = VisionTransformer(image_size=16, patch_size=8, num_layers=4, num_heads=2,
                              hidden_dim=16, mlp_dim=32, num_classes=3)
    return model, lambda rows: ((torch.randn(rows, 3, 16, 16),), {})


def tv_segmentation() -> tuple[nn.Module, Callable[[int], Call]]:
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large

    model = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)
    return model, lambda rows: ((torch.randn(rows, 3, 32, 32),), {})


ZOO: dict[str, Callable[[], tuple[nn.Module, Callable[[int], Call]]]] = {
    "hf-gpt2": gpt2, "hf-llama": llama, "hf-bert": bert, "hf-albert": albert, "hf-t5": t5, "hf-vit": hf_vit,
    "timm-vit": timm_vit, "timm-efficientnet": timm_efficientnet,
    "timm-efficientvit": timm_efficientvit, "tv-vit": tv_vit,
    "tv-segmentation": tv_segmentation,
}


def build(name: str) -> tuple[nn.Module, Callable[[int], Call]]:
    """A fresh model ``name`` of :data:`ZOO` (seeded) and its call of ``rows`` rows."""
    torch.manual_seed(0)
    return ZOO[name]()
