"""Pickle checkpoints (``.bin``/``.pt``) never run code.

Every test writes a pickle whose ``__reduce__`` would create a marker directory when unpickled,
and checks the marker is never created: fastload refuses pickle checkpoints unless the caller
passes ``allow_pickle=True``, and then loads them only with ``torch.load(weights_only=True)``,
which refuses the malicious global too.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import fastload
from fastload.errors import CheckpointError, PickleRefusedError


class _Payload:
    """Unpickling this calls ``os.mkdir(marker)``: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "code-ran"


def _malicious(path: Path, marker: Path) -> Path:
    state = dict(_model().state_dict())
    state["payload"] = _Payload(marker)  # type: ignore[assignment]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def test_the_payload_does_run_code_when_unpickled_without_weights_only(
    tmp_path: Path, marker: Path
) -> None:
    # What the other tests guard against, shown live: they would notice the marker.
    path = _malicious(tmp_path / "pytorch_model.bin", marker)
    torch.load(path, weights_only=False)
    assert marker.is_dir()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_from_pretrained_refuses_a_pickle_file_without_running_it(
    tmp_path: Path, marker: Path, name: str
) -> None:
    path = _malicious(tmp_path / "ckpt" / name, marker)
    with pytest.raises(PickleRefusedError) as info:
        fastload.from_pretrained(_model, path)
    assert isinstance(info.value, CheckpointError)
    assert str(path) in str(info.value)
    assert not marker.exists()


def test_from_pretrained_refuses_a_directory_holding_only_a_pickle_checkpoint(
    tmp_path: Path, marker: Path
) -> None:
    _malicious(tmp_path / "ckpt" / "pytorch_model.bin", marker)
    with pytest.raises(PickleRefusedError, match="pytorch_model.bin"):
        fastload.from_pretrained(_model, tmp_path / "ckpt")
    assert not marker.exists()


def test_a_module_passed_in_is_unchanged_when_its_pickle_checkpoint_is_refused(
    tmp_path: Path, marker: Path
) -> None:
    path = _malicious(tmp_path / "pytorch_model.bin", marker)
    module = nn.Linear(8, 4)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(PickleRefusedError):
        fastload.from_pretrained(module, path)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
    assert not marker.exists()


@pytest.mark.parametrize("opener", ["load_file", "safe_open"])
def test_the_safetensors_readers_refuse_a_pickle_file_as_malformed(
    tmp_path: Path, marker: Path, opener: str
) -> None:
    path = _malicious(tmp_path / "pytorch_model.bin", marker)
    with pytest.raises(CheckpointError, match=r"\[[a-z-]+\]") as info:
        getattr(fastload, opener)(path)
    assert str(info.value).startswith(f"{path}: ")
    assert not marker.exists()


_HAS_ALLOW_PICKLE = "allow_pickle" in inspect.signature(fastload.from_pretrained).parameters
needs_allow_pickle = pytest.mark.skipif(
    not _HAS_ALLOW_PICKLE, reason="from_pretrained has no allow_pickle parameter yet (issue 6)"
)


@needs_allow_pickle
def test_allow_pickle_still_refuses_a_malicious_pickle(tmp_path: Path, marker: Path) -> None:
    path = _malicious(tmp_path / "pytorch_model.bin", marker)
    with pytest.raises(CheckpointError) as info:
        fastload.from_pretrained(_model, path, allow_pickle=True)
    assert str(path) in str(info.value)
    assert not marker.exists()


@needs_allow_pickle
def test_allow_pickle_loads_a_plain_state_dict_pickle(tmp_path: Path) -> None:
    want = _model().state_dict()
    path = tmp_path / "pytorch_model.bin"
    torch.save(want, path)
    loaded = fastload.from_pretrained(_model, tmp_path, allow_pickle=True, strict=True)
    assert all(torch.equal(t, want[n]) for n, t in loaded.state_dict().items())
