"""Pickle checkpoints (``.bin``/``.pt``) never run code.

Every test writes a pickle whose ``__reduce__`` would create a marker directory when unpickled,
and checks the marker is never created: fastload refuses pickle checkpoints unless the caller
passes ``allow_pickle=True``, and then loads them only with ``torch.load(weights_only=True)``,
which refuses the malicious global too.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from tiny_models import assert_same_tensors, make_model, model_class
from torch import nn

import fastload
from fastload.core.basics.engine import copy_into
from fastload.core.basics.errors import (
    CheckpointError,
    PickleRefusedError,
    RequestError,
    TensorNotFoundError,
    UnsupportedError,
)
from fastload.core.checkpoint.pickle_file import PickleFile
from fastload.core.memory.staging import StagingPool
from fastload.core.reads.reading import fill
from fastload.core.reads.streaming import stream_into


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


def test_allow_pickle_still_refuses_a_malicious_pickle(tmp_path: Path, marker: Path) -> None:
    path = _malicious(tmp_path / "pytorch_model.bin", marker)
    with pytest.raises(CheckpointError) as info:
        fastload.from_pretrained(_model, path, allow_pickle=True)
    assert str(path) in str(info.value)
    assert not marker.exists()


def test_allow_pickle_loads_a_plain_state_dict_pickle(tmp_path: Path) -> None:
    # Values a freshly built _model() does not have, so only a real load matches them.
    want = {k: v + 1 for k, v in _model().state_dict().items()}
    path = tmp_path / "pytorch_model.bin"
    torch.save(want, path)
    loaded = fastload.from_pretrained(_model, tmp_path, allow_pickle=True, strict=True)
    assert all(torch.equal(t, want[n]) for n, t in loaded.state_dict().items())


# --- allow_pickle=True: what is refused --------------------------------------------------------


def test_allow_pickle_refusal_says_why_and_never_suggests_weights_only_false(
    tmp_path: Path, marker: Path
) -> None:
    path = _malicious(tmp_path / "model.pt", marker)
    with pytest.raises(CheckpointError) as info:
        fastload.from_pretrained(_model, path, allow_pickle=True)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert "weights_only=True" in message and "mkdir" in message
    assert "weights_only` set to `False`" not in message
    assert not marker.exists()


def test_allow_pickle_leaves_a_module_passed_in_unchanged_when_the_pickle_is_malicious(
    tmp_path: Path, marker: Path
) -> None:
    path = _malicious(tmp_path / "pytorch_model.bin", marker)
    module = _model()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointError):
        fastload.from_pretrained(module, path, allow_pickle=True)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
    assert not marker.exists()


def test_allow_pickle_refuses_a_non_tensor_entry_naming_its_key(tmp_path: Path) -> None:
    state = dict(_model().state_dict())
    state["epoch"] = 3  # type: ignore[assignment]
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: entry 'epoch' is a int"):
        fastload.from_pretrained(_model, tmp_path, allow_pickle=True)


def test_allow_pickle_refuses_a_pickle_that_is_not_a_dict(tmp_path: Path) -> None:
    torch.save([torch.ones(2)], tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"model\.pt: holds a list, not a dict of tensors"):
        fastload.from_pretrained(_model, tmp_path / "model.pt", allow_pickle=True)


def test_allow_pickle_calls_a_file_torch_cannot_read_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"not a torch file at all" * 4)
    with pytest.raises(CheckpointError) as info:
        fastload.from_pretrained(_model, path, allow_pickle=True)
    assert str(info.value).startswith(f"{path}: ")


def test_allow_pickle_refuses_shared_mmap_before_unpickling(tmp_path: Path, marker: Path) -> None:
    path = _malicious(tmp_path / "pytorch_model.bin", marker)
    with pytest.raises(RequestError, match="mmap='shared' needs safetensors files"):
        fastload.from_pretrained(_model, path, allow_pickle=True, mmap="shared")
    assert not marker.exists()


# --- without allow_pickle: refused, with the way out -------------------------------------------


@pytest.mark.parametrize("target", ["file", "directory", "index"])
def test_a_pickle_checkpoint_is_refused_with_advice_to_allow_it_or_convert_it(
    tmp_path: Path, target: str
) -> None:
    directory = _sharded_pickle(tmp_path / "ckpt", _model().state_dict())
    torch.save(_model().state_dict(), directory / "model.pt")
    path = {
        "file": directory / "model.pt",
        "directory": directory,
        "index": directory / "pytorch_model.bin.index.json",
    }[target]
    with pytest.raises(PickleRefusedError) as info:
        fastload.from_pretrained(_model, path)
    assert "allow_pickle=True" in str(info.value)
    assert "fastload convert" in str(info.value)


# --- allow_pickle=True: loads exactly as a safetensors checkpoint would ------------------------


def _sharded_pickle(directory: Path, state: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """``state`` saved as ``shards`` pickle files with a ``pytorch_model.bin.index.json``, the
    way transformers shards ``.bin`` checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    names = list(state)
    weight_map = {}
    for i in range(shards):
        shard = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[i::shards]}
        torch.save(part, directory / shard)
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return directory


