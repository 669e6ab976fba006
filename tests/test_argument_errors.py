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
