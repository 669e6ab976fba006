"""transformers' from_pretrained options: each honoured with transformers' meaning, or refused
with UnsupportedError naming it (the table in fastload.hf.options and the README)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import assert_same_tensors, make_checkpoint  # noqa: E402

import fastload  # noqa: E402
from fastload import UnsupportedError  # noqa: E402
from fastload.hf.options import OPTIONS, counts, markdown_table  # noqa: E402

REFUSED = sorted(name for name, (status, _) in OPTIONS.items() if status == "refused")
#: a value that asks for each refused option's feature
REFUSED_VALUES = {
    "proxies": {"https": "proxy:3128"},
    "offload_buffers": True,
    "quantization_config": {"load_in_8bit": True},
    "gguf_file": "model.gguf",
    "fusion_config": {"patch_embeddings": True},
    "use_kernels": True,
    "kernel_config": {"x": 1},
    "allow_all_kernels": True,
    "adapter_kwargs": {"revision": "x"},
    "from_tf": True,
    "from_flax": True,
    "mirror": "tuna",
}


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert"), "BertModel")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gpt2"), "GPT2LMHeadModel")


def load(*args, **kwargs):
    kwargs.setdefault("progress", False)
    return fastload.from_pretrained(*args, **kwargs)


def test_every_option_of_the_table_is_exercised_by_this_module_the_hub_or_offload_tests():
    tests = Path(__file__).parents[1]
    files = ("hf/test_hf_options.py", "hf/test_hf_hub.py", "core/test_offload.py")
    source = "".join((tests / name).read_text() for name in files)
    untested = [name for name in OPTIONS if f'"{name}"' not in source and f"{name}=" not in source]
    assert untested == []


def test_every_refused_option_has_a_value_asking_for_it_here():
    assert sorted(REFUSED_VALUES) == REFUSED


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_option_raises_unsupported_error_naming_it(bert, name):
    with pytest.raises(UnsupportedError, match=name):
        load(str(bert), **{name: REFUSED_VALUES[name]})


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_option_at_its_not_used_value_is_accepted(bert, name):
    model = load(str(bert), **{name: None})
    assert type(model).__name__ == "BertModel"


def test_torch_dtype_is_an_alias_of_dtype(bert):
    model = load(str(bert), torch_dtype=torch.float16)
    assert model.pooler.dense.weight.dtype == torch.float16
    assert model.config.dtype == torch.float16


def test_dtype_wins_over_torch_dtype_as_in_transformers(bert):
    model = load(str(bert), dtype=torch.float16, torch_dtype=torch.bfloat16)
    assert model.pooler.dense.weight.dtype == torch.float16


def test_key_mapping_is_an_alias_of_key_map(tmp_path, bert):
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((bert / "config.json").read_text())
    tensors = {
        k.replace("encoder.", "body."): v for k, v in load_file(bert / "model.safetensors").items()
    }
    save_file(tensors, renamed / "model.safetensors")
    model = load(str(renamed), key_mapping={r"^body\.": "encoder."}, missing="error")
    assert_same_tensors(model, load(str(bert)))


@pytest.mark.parametrize(
    "name,value",
    [
        ("low_cpu_mem_usage", True),
        ("_fast_init", True),
        ("offload_state_dict", True),
        ("_from_auto", True),
        ("_from_pipeline", "feature-extraction"),
        ("_commit_hash", "0" * 40),
        ("code_revision", "main"),
        ("tqdm_class", object),
        ("adapter_name", "default"),
        ("weights_only", True),
        ("use_safetensors", True),
        ("trust_remote_code", False),
    ],
)
def test_options_with_no_effect_on_a_local_safetensors_load_are_accepted(bert, name, value):
    model = load(str(bert), **{name: value})
    assert_same_tensors(model, load(str(bert)))


def test_weights_only_false_is_refused(bert):
    with pytest.raises(UnsupportedError, match="weights_only"):
        load(str(bert), weights_only=False)


def test_adapter_name_other_than_default_is_refused(bert):
    with pytest.raises(UnsupportedError, match="adapter_name"):
        load(str(bert), adapter_name="mine")


def test_use_safetensors_false_loads_the_pickle_checkpoint_with_weights_only(tmp_path):
    from safetensors.torch import load_file

    directory = make_checkpoint(tmp_path / "pickled", "BertModel", seed=5)
    tensors = load_file(directory / "model.safetensors")
    torch.save({k: v * 2 for k, v in tensors.items()}, directory / "pytorch_model.bin")
    by_pickle = load(str(directory), use_safetensors=False)
    by_default = load(str(directory))
    assert torch.equal(by_pickle.pooler.dense.weight, 2 * by_default.pooler.dense.weight)


def test_attn_implementation_is_set_on_the_config(bert):
    model = load(str(bert), attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def test_experts_implementation_is_set_on_the_config(bert):
    model = load(str(bert), experts_implementation="eager")
    assert model.config._experts_implementation == "eager"


def test_generation_config_replaces_the_checkpoints(gpt2):
    from transformers import GenerationConfig

    wanted = GenerationConfig(max_new_tokens=3, do_sample=False)
    model = load(str(gpt2), generation_config=wanted)
    assert model.generation_config.max_new_tokens == 3


def test_disable_mmap_picks_the_read_mode(bert):
    _, by_pread = load(str(bert), disable_mmap=True, output_loading_info=True)
    _, by_mmap = load(str(bert), disable_mmap=False, output_loading_info=True)
    # disable_mmap=True maps nothing; False leaves the default views of the local file.
    assert (by_pread.read_mode, by_mmap.read_mode) == ("pread", "mmap+shared-mmap")
    assert by_pread.bytes_shared == 0


def test_config_overrides_reach_the_config_and_the_rest_reach_init(bert):
    model = load(str(bert), hidden_dropout_prob=0.25, add_pooling_layer=False)
    assert model.config.hidden_dropout_prob == 0.25
    assert model.pooler is None


def test_an_unknown_keyword_is_a_type_error_from_the_model_not_silently_dropped(bert):
    with pytest.raises(TypeError, match="no_such_option"):
        load(str(bert), no_such_option=1)


def test_config_as_an_object_builds_the_model_from_it(bert):
    from transformers import BertConfig

    config = BertConfig.from_pretrained(bert)
    config.hidden_dropout_prob = 0.3
    model = load(str(bert), config=config)
    assert model.config.hidden_dropout_prob == 0.3


def test_state_dict_with_a_config_builds_and_fills_the_model(bert):
    reference = load(str(bert))
    model = load(None, config=reference.config, state_dict=reference.state_dict())
    assert_same_tensors(model, reference)


def test_ignore_mismatched_sizes_reinitializes_the_head(tmp_path):
    directory = make_checkpoint(tmp_path / "cls", "BertForSequenceClassification")
    model, report = load(
        str(directory), num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True
    )
    assert model.classifier.weight.shape == (5, 32)
    assert sorted(m[0] for m in report.mismatched) == ["classifier.bias", "classifier.weight"]


def test_output_loading_info_returns_the_report(bert):
    model, report = load(str(bert), output_loading_info=True)
    assert report.model_class == "BertModel" and report.to_dict()["missing_keys"] == set()


def test_device_map_balanced_plans_with_accelerate(bert):
    pytest.importorskip("accelerate")
    model = load(str(bert), device_map="balanced")
    # Everything fits one place (the CPU here): not dispatched, so no hf_device_map, as transformers
    assert not hasattr(model, "hf_device_map")
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("mode", ["balanced_low_0", "sequential"])
def test_device_map_accelerate_modes_place_every_tensor(bert, mode):
    pytest.importorskip("accelerate")
    model = load(str(bert), device_map=mode)
    assert not any(p.device.type == "meta" for p in model.parameters())
    assert not hasattr(model, "hf_device_map")  # one place (the CPU): not dispatched


def test_max_memory_without_a_device_map_plans_auto(bert):
    _, report = load(str(bert), max_memory={"cpu": "1GiB"}, output_loading_info=True)
    assert report.device_map is not None and set(report.device_map.values()) == {"cpu"}


def test_device_map_auto_honours_no_split_module_classes(bert):
    _, report = load(
        str(bert),
        device_map="auto",
        max_memory={"cpu": "1GiB"},
        no_split_module_classes=["BertLayer"],
        output_loading_info=True,
    )
    assert "encoder.layer.0" in report.device_map


def test_a_fastload_tp_plan_without_torch_distributed_is_refused_by_the_core(bert):
    # tp_plan="auto" is transformers' call shape, sized from WORLD_SIZE: in one process it
    # shards nothing, as in transformers (above); fastload's own plans need the ranks
    with pytest.raises(fastload.FastloadError, match="init_process_group"):
        load(str(bert), tp_plan={"encoder.layer.*.attention.self.query": "colwise"})


def test_trust_remote_code_runs_the_repository_model_class(tmp_path):
    directory = _remote_code_repo(tmp_path)
    model = load(str(directory), trust_remote_code=True)
    assert type(model).__name__ == "TinyRemoteModel"


def test_remote_code_without_trust_remote_code_is_refused(tmp_path):
    directory = _remote_code_repo(tmp_path)
    with pytest.raises(UnsupportedError, match="trust_remote_code"):
        load(str(directory))


def _remote_code_repo(tmp_path: Path) -> Path:
    directory = make_checkpoint(tmp_path / "remote", "BertModel")
    (directory / "modeling_tiny.py").write_text(
        "from transformers import BertModel\n\n\nclass TinyRemoteModel(BertModel):\n    pass\n"
    )
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["TinyRemoteModel"]
    config["auto_map"] = {"AutoModel": "modeling_tiny.TinyRemoteModel"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_option_table_counts_every_option_once():
    honoured, refused = counts()
    assert honoured + refused == len(OPTIONS)
    assert markdown_table().count("\n| `") == len(OPTIONS)


def test_an_option_honoured_quietly_logs_nothing(bert, caplog):
    caplog.set_level(logging.WARNING, logger="fastload")
    load(str(bert), low_cpu_mem_usage=True)
    assert [r for r in caplog.records if r.name == "fastload"] == []


def test_transformers_tensor_parallel_options_outside_torch_distributed_act_as_in_transformers(
    bert: Path,
) -> None:
    # With ranks they give transformers' DTensor model (tests/hf/test_dtensor_tp.py); in one
    # process: a size of 1 (or none, from WORLD_SIZE) shards nothing, device_mesh is ignored as
    # transformers 5 ignores it, and a size of 2 fails where transformers' own load fails.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process has torch.distributed initialized")
    plain = {k: v.clone() for k, v in load(bert).state_dict().items()}
    for options in (
        {"device_mesh": object()},
        {"distributed_config": {"tp_size": 1}},
        {"tp_plan": "auto"},
    ):
        state = load(bert, **options).state_dict()
        assert state.keys() == plain.keys()
        assert all(torch.equal(state[k], plain[k]) for k in plain), options
    with pytest.raises(OSError, match="initialize torch.distributed"):
        load(bert, tp_size=2)
