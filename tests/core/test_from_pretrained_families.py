"""fastload.from_pretrained against transformers' own from_pretrained, family by family.

Each case saves a tiny model with random weights through transformers' save_pretrained, loads it
both ways, and requires the same tensors (names, roles, shapes, dtypes, bitwise values), the same
outputs on a fixed batch, and the same ties, sharing storage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastload
from fastload.core.model.tying import find_tie_groups

transformers = pytest.importorskip("transformers")

from tiny_models import (  # noqa: E402
    CLASSES,
    FAMILIES,
    assert_same_outputs,
    assert_same_tensors,
    example_inputs,
    make_checkpoint,
    model_class,
    outputs_of,
)

# (model class, config overrides); Llama does not tie by default, so it is also tested tied.
CASES = [(name, {}) for family in FAMILIES for name in CLASSES[family]] + [
    ("LlamaForCausalLM", {"tie_word_embeddings": True})
]
TIED = [
    ("BertForMaskedLM", {}),
    ("GPT2LMHeadModel", {}),
    ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    ("T5ForConditionalGeneration", {}),
    ("BartForConditionalGeneration", {}),
]


def case_id(case: tuple[str, dict]) -> str:
    name, overrides = case
    return name + "".join(f"-{k}={v}" for k, v in overrides.items())


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """Saves each (class, dtype, shard size, overrides) checkpoint once per module."""
    cache: dict[str, Path] = {}

    def save(
        name: str, *, dtype: torch.dtype | None = None, max_shard_size: str | None = None, **kw
    ) -> Path:
        key = f"{name}-{dtype}-{max_shard_size}-{sorted(kw.items())}"
        if key not in cache:
            directory = tmp_path_factory.mktemp(name)
            cache[key] = make_checkpoint(
                directory, name, dtype=dtype, max_shard_size=max_shard_size, **kw
            )
        return cache[key]

    return save


def load_both(path: Path, name: str, **kwargs):
    cls = model_class(name)
    ours = fastload.from_pretrained(cls, path, progress=False, **kwargs)
    theirs = cls.from_pretrained(path, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_model_equals_transformers_tensor_by_tensor_and_on_outputs(saved, case):
    name, overrides = case
    ours, theirs = load_both(saved(name, **overrides), name)
    assert_same_tensors(ours, theirs)
    assert_same_outputs(ours, theirs, example_inputs(theirs))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_no_tensor_is_left_on_meta_and_the_model_is_in_eval_mode(saved, case):
    name, overrides = case
    model = fastload.from_pretrained(model_class(name), saved(name, **overrides), progress=False)
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert on_meta == []
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("case", TIED, ids=case_id)
def test_tied_parameters_are_the_same_groups_as_transformers_and_share_storage(saved, case):
    name, overrides = case
    ours, theirs = load_both(saved(name, **overrides), name)
    groups = find_tie_groups(ours)
    assert groups, "the model should have tied parameters"
    assert sorted(map(sorted, groups)) == sorted(map(sorted, find_tie_groups(theirs)))
    for group in groups:
        first = ours.get_parameter(group[0])
        assert all(ours.get_parameter(n) is first for n in group)
        assert len({ours.get_parameter(n).data_ptr() for n in group}) == 1


@pytest.mark.parametrize("case", TIED, ids=case_id)
def test_ties_survive_an_optimizer_step(saved, case):
    name, overrides = case
    model = fastload.from_pretrained(model_class(name), saved(name, **overrides), progress=False)
    groups = find_tie_groups(model)
    before = {g[0]: model.get_parameter(g[0]).detach().clone() for g in groups}
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = sum(t.float().square().mean() for t in outputs_of_grad(model))
    loss.backward()
    optimizer.step()
    for group in groups:
        params = [model.get_parameter(n) for n in group]
        assert all(p is params[0] for p in params)
        assert len({p.data_ptr() for p in params}) == 1
        assert not torch.equal(params[0].detach(), before[group[0]]), f"{group} did not train"


def outputs_of_grad(model: torch.nn.Module) -> list[torch.Tensor]:
    out = model(**example_inputs(model))
    tensors = [t for t in out.to_tuple() if isinstance(t, torch.Tensor)]
    return [t for t in tensors if t.requires_grad]


@pytest.mark.parametrize(
    "name", ["BertForMaskedLM", "LlamaForCausalLM", "T5ForConditionalGeneration"]
)
def test_sharded_checkpoint_loads_like_transformers(saved, name):
    path = saved(name, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    ours, theirs = load_both(path, name)
    assert_same_tensors(ours, theirs)
    assert_same_outputs(ours, theirs, example_inputs(theirs))


def test_sharded_checkpoint_loads_from_its_index_file_path(saved):
    path = saved("GPT2LMHeadModel", max_shard_size="20KB")
    ours = fastload.from_pretrained(
        model_class("GPT2LMHeadModel"), path / "model.safetensors.index.json", progress=False
    )
    theirs = model_class("GPT2LMHeadModel").from_pretrained(path)
    assert_same_tensors(ours, theirs)


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("BertForMaskedLM", torch.float16),
        ("GPT2LMHeadModel", torch.bfloat16),
        ("LlamaForCausalLM", torch.bfloat16),
        ("T5ForConditionalGeneration", torch.float16),  # keeps its "wo" layers in float32
        ("BartForConditionalGeneration", torch.float64),
    ],
)
def test_dtype_conversion_during_the_copy_matches_transformers(saved, name, dtype):
    ours, theirs = load_both(saved(name), name, dtype=dtype)
    assert_same_tensors(ours, theirs)
    assert_same_outputs(ours, theirs, example_inputs(theirs))
    assert {p.dtype for p in ours.parameters()} >= {dtype}


def test_t5_in_float16_keeps_its_wo_layers_in_float32(saved):
    model = fastload.from_pretrained(
        model_class("T5ForConditionalGeneration"),
        saved("T5ForConditionalGeneration"),
        dtype=torch.float16,
        progress=False,
    )
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if ".wo." in n)
    assert all(d == torch.float16 for n, d in dtypes.items() if ".wo." not in n)


def test_auto_dtype_keeps_a_bfloat16_checkpoint_in_bfloat16(saved):
    path = saved("LlamaForCausalLM", dtype=torch.bfloat16)
    ours, theirs = load_both(path, "LlamaForCausalLM")
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert_same_tensors(ours, theirs)


def test_dtype_given_as_a_string_is_accepted(saved):
    model = fastload.from_pretrained(
        model_class("GPT2Model"), saved("GPT2Model"), dtype="float16", progress=False
    )
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_persistent_buffer_is_loaded_from_the_checkpoint(saved):
    path = saved("BartForConditionalGeneration")
    model = fastload.from_pretrained(
        model_class("BartForConditionalGeneration"), path, progress=False
    )
    stored = fastload.load_file(path / "model.safetensors")["final_logits_bias"]
    assert "final_logits_bias" in dict(model.named_buffers())
    assert stored.abs().sum() > 0  # randomized, so a left-over zero init cannot pass
    assert torch.equal(model.final_logits_bias, stored)


@pytest.mark.parametrize(
    "name,buffer",
    [
        ("BertModel", "embeddings.position_ids"),
        ("BertModel", "embeddings.token_type_ids"),
        ("LlamaModel", "rotary_emb.inv_freq"),
        ("GPT2Model", None),
    ],
)
def test_non_persistent_buffers_keep_the_values_init_computes(saved, name, buffer):
    cls = model_class(name)
    model = fastload.from_pretrained(cls, saved(name), progress=False)
    fresh = cls(model.config)
    expected = {n: b for n, b in fresh.named_buffers()}
    loaded = dict(model.named_buffers())
    assert sorted(loaded) == sorted(expected)
    for n, b in expected.items():
        assert torch.equal(loaded[n], b), n
    if buffer is not None:
        assert buffer in loaded


def test_loaded_model_runs_a_forward_pass_without_touching_meta(saved):
    model = fastload.from_pretrained(model_class("LlamaForCausalLM"), saved("LlamaForCausalLM"))
    logits = outputs_of(model, example_inputs(model))[0]
    assert logits.device.type == "cpu" and torch.isfinite(logits).all()


def test_ties_hold_after_resize_token_embeddings_like_transformers(tmp_path):
    from tiny_models import make_model, save_checkpoint

    source = make_model("BertForMaskedLM")
    source.resize_token_embeddings(105)
    path = save_checkpoint(source, tmp_path)
    ours, theirs = load_both(path, "BertForMaskedLM")
    assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight
    assert ours.cls.predictions.decoder.bias is ours.cls.predictions.bias
    assert ours.cls.predictions.decoder.weight.shape == (105, 32)
    assert_same_tensors(ours, theirs)
    assert_same_outputs(ours, theirs, example_inputs(theirs))


def test_model_none_builds_the_architecture_named_in_config_json(saved):
    model = fastload.from_pretrained(None, saved("GPT2LMHeadModel"), progress=False)
    assert type(model).__name__ == "GPT2LMHeadModel"


def test_a_given_config_is_used_and_not_modified(saved):
    from tiny_models import make_config

    config = make_config("bert")
    config.gradient_checkpointing = True
    model = fastload.from_pretrained(
        model_class("BertModel"), saved("BertModel"), config=config, progress=False
    )
    assert model.config is not config
    assert config.gradient_checkpointing is True
    assert model.config.hidden_size == 32


def test_legacy_gradient_checkpointing_key_in_config_json_does_not_switch_it_on(
    saved, tmp_path, caplog
):
    import json
    import shutil

    from fastload.training.gradient_checkpointing import is_gradient_checkpointing

    path = shutil.copytree(saved("BertModel"), tmp_path / "old")
    config = json.loads((path / "config.json").read_text())
    config["gradient_checkpointing"] = True
    (path / "config.json").write_text(json.dumps(config))
    model = fastload.from_pretrained(model_class("BertModel"), path, progress=False)
    assert not is_gradient_checkpointing(model)
    assert not model.is_activation_checkpointing
    assert "gradient_checkpointing" not in model.config.to_dict()
    assert any("gradient_checkpointing" in r.getMessage() for r in caplog.records)


def test_gradient_checkpointing_option_enables_it_and_leaves_train_mode(saved):
    from fastload.training.gradient_checkpointing import is_gradient_checkpointing

    model = fastload.from_pretrained(
        model_class("LlamaForCausalLM"),
        saved("LlamaForCausalLM"),
        gradient_checkpointing=True,
        progress=False,
    )
    assert is_gradient_checkpointing(model)
    assert model.training


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["BertForMaskedLM", "LlamaForCausalLM"])
def test_loading_onto_cuda_matches_transformers(saved, name):
    path = saved(name)
    cls = model_class(name)
    ours = fastload.from_pretrained(cls, path, device="cuda", progress=False)
    theirs = cls.from_pretrained(path, device_map="cuda")
    assert all(t.is_cuda for t in [*ours.parameters(), *ours.buffers()])
    assert_same_tensors(ours, theirs)
    inputs = {k: v.cuda() for k, v in example_inputs(theirs).items()}
    for x, y in zip(outputs_of(ours, inputs), outputs_of(theirs, inputs), strict=True):
        torch.testing.assert_close(x, y)
