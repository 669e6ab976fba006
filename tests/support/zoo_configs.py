"""Tiny configs for every model type transformers registers, composite ones included.

A type's default config is shrunk by setting the size arguments it has (:data:`SIZES`) in its
constructor, so derived values (head dimension, per-layer type lists) stay consistent. Lists of
sizes (stage depths and widths of vision backbones, convolution stacks of audio encoders) are
shrunk element by element, keeping their lengths. A composite config (one with ``sub_configs``:
CLIP's text and vision towers, Llava's language model, Musicgen's encoders and decoder) is built
from its sub-configs shrunk the same way, recursively. Token ids the default config sets beyond
the tiny vocabulary are moved inside it.

:func:`tiny_config` raises :class:`NotTiny` with the reason when no tiny config can be made.
"""

from __future__ import annotations

import functools
import re
from typing import Any

VOCAB = 99


class NotTiny(Exception):
    """This model type cannot be built and run as a tiny model; the message says why."""


#: constructor arguments set to these values when a type's config has them (as an int)
SIZES: dict[str, int] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    d_model=32,
    n_embd=32,
    n_embed=32,
    embed_dim=32,
    embedding_size=32,
    emb_dim=32,
    num_hidden_layers=2,
    n_layer=2,
    n_layers=2,
    num_layers=2,
    encoder_layers=2,
    decoder_layers=2,
    num_decoder_layers=2,
    num_attention_heads=4,
    n_head=4,
    n_heads=4,
    num_heads=4,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    d_ff=64,
    ffn_dim=64,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    head_dim=8,
    d_kv=8,
    rotary_dim=8,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=32,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    d_head=8,
    d_inner=64,
    attention_head_size=8,
    feed_forward_size=64,
    ffn_hidden_size=64,
    expert_ffn_hidden_size=32,
    zero_expert_num=2,
    moe_topk=2,
    n_shared_experts=1,
    num_experts_per_token=2,
    linear_head_dim=8,
    linear_num_heads=4,
)

#: size arguments of vision, audio and multimodal configs (same rule as :data:`SIZES`); they are
#: set only where the config is not a text model's, so the text zoo keeps its configs
MEDIA_SIZES: dict[str, int] = dict(
    image_size=32,
    patch_size=8,
    projection_dim=16,
    decoder_hidden_size=32,
    decoder_num_hidden_layers=2,
    decoder_num_attention_heads=4,
    decoder_intermediate_size=64,
    encoder_hidden_size=32,
    text_hidden_size=32,
    vision_hidden_size=32,
    projector_hidden_size=32,
    out_hidden_size=32,
    output_hidden_size=32,
    num_mel_bins=16,
    mlp_dim=64,
    hidden_dim=32,
    num_query_tokens=4,
    image_seq_length=4,
    image_text_hidden_size=32,
    max_source_positions=64,
    max_target_positions=64,
    classifier_proj_size=16,
    codevector_dim=16,
    proj_codevector_dim=16,
    xvector_output_dim=16,
    num_codevectors_per_group=8,
    fpn_hidden_size=32,
    fusion_hidden_size=32,
    pooler_output_size=32,
    num_filters=4,
    codebook_size=16,
    codebook_dim=16,
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
)

#: list-valued sizes: every element becomes at most this (depths of stages, widths, channels)
_LIST_CAPS: dict[str, int] = dict(
    depths=1,
    hidden_sizes=32,
    conv_dim=32,
    tdnn_dim=32,
    neck_hidden_sizes=32,
    embed_dim_per_stage=32,
    stage_out_channels=32,
    stage_in_channels=32,
    stage_mid_channels=32,
    stage_num_blocks=1,
    stage_numb_of_layers=1,
    blocks_per_stage=1,
    backbone_channel_list=32,
)

#: size arguments also set where the default config leaves them None (derived later)
_SIZES_WHEN_NONE = ("head_dim", "num_experts_per_tok", "n_routed_experts", "n_shared_experts")

#: list-valued size arguments of types whose config checks them against the sizes above
_LIST_SIZES: dict[str, dict[str, Any]] = {
    "reformer": dict(
        axial_pos_embds_dim=[16, 16],
        axial_pos_shape=[8, 8],
        max_position_embeddings=64,
        attn_layers=["local", "lsh"],
        local_attn_chunk_length=8,
        lsh_attn_chunk_length=8,
    ),
    "funnel": dict(block_sizes=[1, 1], block_repeats=[1, 1]),
}

#: token-id arguments that must stay inside the tiny vocabulary
_TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_model(defaults: dict[str, Any]) -> bool:
    """Whether a config is a text model's: it has a vocabulary and no image or audio input."""
    media = ("image_size", "num_mel_bins", "num_channels", "conv_dim", "sampling_rate")
    return "vocab_size" in defaults and not any(k in defaults for k in media)


