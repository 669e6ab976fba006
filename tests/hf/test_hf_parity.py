"""Where the model-zoo sweep (issue 37) found fastload loading differently from transformers:
what the loading info lists, which stored copy a tie group keeps, what initialization may
write, and which errors are raised. Each test compares with transformers' own load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import fastload

pytest.importorskip("transformers")

from zoo_models import build, model_class, tiny_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")


@pytest.fixture(autouse=True)
def _quiet_transformers():
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


def saved(class_name: str, model_type: str, directory: Path, **config: Any) -> Path:
    build(class_name, tiny_config(model_type, **config)).save_pretrained(directory)
    return directory


def both(class_name: str, directory: Path, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """(fastload's model and loading info, transformers' model and loading info)."""
    cls = model_class(class_name)
    ours, report = fastload.from_pretrained(
        cls, directory, output_loading_info=True, progress=False, **kwargs
    )
    theirs, info = cls.from_pretrained(directory, output_loading_info=True, **kwargs)
    return ours, report, theirs, info


# --- loading info ----------------------------------------------------------------------------


def test_loading_info_lists_a_layer_the_model_does_not_build_as_unexpected_like_transformers(
    tmp_path,
):
    directory = saved("BertModel", "bert", tmp_path)  # with its pooler
    _, report, _, info = both("BertLMHeadModel", directory)  # built without one
    assert info["unexpected_keys"] == {"pooler.dense.bias", "pooler.dense.weight"}
    assert report.to_dict()["unexpected_keys"] == info["unexpected_keys"]
    assert report.unexpected == []  # expected: no warning, as before


def test_loading_info_lists_unexpected_tensors_under_the_names_transformers_renames_them_to(
    tmp_path,
):
    directory = saved("ViTMAEForPreTraining", "vit_mae", tmp_path)
    stored = set(load_file(directory / "model.safetensors"))
    assert "decoder.decoder_encoder.layer.0.attention.attention.key.weight" in stored
    _, report, _, info = both("ViTMAEModel", directory)
    assert "decoder.decoder_layers.0.attention.k_proj.weight" in info["unexpected_keys"]
    assert report.to_dict()["unexpected_keys"] == info["unexpected_keys"]
    # the report itself keeps the stored names, which the warning shows
    assert "decoder.decoder_encoder.layer.0.attention.attention.key.weight" in report.unexpected


# --- ties ------------------------------------------------------------------------------------


def test_a_tie_group_stored_twice_with_different_values_keeps_the_copy_transformers_keeps(
    tmp_path,
):
    # A causal-LM checkpoint stores the decoder embedding and the LM head apart; the seq2seq
    # class ties both to `model.shared`, which the checkpoint lacks.
    directory = saved("BigBirdPegasusForCausalLM", "bigbird_pegasus", tmp_path)
    stored = load_file(directory / "model.safetensors")
    assert not torch.equal(stored["lm_head.weight"], stored["model.decoder.embed_tokens.weight"])
    ours, _, theirs, _ = both("BigBirdPegasusForConditionalGeneration", directory)
    for model in (ours, theirs):
        assert model.model.shared.weight is model.lm_head.weight
        assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])
        assert torch.equal(
            model.model.decoder.embed_tokens.weight, stored["model.decoder.embed_tokens.weight"]
        )


# --- initialization writing into loaded tensors ----------------------------------------------


@pytest.fixture
def funnel(tmp_path: Path) -> Path:
    return saved("FunnelForMaskedLM", "funnel", tmp_path, pad_token_id=0)


def test_transformers_zeroes_the_stored_padding_row_of_a_funnel_checkpoint(funnel):
    # The fact fastload's two behaviours answer: Funnel's _init_weights zeroes
    # word_embeddings.weight[pad_token_id] through a view, which transformers' "already loaded"
    # flag does not cover, on every load.
    stored = load_file(funnel / "model.safetensors")["funnel.embeddings.word_embeddings.weight"]
    theirs = model_class("FunnelForMaskedLM").from_pretrained(funnel)
    assert bool(stored[0].ne(0).any())
    assert bool(theirs.funnel.embeddings.word_embeddings.weight[0].eq(0).all())


def test_the_direct_api_keeps_the_stored_padding_row_of_a_funnel_checkpoint(funnel):
    stored = load_file(funnel / "model.safetensors")["funnel.embeddings.word_embeddings.weight"]
    ours = fastload.from_pretrained(model_class("FunnelForMaskedLM"), funnel, progress=False)
    assert torch.equal(ours.funnel.embeddings.word_embeddings.weight, stored)


def test_under_the_patch_the_padding_row_of_a_funnel_checkpoint_is_zeroed_as_transformers_does(
    funnel,
):
    cls = model_class("FunnelForMaskedLM")
    theirs = cls.from_pretrained(funnel)
    with fastload.patch_transformers():
        ours = cls.from_pretrained(funnel)
    for name in ("funnel.embeddings.word_embeddings.weight", "lm_head.weight"):
        assert torch.equal(ours.get_parameter(name), theirs.get_parameter(name)), name


# --- errors ----------------------------------------------------------------------------------


@pytest.fixture
def unbuildable(tmp_path: Path) -> Path:
    """A BertModel checkpoint whose config names an activation transformers does not have: the
    model's own code raises KeyError while it is built."""
    directory = saved("BertModel", "bert", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["hidden_act"] = "no_such_activation"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(KeyError):
        model_class("BertModel").from_pretrained(directory)
    return directory


def test_a_model_its_config_cannot_build_raises_a_checkpoint_error_that_is_also_its_own_error(
    unbuildable,
):
    with pytest.raises(fastload.CheckpointError, match="cannot be built") as raised:
        fastload.from_pretrained(model_class("BertModel"), unbuildable, progress=False)
    assert isinstance(raised.value, KeyError)
    assert "no_such_activation" in str(raised.value)


def test_under_the_patch_a_model_its_config_cannot_build_raises_what_transformers_raises(
    unbuildable,
):
    with fastload.patch_transformers(), pytest.raises(KeyError, match="no_such_activation"):
        model_class("BertModel").from_pretrained(unbuildable)


# --- dtypes ----------------------------------------------------------------------------------


@pytest.fixture
def granite_bf16(tmp_path: Path) -> Path:
    """A bfloat16 Granite Speech CTC checkpoint: its `conv.norm` BatchNorms are kept in float32
    (`_keep_in_fp32_modules_strict`) and hold the integer `num_batches_tracked`."""
    model = build("GraniteSpeech5ForCTC", tiny_config("granite_speech5_ctc"))
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    return tmp_path


COUNTER = "encoder.layers.0.conv.norm.num_batches_tracked"


def test_transformers_makes_an_integer_buffer_of_a_module_kept_in_float32_float32(granite_bf16):
    theirs = model_class("GraniteSpeech5ForCTC").from_pretrained(granite_bf16, dtype="auto")
    assert theirs.get_buffer(COUNTER).dtype == torch.float32


def test_the_direct_api_keeps_the_integer_dtype_of_a_counter_in_a_module_kept_in_float32(
    granite_bf16,
):
    cls = model_class("GraniteSpeech5ForCTC")
    ours = fastload.from_pretrained(cls, granite_bf16, dtype="auto", progress=False)
    assert ours.get_buffer(COUNTER).dtype == torch.int64
    assert (
        ours.get_parameter(COUNTER.replace("num_batches_tracked", "weight")).dtype == torch.float32
    )


def test_under_the_patch_an_integer_buffer_of_a_module_kept_in_float32_is_float32_too(
    granite_bf16,
):
    cls = model_class("GraniteSpeech5ForCTC")
    theirs = cls.from_pretrained(granite_bf16, dtype="auto")
    with fastload.patch_transformers():
        ours = cls.from_pretrained(granite_bf16, dtype="auto")
    assert ours.get_buffer(COUNTER).dtype == torch.float32
    assert torch.equal(ours.get_buffer(COUNTER), theirs.get_buffer(COUNTER))


# --- conversions -----------------------------------------------------------------------------


@pytest.fixture
def fused_rope(tmp_path: Path) -> Path:
    """A Gradium Phonon TTS checkpoint: its fused `in_proj` is split (Chunk) and its query and
    key parts permuted for rotary embeddings (PermuteForRope) by transformers on load."""
    # as many key/value heads as query heads: transformers' Chunk splits in equal parts
    config = tiny_config("gradium_phonon_tts", num_key_value_heads=4)
    build("GradiumPhononTTSForConditionalGeneration", config).save_pretrained(tmp_path)
    return tmp_path


def test_a_conversion_fastload_does_not_plan_is_refused_naming_the_operation_it_lacks(fused_rope):
    cls = model_class("GradiumPhononTTSForConditionalGeneration")
    with pytest.raises(fastload.UnsupportedError, match="needs transformers' PermuteForRope"):
        fastload.from_pretrained(cls, fused_rope, progress=False)


def test_under_the_patch_a_conversion_fastload_does_not_plan_loads_as_transformers_loads(
    fused_rope,
):
    cls = model_class("GradiumPhononTTSForConditionalGeneration")
    theirs = cls.from_pretrained(fused_rope)
    with fastload.patch_transformers():
        ours = cls.from_pretrained(fused_rope)
    expected = theirs.state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in ours.state_dict().items())