def _transformers_pickle(directory: Path, class_name: str, *, drop: tuple[str, ...] = ()) -> Path:
    """A tiny transformers model saved as transformers 4 did with
    ``safe_serialization=False`` (which transformers 5 removed): ``config.json`` and
    ``torch.save(state_dict())`` as ``pytorch_model.bin``."""
    model = make_model(class_name)
    model.config.save_pretrained(directory)
    state = {k: v for k, v in model.state_dict().items() if k not in drop}
    torch.save(state, directory / "pytorch_model.bin")
    return directory


@pytest.mark.parametrize("class_name", ["GPT2LMHeadModel", "BertForMaskedLM"])
def test_a_transformers_pytorch_model_bin_loads_like_transformers_loads_it(
    tmp_path: Path, class_name: str
) -> None:
    directory = _transformers_pickle(tmp_path / "ckpt", class_name)
    cls = model_class(class_name)
    loaded = fastload.from_pretrained(cls, directory, allow_pickle=True, progress=False)
    assert_same_tensors(loaded, cls.from_pretrained(directory).eval())
    assert_same_tensors(loaded, make_model(class_name))


def test_allow_pickle_re_ties_weights_the_pickle_stores_under_one_name(tmp_path: Path) -> None:
    directory = _transformers_pickle(tmp_path / "ckpt", "GPT2LMHeadModel", drop=("lm_head.weight",))
    loaded, report = fastload.from_pretrained(
        model_class("GPT2LMHeadModel"),
        directory,
        allow_pickle=True,
        strict=True,
        output_loading_info=True,
    )
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert ["lm_head.weight", "transformer.wte.weight"] in [sorted(g) for g in report.tied]
    assert_same_tensors(loaded, make_model("GPT2LMHeadModel"))


def test_allow_pickle_loads_a_sharded_pytorch_model_bin_index(tmp_path: Path) -> None:
    original = make_model("BertForMaskedLM")
    directory = _sharded_pickle(tmp_path / "ckpt", original.state_dict(), shards=3)
    original.config.save_pretrained(directory)
    loaded, report = fastload.from_pretrained(
        model_class("BertForMaskedLM"), directory, allow_pickle=True, output_loading_info=True
    )
    assert_same_tensors(loaded, original)
    assert len(report.files) == 3
    assert report.read_mode == "torch.load(weights_only)"


def test_allow_pickle_prefers_safetensors_next_to_a_pickle(tmp_path: Path, marker: Path) -> None:
    fastload.save_file({k: v + 1 for k, v in _model().state_dict().items()}, tmp_path / "x")
    (tmp_path / "x").rename(tmp_path / "model.safetensors")
    _malicious(tmp_path / "pytorch_model.bin", marker)
    _, report = fastload.from_pretrained(
        _model, tmp_path, allow_pickle=True, output_loading_info=True
    )
    # The safetensors file was loaded (as views of its mapping, the default on a local disk).
    assert report.read_mode == "pread+shared-mmap"
    assert not marker.exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, "auto"])
def test_a_pickle_and_a_safetensors_file_of_one_state_load_identically(
    tmp_path: Path, dtype: object
) -> None:
    # Renamed keys and an unexpected tensor, so key mapping and policies are exercised too.
    state = {f"net.{k}": v * 3 for k, v in _model().state_dict().items()}
    state["net.extra"] = torch.ones(2)
    torch.save(state, tmp_path / "model.pt")
    st_save_file(state, tmp_path / "model.safetensors")
    # mmap="copy": a pickle is always copied, so the safetensors load copies too for equal counts.
    options: dict = dict(
        dtype=dtype, key_map={r"^net\.": ""}, output_loading_info=True, progress=False, mmap="copy"
    )
    from_pickle, report_p = fastload.from_pretrained(
        _model, tmp_path / "model.pt", allow_pickle=True, **options
    )
    from_st, report_s = fastload.from_pretrained(_model, tmp_path / "model.safetensors", **options)
    assert_same_tensors(from_pickle, from_st)
    assert report_p.unexpected == report_s.unexpected == ["net.extra"]
    assert report_p.renamed == report_s.renamed and len(report_p.renamed) == 4
    assert (report_p.bytes_read, report_p.bytes_written) == (
        report_s.bytes_read,
        report_s.bytes_written,
    )


