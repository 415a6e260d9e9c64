"""The models of benchmarks/model_zoo.py: Hugging Face transformers, timm and torchvision models
beyond the test zoo (tests/zoo.py), at tiny configurations with random weights and dropout off
(so that a split model can equal the unsplit one). Each entry builds a model and one call of
it, ``(args, kwargs)``, of ``rows`` rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Call = tuple[tuple[Any, ...], dict[str, Any]]
Builder = Callable[[], tuple[nn.Module, Callable[[int], Call]]]

SMALL = dict(
    num_hidden_layers=4,
    hidden_size=16,
    num_attention_heads=2,
    intermediate_size=32,
    vocab_size=64,
    max_position_embeddings=16,
)
"""The size of every tiny Hugging Face transformer here (4 layers of width 16)."""


def _ids(rows: int, length: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (rows, length), generator=torch.Generator().manual_seed(seed))


def _hf(model_class: str, config_class: str, **config: Any) -> nn.Module:
    import transformers

    return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))


def causal_lm(model_class: str, config_class: str, **config: Any) -> Builder:
    """A causal language model called with ``input_ids``, a left-padded ``attention_mask`` and
    ``labels`` (it returns its own loss)."""

    def build() -> tuple[nn.Module, Callable[[int], Call]]:
        def call(rows: int) -> Call:
            ids = _ids(rows)
            mask = torch.ones_like(ids)
            mask[0, :2] = 0
            return (), {"input_ids": ids, "attention_mask": mask, "labels": ids}

        return _hf(model_class, config_class, **config), call

    return build


def classifier(model_class: str, config_class: str, labels: bool = True, **config: Any) -> Builder:
    """A sequence classifier of 3 labels, called with ids, a mask and (``labels``) labels."""

    def build() -> tuple[nn.Module, Callable[[int], Call]]:
        def call(rows: int) -> Call:
            ids = _ids(rows)
            given = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            return (), {**given, "labels": torch.arange(rows) % 3} if labels else given

        return _hf(model_class, config_class, num_labels=3, **config), call

    return build


def seq2seq(
    model_class: str, config_class: str, inputs: str = "input_ids", **config: Any
) -> Builder:
    """An encoder-decoder called with its inputs and ``labels`` of 6 tokens."""

    def build() -> tuple[nn.Module, Callable[[int], Call]]:
        def call(rows: int) -> Call:
            given = _ids(rows) if inputs == "input_ids" else torch.randn(rows, 8, 16)
            return (), {inputs: given, "labels": _ids(rows, 6, seed=2)}

        return _hf(model_class, config_class, **config), call

    return build


def hf_image(model_class: str, config_class: str, **config: Any) -> Builder:
    """A Hugging Face image classifier of 3 labels on 32 × 32 images."""

    def build() -> tuple[nn.Module, Callable[[int], Call]]:
        return _hf(model_class, config_class, num_labels=3, **config), lambda rows: (
            (),
            {"pixel_values": torch.randn(rows, 3, 32, 32), "labels": torch.arange(rows) % 3},
        )

    return build


def clip(return_loss: bool) -> Builder:
    """CLIP's two towers on ids and 32 × 32 images; ``return_loss``: its contrastive loss, over
    the whole batch."""

    def build() -> tuple[nn.Module, Callable[[int], Call]]:
        text = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                    intermediate_size=32, vocab_size=64, max_position_embeddings=16)
        vision = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                      intermediate_size=32, image_size=32, patch_size=8)
        model = _hf("CLIPModel", "CLIPConfig", text_config=text, vision_config=vision,
                    projection_dim=8)

        def call(rows: int) -> Call:
            given = {"input_ids": _ids(rows), "pixel_values": torch.randn(rows, 3, 32, 32)}
            return (), {**given, "return_loss": True} if return_loss else given

        return model, call

    return build


def hf_inputs(model_class: str, config_class: str, make: Callable[[int], dict[str, Any]],
              **config: Any) -> Builder:
    """A Hugging Face model called with the keyword inputs ``make(rows)``."""

    def build() -> tuple[nn.Module, Callable[[int], Call]]:
        return _hf(model_class, config_class, **config), lambda rows: ((), make(rows))

    return build


def timm_model(name: str, size: int = 32, **kwargs: Any) -> Builder:
    """A timm model of 3 classes on ``size`` × ``size`` images."""

    def build() -> tuple[nn.Module, Callable[[int], Call]]:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=3, **kwargs)
        return model, lambda rows: ((torch.randn(rows, 3, size, size),), {})

    return build


def torchvision_model(
    name: str, size: int = 32, shape: tuple[int, ...] = (3,), **kwargs: Any
) -> Builder:
    """A torchvision model (``torchvision.models.get_model``) on ``size`` × ``size`` inputs of
    ``shape`` leading dimensions."""

    def build() -> tuple[nn.Module, Callable[[int], Call]]:
        import torchvision

        model = torchvision.models.get_model(name, weights=None, **kwargs)
        return model, lambda rows: ((torch.randn(rows, *shape, size, size),), {})

    return build


KV = dict(num_key_value_heads=1)
MODELS: dict[str, tuple[str, Builder]] = {
    # name: (family, builder)
    "Qwen2ForCausalLM": (
        "transformers",
        causal_lm("Qwen2ForCausalLM", "Qwen2Config", **KV, **SMALL),
    ),
    "Qwen3ForCausalLM": (
        "transformers",
        causal_lm("Qwen3ForCausalLM", "Qwen3Config", head_dim=8, **KV, **SMALL),
    ),
    "MistralForCausalLM": (
        "transformers",
        causal_lm("MistralForCausalLM", "MistralConfig", **KV, **SMALL),
    ),
    "MixtralForCausalLM": (
        "transformers",
        causal_lm(
            "MixtralForCausalLM",
            "MixtralConfig",
            num_local_experts=4,
            num_experts_per_tok=2,
            **KV,
            **SMALL,
        ),
    ),
    "GemmaForCausalLM": (
        "transformers",
        causal_lm("GemmaForCausalLM", "GemmaConfig", head_dim=8, **KV, **SMALL),
    ),
    "Gemma2ForCausalLM": (
        "transformers",
        causal_lm("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, **KV, **SMALL),
    ),
    "Phi3ForCausalLM": (
        "transformers",
        causal_lm("Phi3ForCausalLM", "Phi3Config", pad_token_id=0, **KV, **SMALL),
    ),
    "OlmoForCausalLM": (
        "transformers",
        causal_lm("OlmoForCausalLM", "OlmoConfig", pad_token_id=0, **KV, **SMALL),
    ),
    "GPTNeoXForCausalLM": (
        "transformers",
        causal_lm(
            "GPTNeoXForCausalLM",
            "GPTNeoXConfig",
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **SMALL,
        ),
    ),
    "OPTForCausalLM": (
        "transformers",
        causal_lm(
            "OPTForCausalLM",
            "OPTConfig",
            num_hidden_layers=4,
            hidden_size=16,
            num_attention_heads=2,
            ffn_dim=32,
            vocab_size=64,
            max_position_embeddings=16,
            word_embed_proj_dim=16,
            pad_token_id=1,
            dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    "BloomForCausalLM": (
        "transformers",
        causal_lm(
            "BloomForCausalLM", "BloomConfig", n_layer=4, hidden_size=16, n_head=2, vocab_size=64
        ),
    ),
    "FalconForCausalLM": (
        "transformers",
        causal_lm(
            "FalconForCausalLM",
            "FalconConfig",
            num_hidden_layers=4,
            hidden_size=16,
            num_attention_heads=2,
            vocab_size=64,
        ),
    ),
    "GPTJForCausalLM": (
        "transformers",
        causal_lm(
            "GPTJForCausalLM",
            "GPTJConfig",
            n_layer=4,
            n_embd=16,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            rotary_dim=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "GPTBigCodeForCausalLM": (
        "transformers",
        causal_lm(
            "GPTBigCodeForCausalLM",
            "GPTBigCodeConfig",
            n_layer=4,
            n_embd=16,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "DistilBertForSequenceClassification": (
        "transformers",
        classifier(
            "DistilBertForSequenceClassification",
            "DistilBertConfig",
            n_layers=4,
            dim=16,
            n_heads=2,
            hidden_dim=32,
            vocab_size=64,
            max_position_embeddings=16,
            dropout=0.0,
            attention_dropout=0.0,
            seq_classif_dropout=0.0,
        ),
    ),
    "RobertaForSequenceClassification": (
        "transformers",
        classifier(
            "RobertaForSequenceClassification",
            "RobertaConfig",
            pad_token_id=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **{**SMALL, "max_position_embeddings": 20},
        ),
    ),
    "ElectraForSequenceClassification": (
        "transformers",
        classifier(
            "ElectraForSequenceClassification",
            "ElectraConfig",
            embedding_size=8,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **SMALL,
        ),
    ),
    "DebertaV2ForSequenceClassification": (
        "transformers",
        classifier(
            "DebertaV2ForSequenceClassification",
            "DebertaV2Config",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **SMALL,
        ),
    ),
    "DebertaV2ForSequenceClassification:no-labels": (
        "transformers",
        classifier(
            "DebertaV2ForSequenceClassification",
            "DebertaV2Config",
            labels=False,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **SMALL,
        ),
    ),
    "ModernBertForSequenceClassification": (
        "transformers",
        classifier(
            "ModernBertForSequenceClassification",
            "ModernBertConfig",
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            **SMALL,
        ),
    ),
    "BartForConditionalGeneration": (
        "transformers",
        seq2seq(
            "BartForConditionalGeneration",
            "BartConfig",
            encoder_layers=2,
            decoder_layers=2,
            d_model=16,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            vocab_size=64,
            max_position_embeddings=16,
            dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    "WhisperForConditionalGeneration": (
        "transformers",
        seq2seq(
            "WhisperForConditionalGeneration",
            "WhisperConfig",
            inputs="input_features",
            encoder_layers=2,
            decoder_layers=2,
            d_model=16,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            vocab_size=64,
            num_mel_bins=8,
            max_source_positions=8,
            max_target_positions=16,
            pad_token_id=0,
            decoder_start_token_id=1,
            dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    "ResNetForImageClassification": (
        "transformers",
        hf_image(
            "ResNetForImageClassification",
            "ResNetConfig",
            embedding_size=8,
            hidden_sizes=[8, 16, 16, 16],
            depths=[1, 2, 2, 1],
        ),
    ),
    "ConvNextForImageClassification": (
        "transformers",
        hf_image(
            "ConvNextForImageClassification",
            "ConvNextConfig",
            hidden_sizes=[8, 16, 16, 16],
            depths=[1, 2, 2, 1],
        ),
    ),
    "SwinForImageClassification": (
        "transformers",
        hf_image(
            "SwinForImageClassification",
            "SwinConfig",
            image_size=32,
            patch_size=4,
            embed_dim=8,
            depths=[2, 2],
            num_heads=[2, 2],
            window_size=4,
            drop_path_rate=0.0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
    ),
    "DeiTForImageClassification": (
        "transformers",
        hf_image(
            "DeiTForImageClassification",
            "DeiTConfig",
            image_size=32,
            patch_size=8,
            num_hidden_layers=4,
            hidden_size=16,
            num_attention_heads=2,
            intermediate_size=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
    ),
    "StableLmForCausalLM": (
        "transformers", causal_lm("StableLmForCausalLM", "StableLmConfig", **KV, **SMALL)),
    "Starcoder2ForCausalLM": ("transformers", causal_lm(
        "Starcoder2ForCausalLM", "Starcoder2Config", residual_dropout=0.0, embedding_dropout=0.0,
        attention_dropout=0.0, **KV, **SMALL)),
    "Qwen2MoeForCausalLM": ("transformers", causal_lm(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, **KV, **SMALL)),
    "MambaForCausalLM": ("transformers", hf_inputs(
        "MambaForCausalLM", "MambaConfig", lambda rows: {"input_ids": _ids(rows),
                                                         "labels": _ids(rows)},
        num_hidden_layers=4, hidden_size=16, state_size=4, vocab_size=64, intermediate_size=32)),
    "CLIPModel:return-loss": ("transformers", clip(return_loss=True)),
    "CLIPModel": ("transformers", clip(return_loss=False)),
    "Dinov2ForImageClassification": ("transformers", hf_inputs(
        "Dinov2ForImageClassification", "Dinov2Config",
        lambda rows: {"pixel_values": torch.randn(rows, 3, 32, 32),
                      "labels": torch.arange(rows) % 3},
        num_hidden_layers=4, hidden_size=16, num_attention_heads=2, mlp_ratio=2, image_size=32,
        patch_size=8, num_labels=3)),
    "Wav2Vec2ForSequenceClassification": ("transformers", hf_inputs(
        "Wav2Vec2ForSequenceClassification", "Wav2Vec2Config",
        lambda rows: {"input_values": torch.randn(rows, 400), "labels": torch.arange(rows) % 3},
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
        num_labels=3, num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0, layerdrop=0.0)),
    "SegformerForSemanticSegmentation": ("transformers", hf_inputs(
        "SegformerForSemanticSegmentation", "SegformerConfig",
        lambda rows: {"pixel_values": torch.randn(rows, 3, 32, 32)},
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=16,
        num_labels=3)),
    "timm/eva02_tiny_patch14_224": ("timm", timm_model(
        "eva02_tiny_patch14_224", size=28, img_size=28, patch_size=14, depth=4)),
    "timm/convnextv2_atto": ("timm", timm_model("convnextv2_atto")),
    "timm/poolformer_s12": ("timm", timm_model("poolformer_s12")),
    "timm/hrnet_w18_small": ("timm", timm_model("hrnet_w18_small", size=64)),
    "timm/nf_resnet26": ("timm", timm_model("nf_resnet26")),
    "timm/cait_xxs24_224": ("timm", timm_model(
        "cait_xxs24_224", size=32, img_size=32, patch_size=8, depth=4)),
    "timm/pvt_v2_b0": ("timm", timm_model("pvt_v2_b0")),
    "timm/resnet18": ("timm", timm_model("resnet18")),
    "timm/convnext_atto": ("timm", timm_model("convnext_atto")),
    "timm/swin_tiny_patch4_window7_224": (
        "timm",
        timm_model(
            "swin_tiny_patch4_window7_224",
            size=224,
            depths=(2, 2, 2, 2),
            embed_dim=16,
            num_heads=(1, 1, 2, 2),
        ),
    ),
    "timm/deit_tiny": (
        "timm",
        timm_model(
            "deit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, embed_dim=16, num_heads=2
        ),
    ),
    "timm/beit": (
        "timm",
        timm_model(
            "beit_base_patch16_224", img_size=32, patch_size=8, depth=4, embed_dim=16, num_heads=2
        ),
    ),
    "timm/regnetx_002": ("timm", timm_model("regnetx_002")),
    "timm/mobilenetv3_small_050": ("timm", timm_model("mobilenetv3_small_050")),
    "timm/levit_128s": ("timm", timm_model("levit_128s", size=224)),
    "timm/maxvit_nano_rw_256": ("timm", timm_model("maxvit_nano_rw_256", size=64, img_size=64)),
    "timm/efficientvit_b0": ("timm", timm_model("efficientvit_b0")),
    "torchvision/resnet18": ("torchvision", torchvision_model("resnet18")),
    "torchvision/vgg11": ("torchvision", torchvision_model("vgg11", dropout=0.0)),
    "torchvision/densenet121": ("torchvision", torchvision_model("densenet121")),
    "torchvision/googlenet": (
        "torchvision",
        torchvision_model("googlenet", init_weights=True, aux_logits=False, dropout=0.0),
    ),
    "torchvision/inception_v3": (
        "torchvision",
        torchvision_model(
            "inception_v3", size=80, init_weights=True, aux_logits=False, dropout=0.0
        ),
    ),
    "torchvision/mobilenet_v2": ("torchvision", torchvision_model("mobilenet_v2", dropout=0.0)),
    "torchvision/shufflenet_v2_x0_5": ("torchvision", torchvision_model("shufflenet_v2_x0_5")),
    "torchvision/squeezenet1_0": ("torchvision", torchvision_model("squeezenet1_0", dropout=0.0)),
    "torchvision/mnasnet0_5": ("torchvision", torchvision_model("mnasnet0_5", dropout=0.0)),
    "torchvision/efficientnet_v2_s": (
        "torchvision",
        torchvision_model("efficientnet_v2_s", dropout=0.0, stochastic_depth_prob=0.0),
    ),
    "torchvision/convnext_tiny": (
        "torchvision",
        torchvision_model("convnext_tiny", stochastic_depth_prob=0.0),
    ),
    "torchvision/swin_v2_t": (
        "torchvision",
        torchvision_model("swin_v2_t", size=64),
    ),
    "torchvision/maxvit_t": (
        "torchvision",
        torchvision_model("maxvit_t", size=224),
    ),
    "torchvision/regnet_y_400mf": ("torchvision", torchvision_model("regnet_y_400mf")),
    "torchvision/fcn_resnet50": (
        "torchvision",
        torchvision_model("fcn_resnet50", weights_backbone=None, num_classes=3),
    ),
    "torchvision/deeplabv3_mobilenet_v3_large": (
        "torchvision",
        torchvision_model("deeplabv3_mobilenet_v3_large", weights_backbone=None, num_classes=3),
    ),
    "torchvision/r3d_18": ("torchvision", torchvision_model("r3d_18", shape=(3, 4), num_classes=3)),
}
"""Every model of the sweep: a name (the Hugging Face class, or the timm / torchvision model
name) and its family and builder."""


def without_dropout(model: nn.Module) -> nn.Module:
    """``model`` with every dropout and stochastic-depth rate it holds set to 0 (random masks
    drawn per micro-batch would differ from the unsplit model's)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr in ("drop_prob", "p", "attention_dropout", "dropout", "attn_pdrop", "resid_pdrop"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    return model
