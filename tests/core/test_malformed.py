"""Malformed safetensors files are refused with a CheckpointError naming the file and the rule.

The corpus comes from ``tests/support/malformed_corpus.py``; every entry point that opens a file
(``load_file``, ``safe_open``, ``_core.validate``, ``from_pretrained``) must refuse every case the
same way, and ``from_pretrained`` must leave a module passed to it unchanged. Sharded checkpoints
add the index's rules (a missing shard, a shard outside the directory, a tensor listed twice). A
file that shrinks on disk after its header was read must give an error, never a SIGBUS.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import malformed_corpus
import pytest
import torch
from safetensors.torch import save_file as st_save_file
from torch import nn

import fastload
from fastload import _core
from fastload.core.basics.errors import CheckpointError

CASES = {case.name: case for case in malformed_corpus.CASES}
RULES = sorted({case.rule for case in malformed_corpus.CASES})

# Cases that only strict reading refuses (the safetensors crate reads them).
STRICT_ONLY = [case.name for case in malformed_corpus.CASES if case.strict_only]
ALWAYS_REFUSED = [case.name for case in malformed_corpus.CASES if not case.strict_only]

# The ways a caller can open a file with fastload; each must refuse a malformed one.
ENTRY_POINTS: dict[str, Callable[[str, bool], object]] = {
    "load_file": lambda path, strict: fastload.load_file(path, strict=strict),
    "load_file-mmap": lambda path, strict: fastload.load_file(
        path, read_mode="mmap", strict=strict
    ),
    "safe_open": lambda path, strict: fastload.safe_open(path, strict=strict),
    "safe_open-mmap": lambda path, strict: fastload.safe_open(path, backend="mmap", strict=strict),
    "validate": lambda path, strict: _core.validate(path, strict=strict),
}

# Every rule of the core's header validation that a file alone can break.
FILE_RULES = {
    "file-too-small",
    "header-too-large",
    "header-past-eof",
    "header-not-utf8",
    "invalid-json",
    "header-not-object",
    "invalid-tensor-entry",
    "unknown-dtype",
    "invalid-shape",
    "invalid-offsets",
    "span-mismatch",
    "offsets-past-eof",
    "duplicate-name",
    "overlap",
    "gap",
    "trailing-bytes",
    "invalid-metadata",
    "not-safetensors",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Case name -> path of the written file."""
    written = malformed_corpus.write_corpus(tmp_path_factory.mktemp("malformed"))
    return {name: path for name, path, _ in written}


def _rule_of(message: str) -> str:
    """The ``[rule-name]`` of an error message (the first bracketed name)."""
    found = re.search(r"\[([a-z0-9-]+)\]", message)
    assert found, f"no [rule] in {message!r}"
    return found.group(1)


def _refusal(entry: str, path: Path, strict: bool = True) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        ENTRY_POINTS[entry](str(path), strict)
    return info.value


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name", CASES)
def test_malformed_file_is_refused_with_a_checkpoint_error_naming_file_and_rule(
    corpus: dict[str, Path], name: str, entry: str
) -> None:
    err = _refusal(entry, corpus[name], strict=CASES[name].strict_only)
    assert type(err) is CheckpointError
    assert isinstance(err, ValueError)
    message = str(err)
    assert message.startswith(f"{corpus[name]}: "), message
    assert f"[{CASES[name].rule}]" in message, message


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_is_reported_by_its_exact_name(corpus: dict[str, Path], rule: str) -> None:
    for case in (c for c in malformed_corpus.CASES if c.rule == rule):
        assert _rule_of(str(_refusal("load_file", corpus[case.name]))) == rule, case.name


@pytest.mark.parametrize("name", STRICT_ONLY)
def test_a_file_only_strict_reading_refuses_loads_by_default_as_safetensors_loads_it(
    corpus: dict[str, Path], name: str
) -> None:
    from safetensors.torch import load_file as st_load_file

    from safetensors import safe_open as st_safe_open

    ours = fastload.load_file(corpus[name])
    theirs = st_load_file(str(corpus[name]))
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with fastload.safe_open(corpus[name]) as f, st_safe_open(str(corpus[name]), "pt") as g:
        assert f.metadata() == g.metadata()


