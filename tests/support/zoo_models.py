"""The model zoo: tiny random-weight models of every model type transformers registers.

The types come from transformers' own registries (every ``MODEL_*_MAPPING_NAMES`` of its auto
classes: base models, text, vision and audio heads, backbones, composite models), never from a
hand-kept list: a new transformers version brings its new architectures into the zoo by itself.
Configs are made tiny by :mod:`zoo_configs`. A type that cannot be built tiny raises
:class:`NotTiny` with the reason, which the zoo test reports as its skip reason.

Interface (used by ``test_zoo.py`` and ``test_hf_rules.py``):

* :func:`zoo_types`: every type's name, sorted; :func:`zoo_type`: its classes (base, the main
  class whose checkpoint the zoo saves, every registered class) as :class:`ZooType`;
* :func:`registered_classes`: a type's class names, without importing them;
* :func:`sub_model`: the class of a composite type's sub-config (CLIP's ``CLIPTextModel``);
* :data:`FAST_TYPES`: the representative subset run on every test run;
* :func:`tiny_config` / :func:`build`: a tiny config, a seeded random-weight model (built from
  the sub-config its class takes, for a class of a composite type built from one);
* :func:`example_inputs`: a fixed batch for a zoo model (token ids, or pixel values).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from tiny_models import randomize
from torch import nn
from zoo_configs import VOCAB, NotTiny, sub_config_keys, tiny_config

__all__ = [
    "FAST_TYPES",
    "MAX_PARAMETERS",
    "NotTiny",
    "VOCAB",
    "ZooType",
    "build",
    "class_config",
    "example_inputs",
    "model_class",
    "registered_classes",
    "sub_config_keys",
    "sub_model",
    "tiny_config",
    "zoo_type",
    "zoo_types",
]

#: a tiny model above this many parameters is not tiny (a size the shrinking cannot reach)
MAX_PARAMETERS = 6_000_000

#: run on every test run: decoder, encoder, T5 (keep-fp32 ``wo``), GPT-J (computed rotary
#: buffer), Bart (tied embeddings with a padding row), two MoE families, and CLIP (a composite
#: of a text and a vision model, each with classes of its own)
FAST_TYPES = ("llama", "bert", "t5", "gptj", "bart", "mixtral", "qwen2_moe", "clip")

#: the head mappings preferred for a type's main class, in order (the text zoo's choice)
_HEAD_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
)


@dataclass(frozen=True)
class ZooType:
    model_type: str
    base: str | None  # base model class name (e.g. "LlamaModel"), if one takes the type's config
    head: str  # the main class: a head taking the type's config (e.g. "LlamaForCausalLM")
    classes: tuple[str, ...]  # every class registered for the type

    def __str__(self) -> str:
        return self.model_type


def _mappings() -> list[tuple[str, dict[str, Any]]]:
    """transformers' auto-class registries (model type -> class name or names): the preferred
    head mappings first, then the base models, then the others by name."""
    from transformers.models.auto import modeling_auto

    names = sorted(
        n
        for n in dir(modeling_auto)
        if n.startswith("MODEL") and n.endswith("_MAPPING_NAMES")
        if isinstance(getattr(modeling_auto, n), dict)
    )
    order = [*_HEAD_MAPPINGS, "MODEL_MAPPING_NAMES"]
    names = order + [n for n in names if n not in order]
    return [(n, getattr(modeling_auto, n)) for n in names]


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(v for v in value if isinstance(v, str))
    return ()


@functools.lru_cache(maxsize=1)
def _registry() -> dict[str, tuple[str, ...]]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out: dict[str, list[str]] = {}
    for _, mapping in _mappings():
        for model_type, value in mapping.items():
            if model_type not in CONFIG_MAPPING_NAMES:
                continue
            listed = out.setdefault(model_type, [])
            listed.extend(n for n in _names(value) if n not in listed)
    return {t: tuple(c) for t, c in sorted(out.items()) if c}


def zoo_types() -> tuple[str, ...]:
    """Every model type with a registered config and at least one model class, sorted."""
    return tuple(_registry())


def registered_classes(model_type: str) -> tuple[str, ...]:
    """The class names registered for ``model_type``, in :func:`_mappings` order (no import)."""
    return _registry().get(model_type, ())


def model_class(name: str) -> type[nn.Module]:
    import transformers

    try:
        cls = getattr(transformers, name, None)
    except Exception as e:  # noqa: BLE001 - a model module that fails to import
        raise NotTiny(f"{name} fails to import: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(cls, type):
        raise NotTiny(f"transformers exports no class {name!r}")
    try:  # a placeholder of a class whose backend is missing raises on any attribute
        cls.config_class  # noqa: B018
    except ImportError as e:
        text = str(e).strip()[:200]
        raise NotTiny(f"{name} needs a library that is not installed: {text}") from None
    except AttributeError:
        pass
    return cls


def class_config(class_name: str, config: Any) -> Any:
    """The config ``class_name`` is built from: the sub-config of ``config`` that the class
    takes (``MusicgenForCausalLM`` takes Musicgen's ``decoder``), else ``config`` itself."""
    wanted = getattr(model_class(class_name), "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for key in getattr(type(config), "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, wanted):
            return sub
    # a class transformers registers for a config of another class (ExaoneConfig ->
    # LlamaForCausalLM): built from it as transformers' auto classes do
    return config


def _takes_the_type_config(class_name: str, config: Any, *, exactly: bool = True) -> bool:
    """Whether the class is built from the type's own config (``exactly``: its config class)."""
    try:
        if exactly:
            return isinstance(config, getattr(model_class(class_name), "config_class", type(None)))
        return class_config(class_name, config) is config
    except NotTiny:  # a class that does not import
        return False


@functools.cache
def zoo_type(model_type: str) -> ZooType:
    """The type's classes: its base, its main class (whose checkpoint the zoo saves) and every
    registered class (:class:`NotTiny` if none takes the type's own config)."""
    from transformers.models.auto import modeling_auto

    classes = registered_classes(model_type)
    config = tiny_config(model_type)
    bases = _names(modeling_auto.MODEL_MAPPING_NAMES.get(model_type))
    base, head = None, None
    for exactly in (True, False):  # its config class first, then one it is registered for
        base = base or next(
            (b for b in bases if _takes_the_type_config(b, config, exactly=exactly)), None
        )
        heads = (c for c in classes if c not in bases)
        head = head or next(
            (c for c in heads if _takes_the_type_config(c, config, exactly=exactly)), None
        )
    head = head or base
    if head is None:
        raise NotTiny(f"none of {', '.join(classes)} takes the {model_type} config")
    return ZooType(model_type, base, head, classes)


def sub_model(model_type: str, key: str) -> str:
    """The model class of the composite type's sub-config ``key`` (its base model, else the
    first class registered for its type), e.g. ``CLIPTextModel`` for CLIP's ``text_config``."""
    from transformers.models.auto import modeling_auto

    sub = getattr(tiny_config(model_type), key, None)
    sub_type = getattr(sub, "model_type", None)
    if not sub_type:
        raise NotTiny(f"{model_type}'s {key} is not a config ({type(sub).__name__})")
    classes = _names(modeling_auto.MODEL_MAPPING_NAMES.get(sub_type)) or registered_classes(
        sub_type
    )
    for name in classes:
        try:
            if isinstance(sub, model_class(name).config_class):
                return name
        except NotTiny:
            continue
    raise NotTiny(f"{model_type}'s {key} ({sub_type}) has no model class of its own")


def build(class_name: str, config: Any, *, seed: int = 0) -> nn.Module:
    """A ``class_name`` model of ``config`` (or of the sub-config of it the class takes) with
    seeded random weights everywhere, in eval mode."""
    cls = model_class(class_name)
    config = class_config(class_name, config)
    torch.manual_seed(seed)
    try:
        model = cls(config)
    except Exception as e:  # noqa: BLE001
        raise NotTiny(f"{class_name} fails to build: {type(e).__name__}: {str(e)[:200]}") from None
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        raise NotTiny(f"{class_name} has {count} parameters at the smallest sizes tried")
    return randomize(model, seed).eval()


def _image_size(config: Any) -> tuple[int, int] | None:
    for cfg in (config, getattr(config, "vision_config", None)):
        size = getattr(cfg, "image_size", None)
        if isinstance(size, int):
            return size, size
        if isinstance(size, (list, tuple)) and len(size) == 2:
            return int(size[0]), int(size[1])
    return None


def example_inputs(model: nn.Module, *, batch: int = 2, length: int = 6) -> dict[str, Any] | None:
    """A fixed batch for the model's main input: token ids (and decoder ids for encoder-decoder
    models) inside the tiny vocabulary, or pixel values of the configured image size; ``None``
    for other inputs (audio, time series, ...), whose outputs the zoo does not compare."""
    generator = torch.Generator().manual_seed(0)
    config = model.config
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_ids":
        vocab = getattr(config, "vocab_size", None) or VOCAB
        ids = torch.randint(1, min(vocab, VOCAB) - 1, (batch, length), generator=generator)
        inputs: dict[str, Any] = {"input_ids": ids}
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids[:, :4].clone()
        return inputs
    if main == "pixel_values":
        size = _image_size(config)
        cfg = getattr(config, "vision_config", None) or config
        channels = getattr(cfg, "num_channels", 3)
        if size is None or not isinstance(channels, int):
            return None
        return {"pixel_values": torch.randn(batch, channels, *size, generator=generator)}
    return None