# --- what from_pretrained sets besides tensors -----------------------------------------------


def test_a_decision_model_gets_the_decision_config_saved_beside_its_weights(tmp_path):
    cls = model_class("JevForDecision")
    model = build("JevForDecision", tiny_config("jev"))
    model.decision_config.temperature = {"noul": 0.5}
    model.save_pretrained(tmp_path)
    theirs = cls.from_pretrained(tmp_path)
    ours = fastload.from_pretrained(cls, tmp_path, progress=False)
    assert theirs.decision_config.temperature == {"noul": 0.5}
    assert ours.decision_config == theirs.decision_config


# --- which model tensor a stored name fills ---------------------------------------------------


@pytest.fixture
def pixio_head(tmp_path: Path) -> tuple[Any, Path]:
    """A Pixio backbone saved by transformers: the base model's final norm is stored as
    `encoder.layernorm` (transformers renames `encoder.` to `pixio.` on load), the backbone's
    own output norm as `layernorm`."""
    model = build("PixioBackbone", tiny_config("pixio"))
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert {"encoder.layernorm.weight", "layernorm.weight"} <= set(stored)
    return model, tmp_path


NORMS = ("pixio.layernorm.weight", "layernorm.weight")


def test_transformers_swaps_the_two_norms_of_its_own_pixio_backbone_checkpoint(pixio_head):
    # it adds the `pixio.` prefix to `layernorm` because the model also has that name, and takes
    # it off `pixio.layernorm` (renamed from `encoder.layernorm`) for the same reason
    saved, directory = pixio_head
    theirs = model_class("PixioBackbone").from_pretrained(directory)
    assert torch.equal(theirs.get_parameter(NORMS[0]), saved.get_parameter(NORMS[1]))
    assert torch.equal(theirs.get_parameter(NORMS[1]), saved.get_parameter(NORMS[0]))


