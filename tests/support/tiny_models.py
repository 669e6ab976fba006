"""Tiny transformers models for tests: configs, random weights, checkpoints saved by transformers.

Every test that needs a real architecture imports from here (``from tiny_models import ...``;
pytest puts ``tests/`` on ``sys.path``). The functions below are a stable interface:

* :data:`FAMILIES` and :data:`CLASSES`: the families and the model classes each one offers;
* :func:`make_config`: a tiny config (hidden size 32, 2 layers, vocabulary 99);
* :func:`make_model`: a model with random weights *everywhere* (biases, norms and persistent
  buffers too, so a tensor that is not loaded cannot pass for one that is), seeded;
* :func:`save_checkpoint` / :func:`make_checkpoint`: written with transformers' own
  ``save_pretrained`` (safetensors, optionally sharded);
* :func:`example_inputs`: a fixed batch for the model's ``forward``;
* :func:`model_tensors`, :func:`assert_same_tensors`, :func:`outputs_of`,
  :func:`assert_same_outputs`: comparing two models tensor by tensor and output by output.

transformers is imported lazily, inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 99

#: family -> (config class, config arguments)
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": (
        "BertConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            type_vocab_size=2,
            num_labels=3,
        ),
    ),
    "gpt2": (
        "GPT2Config",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            n_inner=64,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
        ),
    ),
    "llama": (
        "LlamaConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
    ),
    "t5": (
        "T5Config",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
            pad_token_id=0,
        ),
    ),
    "bart": (
        "BartConfig",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
        ),
    ),
}

#: family -> model class names, the family's base model first
CLASSES: dict[str, tuple[str, ...]] = {
    "bert": ("BertModel", "BertForMaskedLM", "BertForSequenceClassification"),
    "gpt2": ("GPT2Model", "GPT2LMHeadModel"),
    "llama": ("LlamaModel", "LlamaForCausalLM"),
    "t5": ("T5Model", "T5ForConditionalGeneration", "T5EncoderModel"),
    "bart": ("BartModel", "BartForConditionalGeneration"),
}

#: the families, in a fixed order
FAMILIES: tuple[str, ...] = tuple(_CONFIGS)


def model_class(name: str) -> type[nn.Module]:
    """The transformers class called ``name`` (e.g. ``"BertForMaskedLM"``)."""
    import transformers

    return getattr(transformers, name)


def family_of(class_name: str) -> str:
    """The family a model class name belongs to."""
    for family, names in CLASSES.items():
        if class_name in names:
            return family
    raise KeyError(f"no tiny family offers {class_name!r}")


def make_config(family: str, **overrides: Any) -> Any:
    """A tiny config of ``family``; ``overrides`` replace or add config arguments."""
    import transformers

    config_class, arguments = _CONFIGS[family]
    return getattr(transformers, config_class)(**{**arguments, **overrides})


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Gives every floating parameter and persistent floating buffer random values (in place).

    Tied parameters stay tied (each Parameter is drawn once). Returns ``model``.
    """
    generator = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for _, param in model.named_parameters():
            if id(param) in seen or not param.is_floating_point():
                continue
            seen.add(id(param))
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * 0.2)
        for module in model.modules():
            for name, buf in module._buffers.items():
                persistent = name not in module._non_persistent_buffers_set
                if buf is None or not persistent or not buf.is_floating_point() or id(buf) in seen:
                    continue
                seen.add(id(buf))
                buf.copy_(torch.randn(buf.shape, generator=generator, dtype=torch.float32) * 0.2)
    return model


def make_model(
    class_name: str,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    config: Any = None,
    **config_overrides: Any,
) -> nn.Module:
    """A tiny ``class_name`` model (e.g. ``"GPT2LMHeadModel"``) with seeded random weights, in
    eval mode; ``dtype`` converts it after the weights are drawn."""
    cls = model_class(class_name)
    if config is None:
        config = make_config(family_of(class_name), **config_overrides)
    torch.manual_seed(seed)
    model = randomize(cls(config), seed)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def save_checkpoint(
    model: nn.Module, directory: str | Path, *, max_shard_size: int | str | None = None
) -> Path:
    """Saves ``model`` with transformers' ``save_pretrained`` (safetensors); returns the
    directory. ``max_shard_size`` (e.g. ``"20KB"``) makes a sharded checkpoint."""
    directory = Path(directory)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **kwargs)
    return directory


def make_checkpoint(
    directory: str | Path,
    class_name: str,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    **config_overrides: Any,
) -> Path:
    """:func:`make_model` then :func:`save_checkpoint` into ``directory``; returns it."""
    model = make_model(class_name, seed=seed, dtype=dtype, **config_overrides)
    return save_checkpoint(model, directory, max_shard_size=max_shard_size)


def example_inputs(model: nn.Module, *, batch: int = 2, length: int = 7, seed: int = 0) -> dict:
    """A fixed batch for ``model``: token ids, an attention mask with padding in the last row,
    and decoder token ids for encoder-decoder models."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    vocab = config.vocab_size
    ids = torch.randint(1, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, length - 2 :] = 0
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask}
    if getattr(config, "is_encoder_decoder", False) and "EncoderModel" not in type(model).__name__:
        inputs["decoder_input_ids"] = torch.randint(1, vocab, (batch, 5), generator=generator)
    return inputs


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (tied and non-persistent ones included)."""
    out = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({n: b for n, b in model.named_buffers(remove_duplicate=False)})
    return out


def assert_same_tensors(actual: nn.Module, expected: nn.Module) -> None:
    """Same names, and for each: same shape, dtype, device kind, bitwise-equal values, and the
    same parameter/buffer role."""
    a, e = model_tensors(actual), model_tensors(expected)
    assert sorted(a) == sorted(e), (
        f"names differ: only in actual {sorted(set(a) - set(e))}, "
        f"only in expected {sorted(set(e) - set(a))}"
    )
    params_a = {n for n, _ in actual.named_parameters(remove_duplicate=False)}
    params_e = {n for n, _ in expected.named_parameters(remove_duplicate=False)}
    assert params_a == params_e, f"parameter/buffer roles differ: {params_a ^ params_e}"
    for name in e:
        x, y = a[name], e[name]
        assert x.shape == y.shape, f"{name}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        assert x.dtype == y.dtype, f"{name}: dtype {x.dtype} != {y.dtype}"
        assert x.device.type == y.device.type, f"{name}: device {x.device} != {y.device}"
        assert torch.equal(x.cpu(), y.cpu()), f"{name}: values differ"


def outputs_of(model: nn.Module, inputs: dict) -> list[torch.Tensor]:
    """The tensors of ``model(**inputs)`` (nested tuples flattened, caches skipped), no grad."""
    with torch.no_grad():
        out = model(**inputs)
    found: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            for v in value:
                collect(v)

    collect(out.to_tuple() if hasattr(out, "to_tuple") else out)
    return found


def assert_same_outputs(actual: nn.Module, expected: nn.Module, inputs: dict) -> None:
    """Both models give bitwise-equal output tensors on ``inputs``."""
    xs, ys = outputs_of(actual, inputs), outputs_of(expected, inputs)
    assert len(xs) == len(ys), f"{len(xs)} output tensors != {len(ys)}"
    assert xs, "the model returned no tensor"
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        assert x.shape == y.shape, f"output {i}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        assert torch.equal(x, y), f"output {i}: values differ (max {(x - y).abs().max()})"
