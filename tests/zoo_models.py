"""The model zoo: tiny random-weight models for every text model type transformers registers.

The types come from transformers' own registries (``MODEL_MAPPING_NAMES`` and the causal-LM,
masked-LM and seq2seq head mappings), never from a hand-kept list: a new transformers version
brings its new architectures into the zoo by itself. Each type's default config is shrunk by
setting the size arguments it has (:data:`SIZES`) in its constructor, so derived values (head
dimension, per-layer type lists) stay consistent. A type that cannot be built tiny, or whose
tiny model transformers itself cannot run, raises :class:`NotTiny` with the reason, which the
zoo test reports as its skip reason.

Interface (used by ``test_zoo.py``):

* :func:`zoo_types`: ``[ZooType(model_type, base class name, head class name)]``, sorted;
* :data:`FAST_TYPES`: the representative subset run on every test run;
* :func:`tiny_config` / :func:`build`: a tiny config, a seeded random-weight model;
* :func:`example_inputs`: a fixed batch for a zoo model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiny_models import randomize

VOCAB = 99

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

#: a tiny model above this many parameters is not tiny (a size the shrinking cannot reach)
MAX_PARAMETERS = 2_000_000

#: run on every test run: decoder, encoder, T5 (keep-fp32 ``wo``), GPT-J (computed rotary
#: buffer), Bart (tied embeddings with a padding row), and two MoE families
FAST_TYPES = ("llama", "bert", "t5", "gptj", "bart", "mixtral", "qwen2_moe")

#: the head mappings a zoo type's head class comes from, in order of preference
_HEAD_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
)


class NotTiny(Exception):
    """This model type cannot be built and run as a tiny model; the message says why."""


@dataclass(frozen=True)
class ZooType:
    model_type: str
    base: str  # base model class name (e.g. "LlamaModel")
    head: str  # a head class name (e.g. "LlamaForCausalLM")

    def __str__(self) -> str:
        return self.model_type


@functools.lru_cache(maxsize=1)
def zoo_types() -> tuple[ZooType, ...]:
    """Every model type with a registered config, base class and text head class, sorted."""
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    heads: dict[str, str] = {}
    for mapping in _HEAD_MAPPINGS:
        for model_type, name in getattr(modeling_auto, mapping).items():
            heads.setdefault(model_type, name)
    out = []
    for model_type, head in sorted(heads.items()):
        base = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
        if isinstance(base, str) and isinstance(head, str) and model_type in CONFIG_MAPPING_NAMES:
            out.append(ZooType(model_type, base, head))
    return tuple(out)


def zoo_type(model_type: str) -> ZooType:
    for t in zoo_types():
        if t.model_type == model_type:
            return t
    raise KeyError(model_type)


def model_class(name: str) -> type[nn.Module]:
    import transformers

    cls = getattr(transformers, name, None)
    if not isinstance(cls, type):
        raise NotTiny(f"transformers exports no class {name!r}")
    return cls


@functools.cache
def _config_arguments(model_type: str) -> dict[str, Any]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    if getattr(config_class, "sub_configs", None):
        raise NotTiny(f"composite config (sub-configs {sorted(config_class.sub_configs)})")
    try:
        defaults = config_class().to_dict()
    except Exception as e:  # noqa: BLE001 - any failure means the type is out of the zoo
        raise NotTiny(f"default config fails: {type(e).__name__}: {e}") from e
    kwargs: dict[str, Any] = {}
    for key, value in SIZES.items():
        current = defaults.get(key, "absent")
        if isinstance(current, int) and not isinstance(current, bool):
            kwargs[key] = value
        elif key in _SIZES_WHEN_NONE and current is None:
            kwargs[key] = value
    if "num_key_value_heads" in kwargs and isinstance(defaults.get("kv_lora_rank"), int):
        # latent attention (DeepSeek-V2/V3, MiniCPM3, ...) expands the latent to every query
        # head: grouped kv heads do not exist there, and a smaller count breaks its forward
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    for key in _TOKEN_IDS:
        current = defaults.get(key)
        if isinstance(current, int) and current >= VOCAB:
            kwargs[key] = VOCAB - 1
    positions = defaults.get("max_position_embeddings")
    if isinstance(positions, int) and positions > 2048:
        kwargs["max_position_embeddings"] = 2048
    kwargs.update(_LIST_SIZES.get(model_type, {}))
    if "is_decoder" in defaults:
        kwargs["is_decoder"] = True  # causal-LM heads of encoder families want it (Reformer)
    return kwargs


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A tiny config of ``model_type`` (:class:`NotTiny` if none can be made)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kwargs = {**_config_arguments(model_type), **overrides}
    try:
        return CONFIG_MAPPING[model_type](**kwargs)
    except Exception as e:  # noqa: BLE001
        raise NotTiny(f"tiny config fails: {type(e).__name__}: {str(e)[:200]}") from e


def build(class_name: str, config: Any, *, seed: int = 0) -> nn.Module:
    """A ``class_name`` model of ``config`` with seeded random weights everywhere, in eval mode."""
    cls = model_class(class_name)
    torch.manual_seed(seed)
    try:
        model = cls(config)
    except Exception as e:  # noqa: BLE001
        raise NotTiny(f"{class_name} fails to build: {type(e).__name__}: {str(e)[:200]}") from e
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        raise NotTiny(f"{class_name} has {count} parameters at the smallest sizes tried")
    return randomize(model, seed).eval()


def example_inputs(model: nn.Module, *, batch: int = 2, length: int = 6) -> dict[str, Any]:
    """Token ids (and decoder ids for encoder-decoder models) inside the tiny vocabulary."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB - 1, (batch, length), generator=generator)
    inputs: dict[str, Any] = {"input_ids": ids}
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids[:, :4].clone()
    return inputs


def checked_model(zoo: ZooType, class_name: str | None = None, *, seed: int = 0) -> nn.Module:
    """The type's tiny model, after checking that transformers itself can run it."""
    from tiny_models import outputs_of

    model = build(class_name or zoo.head, tiny_config(zoo.model_type), seed=seed)
    try:
        outputs_of(model, example_inputs(model))
    except Exception as e:  # noqa: BLE001
        raise NotTiny(f"transformers' own forward fails: {type(e).__name__}: {str(e)[:200]}") from e
    return model