def test_the_direct_api_loads_each_norm_of_a_pixio_backbone_back_where_it_was_saved_from(
    pixio_head,
):
    saved, directory = pixio_head
    cls = model_class("PixioBackbone")
    ours = fastload.from_pretrained(cls, directory, progress=False)
    for name in NORMS:
        assert torch.equal(ours.get_parameter(name), saved.get_parameter(name)), name


def test_under_the_patch_the_norms_of_a_pixio_backbone_load_where_transformers_puts_them(
    pixio_head,
):
    _, directory = pixio_head
    cls = model_class("PixioBackbone")
    theirs = cls.from_pretrained(directory)
    with fastload.patch_transformers():
        ours = cls.from_pretrained(directory)
    for name in NORMS:
        assert torch.equal(ours.get_parameter(name), theirs.get_parameter(name)), name


def test_a_base_model_checkpoint_fills_the_base_model_even_where_the_head_has_a_same_named_layer(
    tmp_path,
):
    build("PixioModel", tiny_config("pixio")).save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    ours, report, theirs, info = both("PixioBackbone", tmp_path)
    assert torch.equal(ours.get_parameter("pixio.layernorm.weight"), stored["layernorm.weight"])
    assert "layernorm.weight" in report.missing
    assert report.to_dict()["missing_keys"] == info["missing_keys"]
    assert torch.equal(theirs.get_parameter("pixio.layernorm.weight"), stored["layernorm.weight"])


def test_a_class_declared_unexpected_pattern_is_searched_in_the_renamed_name_as_transformers_does(
    tmp_path,
):
    # Sam3Model declares `^tracker_model.` unexpected; transformers' renames turn a Sam3 tracker
    # checkpoint's `tracker_model.mask_decoder.*` into `mask_decoder.*`, which it then lists
    build("Sam3TrackerModel", tiny_config("sam3_video")).save_pretrained(tmp_path)
    assert any(n.startswith("tracker_model.") for n in load_file(tmp_path / "model.safetensors"))
    _, report, _, info = both("Sam3Model", tmp_path)
    assert "mask_decoder.conv_s0.weight" in info["unexpected_keys"]
    assert report.to_dict()["unexpected_keys"] == info["unexpected_keys"]


# --- tensors nothing initializes -------------------------------------------------------------


@pytest.fixture
def speecht5_base(tmp_path: Path) -> Path:
    """A SpeechT5 base model checkpoint: its speech-to-text head's speech encoder prenet has a
    weight-normed convolution whose `original0` nothing initializes when it is missing."""
    build("SpeechT5Model", tiny_config("speecht5"), seed=1).save_pretrained(tmp_path)
    return tmp_path


ORIGINAL0 = "speecht5.encoder.prenet.pos_conv_embed.conv.parametrizations.weight.original0"


def test_the_direct_api_refuses_a_missing_tensor_nothing_initializes(speecht5_base):
    cls = model_class("SpeechT5ForSpeechToText")
    with pytest.raises(fastload.UninitializedTensorError, match=ORIGINAL0.replace(".", r"\.")):
        fastload.from_pretrained(cls, speecht5_base, progress=False)


def test_under_the_patch_a_missing_tensor_nothing_initializes_goes_to_transformers_loader(
    speecht5_base, transformers_loads
):
    cls = model_class("SpeechT5ForSpeechToText")
    with fastload.patch_transformers():
        model = cls.from_pretrained(speecht5_base)
    assert transformers_loads == ["SpeechT5ForSpeechToText"]
    assert model.get_parameter(ORIGINAL0).device.type == "cpu"