def _size_arguments(model_type: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments that make a config of these ``defaults`` tiny."""
    kwargs: dict[str, Any] = {}
    sizes = SIZES if _text_model(defaults) else {**MEDIA_SIZES, **SIZES}
    for key, value in sizes.items():
        current = defaults.get(key, "absent")
        if _is_int(current):
            kwargs[key] = value
        elif key in _SIZES_WHEN_NONE and current is None:
            kwargs[key] = value
    for key, cap in _LIST_CAPS.items():
        current = defaults.get(key)
        if isinstance(current, list) and current and all(_is_int(v) for v in current):
            kwargs[key] = [min(v, cap) for v in current]
    heads = defaults.get("num_heads")
    if isinstance(heads, list) and heads and all(_is_int(v) for v in heads):
        # per-stage heads of hierarchical vision models: each stage's width stays divisible
        kwargs["num_heads"] = [min(2**i, 4) for i in range(len(heads))]
    if "num_key_value_heads" in kwargs and _is_int(defaults.get("kv_lora_rank")):
        # latent attention (DeepSeek-V2/V3, MiniCPM3, ...) expands the latent to every query
        # head: grouped kv heads do not exist there, and a smaller count breaks its forward
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    vocab = kwargs.get("vocab_size", VOCAB)
    spare = iter(range(vocab - 2, 0, -1))  # special tokens of multimodal models: distinct ids
    for key, value in defaults.items():
        token = key.endswith(("_token_id", "_token_index")) and key not in _TOKEN_IDS
        if token and _is_int(value) and value >= vocab:
            kwargs[key] = next(spare)
    for key in _TOKEN_IDS:  # the text zoo's rule: its ids share the last slot
        if _is_int(defaults.get(key)) and defaults[key] >= vocab:
            kwargs[key] = vocab - 1
    if "pad_token_id" in defaults and defaults["pad_token_id"] is None and "vocab_size" in defaults:
        # a padding row (nn.Embedding's padding_idx), which initialization treats apart
        kwargs["pad_token_id"] = 0
    positions = defaults.get("max_position_embeddings")
    if _is_int(positions) and positions > 2048:
        kwargs["max_position_embeddings"] = 2048
    kwargs.update(_LIST_SIZES.get(model_type, {}))
    if "is_decoder" in defaults:
        kwargs["is_decoder"] = True  # causal-LM heads of encoder families want it (Reformer)
    return kwargs


def _shrunk(config: Any, depth: int = 0, **overrides: Any) -> Any:
    """A tiny config of ``config``'s class, its sub-configs shrunk too (recursively)."""
    from transformers import PretrainedConfig

    cls = type(config)
    model_type = getattr(config, "model_type", "") or ""
    kwargs = _size_arguments(model_type, config.to_dict())
    for key in getattr(cls, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            if depth > 3:
                raise NotTiny(f"sub-configs nested deeper than {depth} ({key})")
            kwargs[key] = _shrunk(sub, depth + 1)
    kwargs.update(overrides)
    try:
        return _construct(cls, kwargs, keep=set(overrides))
    except Exception:  # noqa: BLE001 - some composite configs take their sub-configs as dicts
        subs = {k: v.to_dict() for k, v in kwargs.items() if isinstance(v, PretrainedConfig)}
        return _construct(cls, {**kwargs, **subs}, keep=set(overrides))


def _construct(cls: type, kwargs: dict[str, Any], keep: set[str], depth: int = 0) -> Any:
    """``cls(**kwargs)``; where the config's validation names some of the tiny sizes (``hidden
    size (32) must equal codebook_dim``), the default of one of them (or of all), up to twice."""
    try:
        return cls(**kwargs)
    except Exception as e:
        if depth >= 2:
            raise
        text = str(e)
        named = [
            k for k in kwargs if k not in keep and re.search(rf"(?<![\w.]){re.escape(k)}\b", text)
        ]
        drops = [[k] for k in named] + ([named] if len(named) > 1 else [])
        for drop in drops:
            try:
                return _construct(
                    cls, {k: v for k, v in kwargs.items() if k not in drop}, keep, depth + 1
                )
            except Exception:  # noqa: BLE001, S112 - the next candidate
                continue
        raise


@functools.cache
def _default_config(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]()
    except Exception as e:  # noqa: BLE001 - any failure means the type is out of the zoo
        raise NotTiny(f"default config fails: {type(e).__name__}: {str(e)[:200]}") from None


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny config of ``model_type`` (:class:`NotTiny` if none can be made)."""
    defaults = _default_config(model_type)
    try:
        return _shrunk(defaults, **overrides)
    except NotTiny:
        raise
    except Exception as e:  # noqa: BLE001
        raise NotTiny(f"tiny config fails: {type(e).__name__}: {str(e)[:200]}") from None


def sub_config_keys(model_type: str) -> tuple[str, ...]:
    """The keys of the sub-configs of a composite type's config (``()`` for a plain one)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return tuple(getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or ())