def test_a_config_json_passed_as_weights_is_called_json_not_a_huge_header(
    corpus: dict[str, Path],
) -> None:
    message = str(_refusal("load_file", corpus["json-config-as-weights"]))
    assert "[not-safetensors]" in message and "JSON" in message
    assert "header length" not in message


def test_the_corpus_breaks_every_file_rule_of_the_core() -> None:
    assert set(RULES) == FILE_RULES


def test_the_corpus_script_writes_every_case_and_lists_it(tmp_path: Path) -> None:
    written = malformed_corpus.write_corpus(tmp_path)
    assert [name for name, _, _ in written] == list(CASES)
    assert all(path.is_file() and path.parent == tmp_path for _, path, _ in written)


@pytest.fixture
def shrinkable(tmp_path: Path) -> Path:
    """A 1 MiB two-tensor file that tests cut in half after opening it."""
    path = tmp_path / "shrinks.safetensors"
    tensors = {"first": torch.arange(131072, dtype=torch.float32), "second": torch.ones(131072)}
    st_save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("read_mode", ["pread", "mmap"])
def test_a_file_shrunk_after_its_header_was_read_gives_file_shrunk_not_sigbus(
    shrinkable: Path, read_mode: str
) -> None:
    with fastload.safe_open(shrinkable, read_mode=read_mode) as f:
        os.truncate(shrinkable, shrinkable.stat().st_size // 2)
        with pytest.raises(CheckpointError) as info:
            f.get_tensor("second")
    assert type(info.value) is CheckpointError
    assert str(info.value).startswith(f"{shrinkable}: ")
    assert _rule_of(str(info.value)) == "file-shrunk"


def test_a_file_shrunk_before_a_batch_copy_leaves_every_destination_untouched(
    shrinkable: Path,
) -> None:
    with fastload.safe_open(shrinkable) as f:
        dests = {"first": torch.full((131072,), -1.0), "second": torch.full((131072,), -1.0)}
        os.truncate(shrinkable, 1000)
        with pytest.raises(CheckpointError, match=r"\[file-shrunk\]"):
            f.load_into(dests)
    assert all(bool((t == -1.0).all()) for t in dests.values())


# --- from_pretrained: the same corpus, sharded indexes, and the caller's module -------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = module.state_dict()
    assert list(after) == list(before)
    for name, tensor in before.items():
        assert after[name].device.type != "meta", name
        assert torch.equal(after[name], tensor), name


@pytest.mark.parametrize("name", ALWAYS_REFUSED)
def test_from_pretrained_refuses_the_malformed_file_and_leaves_the_callers_module_unchanged(
    corpus: dict[str, Path], name: str
) -> None:
    module = _model()
    before = _snapshot(module)
    with pytest.raises(CheckpointError) as info:
        fastload.from_pretrained(module, corpus[name])
    assert type(info.value) is CheckpointError
    assert str(info.value).startswith(f"{corpus[name]}: ")
    assert _rule_of(str(info.value)) == CASES[name].rule
    _assert_unchanged(module, before)


@pytest.mark.parametrize("name", ALWAYS_REFUSED)
def test_from_pretrained_refuses_the_malformed_file_when_it_builds_the_model(
    corpus: dict[str, Path], name: str
) -> None:
    with pytest.raises(CheckpointError, match=re.escape(f"[{CASES[name].rule}]")):
        fastload.from_pretrained(_model, corpus[name])


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    """A valid two-shard checkpoint of ``_model()`` in transformers' layout, in a directory of
    its own (so that ``../`` is still inside ``tmp_path``)."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    state = _model().state_dict()
    shards = {
        "model-00001-of-00002.safetensors": ["0.weight", "0.bias"],
        "model-00002-of-00002.safetensors": ["2.weight", "2.bias"],
    }
    for shard, names in shards.items():
        st_save_file(
            {n: state[n] for n in names}, str(directory / shard), metadata={"format": "pt"}
        )
    _write_index(directory, {n: shard for shard, names in shards.items() for n in names})
    return directory


def _write_index(directory: Path, weight_map: dict[str, str] | str) -> Path:
    """Writes the index; a str ``weight_map`` is inserted as raw JSON (duplicate keys)."""
    body = weight_map if isinstance(weight_map, str) else json.dumps(weight_map)
    index = directory / "model.safetensors.index.json"
    index.write_text('{"metadata": {"total_size": 0}, "weight_map": ' + body + "}", "utf-8")
    return index


def test_a_valid_sharded_checkpoint_loads(sharded: Path) -> None:
    loaded = fastload.from_pretrained(_model, sharded, strict=True)
    assert all(torch.equal(t, _model().state_dict()[n]) for n, t in loaded.state_dict().items())


def _index_cases(directory: Path) -> dict[str, tuple[dict[str, str] | str, str]]:
    """Index case -> (weight_map, rule): each breaks one rule of a sharded checkpoint."""
    good = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    outside = directory.parent / "outside.safetensors"
    outside.write_bytes((directory / "model-00002-of-00002.safetensors").read_bytes())
    return {
        "missing-shard": ({**good, "2.bias": "model-00003-of-00003.safetensors"}, "missing-shard"),
        "parent-directory": (
            {**good, "2.weight": "../outside.safetensors", "2.bias": "../outside.safetensors"},
            "shard-outside-directory",
        ),
        "absolute-path": (
            {**good, "2.weight": str(outside), "2.bias": str(outside)},
            "shard-outside-directory",
        ),
        "tensor-listed-twice": (
            json.dumps(good)[:-1] + ', "0.bias": "model-00002-of-00002.safetensors"}',
            "duplicate-tensor",
        ),
    }


INDEX_CASES = ["missing-shard", "parent-directory", "absolute-path", "tensor-listed-twice"]


@pytest.mark.parametrize("case", INDEX_CASES)
def test_from_pretrained_refuses_a_broken_index_naming_it_and_the_rule(
    sharded: Path, case: str
) -> None:
    weight_map, rule = _index_cases(sharded)[case]
    index = _write_index(sharded, weight_map)
    module = _model()
    before = _snapshot(module)
    with pytest.raises(CheckpointError) as info:
        fastload.from_pretrained(module, sharded)
    assert type(info.value) is CheckpointError
    assert str(index) in str(info.value)
    assert _rule_of(str(info.value)) == rule
    _assert_unchanged(module, before)


def test_a_tensor_stored_in_two_shards_is_refused(sharded: Path) -> None:
    # The index lists 0.bias once, but the second shard's header holds it too.
    state = _model().state_dict()
    second = sharded / "model-00002-of-00002.safetensors"
    st_save_file({n: state[n] for n in ("2.weight", "2.bias", "0.bias")}, str(second))
    with pytest.raises(CheckpointError, match=r"\[duplicate-tensor\]") as info:
        fastload.from_pretrained(_model, sharded)
    assert "0.bias" in str(info.value)


def test_a_shard_that_shrinks_during_the_load_leaves_the_callers_module_unchanged(
    sharded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first shard is copied before the second one is cut: the failure comes after some
    # tensors were already read, and none of them may reach the module.
    from fastload.core.reads import reading as reader

    real_fill = reader.fill
    calls: list[str] = []

    def fill_then_shrink_the_next(file: _core.SafetensorsFile, *args: object, **kw: object) -> int:
        calls.append(file.path)
        if len(calls) == 2:
            os.truncate(file.path, 16)
        return real_fill(file, *args, **kw)

    monkeypatch.setattr(reader, "fill", fill_then_shrink_the_next)
    module = _model()
    before = _snapshot(module)
    with pytest.raises(CheckpointError, match=r"\[file-shrunk\]"):
        fastload.from_pretrained(module, sharded, mmap="copy")  # the copy path reads shard by shard
    assert len(calls) == 2, "the load did not read the shards one by one through reader.fill"
    _assert_unchanged(module, before)


def test_an_empty_tensor_with_dimensions_torch_can_index_loads_with_its_shape(
    tmp_path: Path,
) -> None:
    header = json.dumps({"e": {"dtype": "F32", "shape": [0, 2**31, 2**31], "data_offsets": [0, 0]}})
    path = tmp_path / "e.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    assert fastload.load_file(path)["e"].shape == (0, 2**31, 2**31)
