"""Wrong arguments to the public API give fastload errors that say what is wrong (issue 10,
items 13 and 14): never a raw ``AttributeError`` or torch ``RuntimeError``.

Devices are checked before a file is opened; destinations of ``load_into`` before a byte is
written; ``save_file``/``save_pretrained`` refuse what a file cannot hold and name the path the
caller gave, not a hidden temporary one.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import fastload


@pytest.fixture
def small_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.safetensors"
    fastload.save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, path)
    return path


def _unusable_devices() -> list[object]:
    devices: list[object] = ["bogus", "meta", "cuda:123", 123, -1, 4096]
    if not torch.cuda.is_available():
        devices.append("cuda")
    if not torch.backends.mps.is_available():
        devices.append("mps")
    return devices


ENTRY_POINTS: dict[str, Callable[[Path, object], object]] = {
    "load_file": lambda path, device: fastload.load_file(path, device=device),
    "safe_open": lambda path, device: fastload.safe_open(path, "pt", device),
    "get_tensor": lambda path, device: fastload.safe_open(path).get_tensor("bias", device),
    "load_model": lambda path, device: fastload.load_model(nn.Linear(3, 2), path, device=device),
    "from_pretrained": lambda path, device: fastload.from_pretrained(
        nn.Linear(3, 2), path, device=device
    ),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("device", _unusable_devices(), ids=repr)
def test_an_unusable_device_is_a_fastload_error_naming_it(small_file, entry, device) -> None:
    with pytest.raises((fastload.RequestError, fastload.UnsupportedError)) as info:
        ENTRY_POINTS[entry](small_file, device)
    assert str(device) in str(info.value) or f"cuda:{device}" in str(info.value)


@pytest.mark.parametrize(
    ("entry", "device"),
    # get_tensor(device=None) means "the file's device", so None is no error there.
    [
        (e, d)
        for e in ENTRY_POINTS
        for d in (None, 1.5, True, object())
        if (e, d) != ("get_tensor", None)
    ],
    ids=repr,
)
def test_a_device_of_the_wrong_type_is_a_type_error(small_file, entry, device) -> None:
    with pytest.raises(TypeError, match="device must be"):
        ENTRY_POINTS[entry](small_file, device)


def test_meta_as_device_says_there_is_nothing_to_load_into(small_file) -> None:
    with pytest.raises(fastload.RequestError, match="no data"):
        fastload.load_file(small_file, device="meta")


@pytest.mark.parametrize(
    ("destination", "error", "words"),
    [
        ([1.0, 2.0], fastload.UnsupportedError, "not a tensor"),
        (torch.zeros(2).to_sparse(), fastload.UnsupportedError, "layout"),
        (torch.zeros(1).expand(2), fastload.RequestError, "share memory"),
    ],
    ids=["list", "sparse", "expanded"],
)
def test_load_into_refuses_a_destination_it_cannot_fill(small_file, destination, error, words):
    with fastload.safe_open(small_file) as f, pytest.raises(error, match=words) as info:
        f.load_into({"bias": destination})
    assert str(small_file) in str(info.value) and "bias" in str(info.value)


def test_load_into_leaves_other_destinations_untouched_when_one_is_refused(small_file) -> None:
    weight = torch.full((2, 3), 5.0)
    with fastload.safe_open(small_file) as f, pytest.raises(fastload.RequestError):
        f.load_into({"weight": weight, "bias": torch.zeros(1).expand(2)})
    assert torch.equal(weight, torch.full((2, 3), 5.0))


def test_save_pretrained_of_none_is_a_type_error(tmp_path) -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        fastload.save_pretrained(None, tmp_path / "out")  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_save_pretrained_into_a_read_only_place_is_a_permission_error_naming_it(
    tmp_path, monkeypatch
) -> None:
    # Root ignores file modes, so the operating system's refusal is simulated where it happens.
    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    monkeypatch.setattr(os, "mkdir", refuse)
    target = tmp_path / "ro" / "ckpt"
    with pytest.raises(PermissionError) as info:
        fastload.save_pretrained(nn.Linear(2, 2), target)
    assert isinstance(info.value, fastload.FastloadIOError)
    assert info.value.errno == errno.EROFS and str(target) in str(info.value)


def test_save_file_errors_name_the_destination_not_the_temporary_file(tmp_path) -> None:
    target = tmp_path / "no-such-directory" / "model.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        fastload.save_file({"x": torch.ones(2)}, target)
    assert isinstance(info.value, fastload.FastloadIOError)
    assert str(target) in str(info.value) and ".tmp" not in str(info.value)
    assert info.value.filename == str(target)


def test_a_tensor_named_like_the_metadata_key_is_refused_clearly(tmp_path) -> None:
    with pytest.raises(fastload.RequestError, match="reserves that key"):
        fastload.save_file({"__metadata__": torch.ones(1)}, tmp_path / "m.safetensors")


def test_a_nested_tensor_is_refused_with_a_value_error_naming_it(tmp_path) -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(fastload.RequestError, match="nested") as info:
        fastload.save_file({"ragged": nested}, tmp_path / "n.safetensors")
    assert isinstance(info.value, ValueError) and "ragged" in str(info.value)


@pytest.mark.parametrize(
    ("tensors", "error"),
    [
        ({"a": torch.ones(4), "b": None}, ValueError),
        ({"s": torch.zeros(2).to_sparse()}, ValueError),
        ({"m": torch.empty(2, device="meta")}, RuntimeError),
    ],
    ids=["non-tensor", "sparse", "meta"],
)
def test_save_file_refusals_use_the_classes_safetensors_raises(tmp_path, tensors, error) -> None:
    import safetensors.torch as st

    with pytest.raises(error):
        st.save_file(tensors, str(tmp_path / "st.safetensors"))
    with pytest.raises(error) as info:
        fastload.save_file(tensors, tmp_path / "fl.safetensors")
    assert isinstance(info.value, fastload.FastloadError)


def test_tensors_sharing_memory_are_refused_as_a_runtime_error(tmp_path) -> None:
    base = torch.ones(4)
    with pytest.raises(fastload.TensorRefusedError) as info:
        fastload.save_file({"a": base, "b": base[:2]}, tmp_path / "s.safetensors")
    assert isinstance(info.value, RuntimeError)


def test_from_pretrained_of_a_missing_path_is_file_not_found_naming_it(tmp_path) -> None:
    missing = tmp_path / "no-checkpoint-here"
    with pytest.raises(FileNotFoundError) as info:
        fastload.from_pretrained(nn.Linear(3, 2), missing)
    assert isinstance(info.value, fastload.FastloadIOError)
    assert info.value.errno == errno.ENOENT and str(missing) in str(info.value)


# --- strict arguments on every entry point (issue 23, item 7) ---------------------------------
# Each option is checked at the entry, and the error names it: a TypeError for a wrong type, a
# RequestError for a value of the right type that cannot be used. Truthiness is never enough.

FLAGS = (
    "allow_pickle",
    "strict",
    "progress",
    "gradient_checkpointing",
    "output_loading_info",
    "ignore_mismatched_sizes",
)


@pytest.mark.parametrize("value", ["no", 1, None, torch.tensor(True)], ids=repr)
@pytest.mark.parametrize("name", FLAGS)
def test_a_flag_of_from_pretrained_must_be_a_bool(small_file, name, value) -> None:
    # allow_pickle="no" used to enable pickle loading: a non-empty string is true
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        fastload.from_pretrained(nn.Linear(3, 2), small_file, **{name: value})


@pytest.mark.parametrize(
    ("entry", "name"),
    [
        (lambda path, v: fastload.load_file(path, strict=v), "strict"),
        (lambda path, v: fastload.safe_open(path, strict=v), "strict"),
        (lambda path, v: fastload.load(open(path, "rb").read(), strict=v), "strict"),
        (lambda path, v: fastload.load_model(nn.Linear(3, 2), path, strict=v), "strict"),
        (
            lambda path, v: fastload.save_model(nn.Linear(3, 2), path + ".out", force_contiguous=v),
            "force_contiguous",
        ),
    ],
    ids=["load_file", "safe_open", "load", "load_model", "save_model"],
)
def test_a_flag_of_the_safetensors_api_must_be_a_bool(small_file, entry, name) -> None:
    with pytest.raises(TypeError, match=f"{name} must be True or False, got str 'no'"):
        entry(str(small_file), "no")


def test_use_reentrant_of_gradient_checkpointing_enable_must_be_a_bool() -> None:
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    with pytest.raises(TypeError, match="use_reentrant must be True or False"):
        fastload.gradient_checkpointing_enable(model, use_reentrant="no")  # type: ignore[arg-type]
    assert not fastload.is_gradient_checkpointing(model)


HF_FLAGS = ("local_files_only", "use_safetensors", "low_cpu_mem_usage", "trust_remote_code")


@pytest.fixture(scope="module")
def bert_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tiny_models import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("bert"), "BertModel")


@pytest.mark.parametrize("name", HF_FLAGS)
def test_a_transformers_flag_given_to_fastload_must_be_a_bool_or_none(bert_directory, name):
    with pytest.raises(TypeError, match=f"{name} must be True, False or None"):
        fastload.from_pretrained(str(bert_directory), progress=False, **{name: "no"})
    model = fastload.from_pretrained(str(bert_directory), progress=False, **{name: None})
    assert type(model).__name__ == "BertModel"


def test_under_the_patch_transformers_reads_its_own_flags_as_it_does(bert_directory) -> None:
    # transformers' call shape applies there: a truthy value is what transformers would accept
    from transformers import BertModel

    with fastload.patch_transformers():
        model = BertModel.from_pretrained(str(bert_directory), low_cpu_mem_usage="yes")
    assert type(model).__name__ == "BertModel"


DEVICE_ENTRIES: dict[str, Callable[[Path, object], object]] = {
    **ENTRY_POINTS,
    "device_map": lambda path, device: fastload.from_pretrained(
        nn.Linear(3, 2), path, device_map={"": device}
    ),
    "max_memory": lambda path, device: fastload.from_pretrained(
        nn.Linear(3, 2), path, device_map="auto", max_memory={device: "1GB"}
    ),
}


@pytest.mark.parametrize("entry", DEVICE_ENTRIES)
@pytest.mark.parametrize("device", ["cpu:1", torch.device("cpu", 3)], ids=str)
def test_a_cpu_index_other_than_0_is_refused_naming_the_device(small_file, entry, device):
    with pytest.raises(fastload.RequestError, match="does not exist") as info:
        DEVICE_ENTRIES[entry](small_file, device)
    assert str(device) in str(info.value)


def _device_values() -> list[object]:
    values: list[object] = [True, 1.5, "bogus", "cpu:1", "meta", "cuda:123", -1]
    if not torch.cuda.is_available():
        values += ["cuda", "cuda:0", 0]
    return values


@pytest.mark.parametrize("device", _device_values(), ids=repr)
def test_a_device_map_entry_is_judged_as_the_device_argument_is(device) -> None:
    # one parser of devices (fastload.core.devices.checks.parse_device): the same value fails the
    # same way
    from fastload.core.devices.checks import parse_device
    from fastload.core.devices.resolution import resolve_device_map

    with pytest.raises(Exception) as as_device:  # noqa: PT011 - the class is what is compared
        parse_device(device, where="x")  # type: ignore[arg-type]
    with pytest.raises(Exception) as in_map:  # noqa: PT011
        resolve_device_map({"": device}, nn.Linear(3, 2))  # type: ignore[dict-item]
    assert type(in_map.value) is type(as_device.value)
    assert isinstance(in_map.value, (TypeError, fastload.FastloadError))
    assert "device_map" in str(in_map.value)


def _physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


SIZES: dict[str, Callable[[Path, Path, object], object]] = {
    "from_pretrained staging_bytes": lambda path, tmp, size: fastload.from_pretrained(
        nn.Linear(3, 2), path, staging_bytes=size
    ),
    "load_file staging_bytes": lambda path, tmp, size: fastload.load_file(path, staging_bytes=size),
    "safe_open staging_bytes": lambda path, tmp, size: fastload.safe_open(path, staging_bytes=size),
    "from_pretrained max_memory": lambda path, tmp, size: fastload.from_pretrained(
        nn.Linear(3, 2), path, device_map="auto", max_memory={"cpu": size}
    ),
    "save_pretrained max_shard_size": lambda path, tmp, size: fastload.save_pretrained(
        nn.Linear(3, 2), tmp / "out", max_shard_size=size
    ),
    "vllm window": lambda path, tmp, size: _vllm_options({"window": size}),
}


def _vllm_options(extra: dict[str, object]) -> object:
    from fastload.integrations.vllm.options import parse_options  # no vLLM needed

    return parse_options(extra)


#: sizes past any memory, among them numbers a float overflows on (past 309 digits) and that
#: ``int`` and ``repr`` refuse to convert (past 4300 digits)
HUGE = [2**70, 2**53, "5000000TB", "9" * 400, "9" * 400 + "GB", "1" + "0" * 5000, 10**5000]


def _size_id(size: object) -> str:
    text = repr(size) if not isinstance(size, int) else f"int{size.bit_length()}bits"
    return text if len(text) < 20 else f"{text[:8]}...({len(text)} chars)"


@pytest.mark.parametrize("size", HUGE, ids=_size_id)
@pytest.mark.parametrize("entry", SIZES)
def test_a_size_past_any_memory_is_refused_naming_the_argument(small_file, tmp_path, entry, size):
    with pytest.raises(fastload.RequestError, match=entry.split()[1]) as info:
        SIZES[entry](small_file, tmp_path, size)
    assert "is more than" in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("entry", [e for e in SIZES if "staging_bytes" in e])
def test_staging_bytes_past_the_machines_memory_is_refused(small_file, tmp_path, entry) -> None:
    with pytest.raises(fastload.RequestError, match="staging_bytes.*memory of this machine"):
        SIZES[entry](small_file, tmp_path, _physical_memory() + 1)


@pytest.mark.parametrize(
    "classes",
    [{"Linear": 1}, b"Linear", torch.tensor([1]), "Linear", ["Linear", 1], 7],
    ids=["dict", "bytes", "tensor", "str", "list-with-int", "int"],
)
def test_no_split_module_classes_must_be_a_collection_of_class_names(small_file, classes) -> None:
    with pytest.raises(TypeError, match="no_split_module_classes"):
        fastload.from_pretrained(
            nn.Linear(3, 2), small_file, device_map="auto", no_split_module_classes=classes
        )


@pytest.mark.parametrize("classes", [["Linear"], ("Linear",), {"Linear"}], ids=type)
def test_no_split_module_classes_takes_a_list_tuple_or_set(small_file, classes) -> None:
    model = fastload.from_pretrained(
        nn.Linear(3, 2), small_file, device_map="auto", no_split_module_classes=classes
    )
    assert torch.equal(model.weight, torch.ones(2, 3))


MODEL_ENTRIES: dict[str, Callable[[object], object]] = {
    "gradient_checkpointing_enable": fastload.gradient_checkpointing_enable,
    "gradient_checkpointing_disable": fastload.gradient_checkpointing_disable,
    "is_gradient_checkpointing": fastload.is_gradient_checkpointing,
    "unused_parameters": fastload.unused_parameters,
}


@pytest.mark.parametrize("model", [None, "x", nn.Linear], ids=repr)
@pytest.mark.parametrize("entry", MODEL_ENTRIES)
def test_a_model_that_is_not_a_module_is_a_type_error_naming_it(entry, model) -> None:
    with pytest.raises(TypeError, match=f"{entry}: model must be an nn.Module"):
        MODEL_ENTRIES[entry](model)


def test_unused_parameters_loss_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        fastload.unused_parameters(nn.Linear(2, 2), torch.ones(2), loss_fn=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("folder", "error"),
    [
        ("file", fastload.RequestError),
        ("", fastload.RequestError),
        (5, TypeError),
        ("bytes", TypeError),
    ],
    ids=["an-existing-file", "empty", "int", "bytes"],
)
def test_offload_folder_is_checked_at_the_entry_naming_it(small_file, tmp_path, folder, error):
    if folder == "file":
        folder = small_file
    elif folder == "bytes":
        folder = os.fsencode(tmp_path / "offload")
    with pytest.raises(error, match="offload_folder"):
        fastload.from_pretrained(
            nn.Linear(3, 2), small_file, device_map={"": "cpu"}, offload_folder=folder
        )
    assert not (tmp_path / "offload").exists()
