"""transformers' rules fastload follows for transformers models: MoE expert merges, what
``dtype="auto"`` means, buffers computed by init functions, and initialization scope."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import fastload
from fastload import CheckpointError

pytest.importorskip("transformers")

from tiny_models import assert_same_tensors, model_tensors  # noqa: E402
from zoo_models import build, model_class, tiny_config  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_transformers():
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


def save(model: torch.nn.Module, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, **kwargs)
    return directory


def transformers_load(class_name: str, directory: Path, **kwargs) -> torch.nn.Module:
    return model_class(class_name).from_pretrained(directory, **kwargs).eval()


def fastload_load(class_name: str, directory: Path, **kwargs):
    return fastload.from_pretrained(model_class(class_name), directory, progress=False, **kwargs)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    model = build("MixtralForCausalLM", tiny_config("mixtral"))
    return save(model, tmp_path_factory.mktemp("mixtral"))


# --- MoE expert merges ----------------------------------------------------------------------


def test_mixtral_checkpoint_stores_one_tensor_per_expert(mixtral):
    names = load_file(mixtral / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)


def test_expert_tensors_are_read_straight_into_slices_of_the_merged_tensor(mixtral, monkeypatch):
    import fastload.core.reads.reading as reader

    filled: dict[str, torch.Tensor] = {}
    original = reader.fill

    def spy(file, items, *args, **kwargs):
        items = list(items)
        filled.update((name, dest) for name, dest, _ in items)
        return original(file, items, *args, **kwargs)

    monkeypatch.setattr(reader, "fill", spy)
    model = fastload_load("MixtralForCausalLM", mixtral)
    merged = model.model.layers[0].mlp.experts.gate_up_proj
    for expert in range(4):
        for projection in ("w1", "w3"):
            dest = filled[f"model.layers.0.block_sparse_moe.experts.{expert}.{projection}.weight"]
            assert dest.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
            assert dest.is_contiguous()


def test_sharded_moe_checkpoint_converted_to_bfloat16_matches_transformers(tmp_path):
    model = build("Qwen2MoeForCausalLM", tiny_config("qwen2_moe"))
    directory = save(model, tmp_path, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    kwargs = {"dtype": torch.bfloat16}
    ours = fastload_load("Qwen2MoeForCausalLM", directory, **kwargs)
    assert_same_tensors(ours, transformers_load("Qwen2MoeForCausalLM", directory, **kwargs))


def test_moe_checkpoint_loads_with_a_device_map_like_transformers(mixtral):
    ours = fastload_load("MixtralForCausalLM", mixtral, device_map={"": "cpu"})
    assert_same_tensors(ours, transformers_load("MixtralForCausalLM", mixtral))


def test_an_expert_of_the_wrong_shape_is_named_as_stored_in_the_file(mixtral, tmp_path):
    tensors = load_file(mixtral / "model.safetensors")
    bad = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    assert bad in tensors
    tensors[bad] = torch.zeros(3, 32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((mixtral / "config.json").read_text())
    with pytest.raises(CheckpointError, match=bad.replace(".", r"\.")):
        fastload_load("MixtralForCausalLM", tmp_path)


# --- dtype="auto" and dtype="stored" --------------------------------------------------------


def with_config_dtype(source: Path, directory: Path, dtype: str | None) -> Path:
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save(build("LlamaForCausalLM", tiny_config("llama")), tmp_path_factory.mktemp("llama"))


def test_auto_dtype_follows_the_config_dtype_over_the_stored_one(llama, tmp_path):
    directory = with_config_dtype(llama, tmp_path / "fp16-config", "float16")
    ours = fastload_load("LlamaForCausalLM", directory, dtype="auto")
    theirs = transformers_load("LlamaForCausalLM", directory, dtype="auto")
    assert ours.model.embed_tokens.weight.dtype == torch.float16
    assert_same_tensors(ours, theirs)


def test_auto_dtype_without_a_config_dtype_takes_the_checkpoints(tmp_path):
    model = build("LlamaForCausalLM", tiny_config("llama")).to(torch.bfloat16)
    source = save(model, tmp_path / "bf16")
    directory = with_config_dtype(source, tmp_path / "no-dtype", None)
    ours = fastload_load("LlamaForCausalLM", directory, dtype="auto")
    assert_same_tensors(ours, transformers_load("LlamaForCausalLM", directory, dtype="auto"))
    assert ours.lm_head.weight.dtype == torch.bfloat16


def test_stored_dtype_keeps_each_tensors_stored_dtype(llama, tmp_path):
    tensors = load_file(llama / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((llama / "config.json").read_text())
    model = fastload_load("LlamaForCausalLM", tmp_path, dtype="stored")
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32


def test_t5_under_auto_dtype_keeps_wo_in_float32_for_a_float16_checkpoint(tmp_path):
    model = build("T5ForConditionalGeneration", tiny_config("t5")).to(torch.float16)
    directory = save(model, tmp_path)
    ours = fastload_load("T5ForConditionalGeneration", directory, dtype="auto")
    assert ours.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    assert ours.encoder.block[0].layer[0].SelfAttention.q.weight.dtype == torch.float16


# --- buffers and initialization -------------------------------------------------------------


def test_gptj_rotary_table_in_bfloat16_equals_transformers(tmp_path):
    directory = save(build("GPTJForCausalLM", tiny_config("gptj")), tmp_path)
    kwargs = {"dtype": torch.bfloat16}
    ours = fastload_load("GPTJForCausalLM", directory, **kwargs)
    theirs = transformers_load("GPTJForCausalLM", directory, **kwargs)
    name = "transformer.rotary_emb.embed_positions"
    assert torch.equal(model_tensors(ours)[name], model_tensors(theirs)[name])


def test_missing_tied_embedding_gets_its_padding_row_zeroed_like_transformers(tmp_path):
    directory = save(build("BartModel", tiny_config("bart")), tmp_path)
    model = fastload_load("BartForCausalLM", directory)
    padding = model.config.pad_token_id
    embedding = model.model.decoder.embed_tokens.weight
    assert embedding is model.lm_head.weight
    assert bool((embedding[padding] == 0).all())
    assert not bool((embedding == 0).all())


def test_initializing_a_missing_head_never_changes_a_loaded_embedding(tmp_path):
    base = build("FunnelBaseModel", tiny_config("funnel"))
    directory = save(base, tmp_path)
    stored = load_file(directory / "model.safetensors")["embeddings.word_embeddings.weight"]
    model = fastload_load("FunnelForMaskedLM", directory)
    assert torch.equal(model.funnel.embeddings.word_embeddings.weight, stored)


def test_reformer_base_checkpoint_loads_into_the_lm_head_model_with_its_bias_kept(tmp_path, caplog):
    base = build("ReformerModel", tiny_config("reformer"))
    directory = save(base, tmp_path)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        model = fastload_load("ReformerModelWithLMHead", directory)
    assert torch.equal(model.lm_head.bias, torch.zeros_like(model.lm_head.bias))
    assert any("lm_head.bias" in r.getMessage() for r in caplog.records)


def test_a_plain_module_holding_a_transformers_model_initializes_its_missing_tensors_the_transformers_way(  # noqa: E501
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, initializer_range=0.02,
    )  # fmt: skip

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = transformers.BertModel(config)
            self.tags = nn.Linear(16, 3)

    state = {k: v for k, v in Tagger().state_dict().items() if not k.startswith("bert.pooler.")}
    fastload.save_file(state, tmp_path / "model.safetensors")
    model = fastload.from_pretrained(Tagger, tmp_path / "model.safetensors", missing="init")
    pooler = model.bert.pooler.dense
    # BERT's _init_weights: normal(0, initializer_range) weights and zero biases, where
    # nn.Linear.reset_parameters would give uniform ones
    assert torch.count_nonzero(pooler.bias) == 0
    assert 0.01 < float(pooler.weight.detach().std()) < 0.03