def test_allow_pickle_reads_the_legacy_non_zip_format(tmp_path: Path) -> None:
    want = {k: v - 1 for k, v in _model().state_dict().items()}
    torch.save(want, tmp_path / "model.pt", _use_new_zipfile_serialization=False)
    loaded = fastload.from_pretrained(_model, tmp_path / "model.pt", allow_pickle=True)
    assert all(torch.equal(t, want[n]) for n, t in loaded.state_dict().items())


# --- a sharded pickle index is checked like the safetensors index ------------------------------


def _break(directory: Path, case: str) -> None:
    index_path = directory / "pytorch_model.bin.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    first = next(iter(weight_map))
    if case == "outside":
        weight_map[first] = "../outside.bin"
    elif case == "missing":
        (directory / weight_map[first]).unlink()
    elif case == "elsewhere":  # the shard holds it, the index says the other shard
        others = sorted(set(weight_map.values()) - {weight_map[first]})
        weight_map[first] = others[0]
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("case", "rule"),
    [
        ("outside", "shard-outside-directory"),
        ("missing", "missing-shard"),
        ("elsewhere", "index-mismatch"),
    ],
)
def test_a_broken_pickle_index_is_a_checkpoint_error_naming_the_rule(
    tmp_path: Path, case: str, rule: str
) -> None:
    directory = _sharded_pickle(tmp_path / "ckpt", _model().state_dict())
    torch.save({"x": torch.ones(1)}, tmp_path / "outside.bin")
    _break(directory, case)
    with pytest.raises(CheckpointError, match=rf"pytorch_model\.bin\.index\.json: .*\[{rule}\]"):
        fastload.from_pretrained(_model, directory, allow_pickle=True)


def test_a_tensor_in_two_pickle_shards_is_a_checkpoint_error(tmp_path: Path) -> None:
    state = _model().state_dict()
    directory = _sharded_pickle(tmp_path / "ckpt", state)
    shard = "pytorch_model-00002-of-00002.bin"
    torch.save({**torch.load(directory / shard), "0.weight": state["0.weight"]}, directory / shard)
    with pytest.raises(CheckpointError, match=r"'0\.weight'.*\[duplicate-tensor\]"):
        fastload.from_pretrained(_model, directory, allow_pickle=True)


# --- PickleFile behaves like SafetensorsFile under the copy API --------------------------------


def test_a_pickle_file_fills_slices_and_converts_like_the_copy_engine(tmp_path: Path) -> None:
    weight = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    torch.save({"w": weight}, tmp_path / "w.pt")
    file = PickleFile(tmp_path / "w.pt")
    rows = torch.empty(2, 6, dtype=torch.bfloat16)
    cols = torch.empty(4, 3)
    flat = torch.empty(5)
    fill(file, [("w", rows, [0, 1, 3]), ("w", cols, [1, 3, 6]), ("w", flat, [7, 12])])
    assert torch.equal(rows, weight[1:3].to(torch.bfloat16))
    assert torch.equal(cols, weight[:, 3:6])
    assert torch.equal(flat, weight.flatten()[7:12])


def test_a_pickle_file_streams_through_staging_buffers(tmp_path: Path) -> None:
    state = {"a": torch.randn(100, 10), "b": torch.arange(7)}
    torch.save(state, tmp_path / "s.pt")
    out = {k: torch.empty_like(v) for k, v in state.items()}
    stream_into(
        PickleFile(tmp_path / "s.pt"),
        [(k, t, None) for k, t in out.items()],
        pool=StagingPool(128, 4),
    )
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.parametrize(
    ("job", "error", "rule"),
    [
        (("nope", 4, "F32", None), TensorNotFoundError, "unknown-tensor"),
        (("w", 12, "F32", None), RequestError, "destination-size"),
        (("w", 24, "I32", None), UnsupportedError, "unsupported-conversion"),
        (("w", 4, "F32", [2, 0, 1]), RequestError, "invalid-selection"),
    ],
)
def test_a_pickle_file_checks_every_job_before_writing_any(
    tmp_path: Path, job: tuple, error: type[Exception], rule: str
) -> None:
    torch.save({"w": torch.ones(2, 3)}, tmp_path / "w.pt")
    file = PickleFile(tmp_path / "w.pt")
    good = torch.zeros(2, 3)
    scratch = torch.zeros(64, dtype=torch.uint8)
    name, nbytes, st_dtype, selection = job
    jobs = [("w", good, "F32", None), (name, scratch[:nbytes], st_dtype, selection)]
    with pytest.raises(error, match=rf"^{re.escape(str(file.path))}: \[{rule}\]"):
        copy_into(file, jobs)
    assert not good.any() and not scratch.any()
