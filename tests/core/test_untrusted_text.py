"""Text from checkpoint files that fastload parses or shows: JSON nested to exhaust the parser
(in an index, in ``fastload.tied`` metadata, in a header) is refused as ``CheckpointError``, and
``fastload inspect`` never passes a file's control characters to the terminal. Ends with a seeded
random-mutation fuzz of the index and tied-metadata parsers."""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from torch import nn

import fastload
from fastload.core.basics import json_text
from fastload.core.basics.errors import FastloadError
from fastload.core.checkpoint.files import INDEX_FILE, resolve
from fastload.core.checkpoint.opened import open_checkpoint
from fastload.core.model.keys import recorded_aliases
from fastload.safetensors.saving import TIED_KEY
from fastload.tools.cli import main

DEEP = 100_000  # far past Python's recursion limit
SHALLOW_BOMB = json_text.MAX_DEPTH + 1  # parses, but deeper than anything fastload reads


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)


def _sharded(directory: Path, metadata: str = "{}") -> Path:
    directory.mkdir(exist_ok=True)
    state = Pair().state_dict()
    st_save_file(
        {k: v for k, v in state.items() if k.startswith("a.")}, str(directory / "s1.safetensors")
    )
    st_save_file(
        {k: v for k, v in state.items() if k.startswith("b.")}, str(directory / "s2.safetensors")
    )
    weight_map = {k: "s1.safetensors" if k.startswith("a.") else "s2.safetensors" for k in state}
    text = '{"metadata": ' + metadata + ', "weight_map": ' + json.dumps(weight_map) + "}"
    (directory / INDEX_FILE).write_text(text)
    return directory


@pytest.mark.parametrize("depth", [DEEP, SHALLOW_BOMB])
def test_an_index_with_deeply_nested_json_is_a_checkpoint_error(tmp_path: Path, depth: int) -> None:
    directory = _sharded(tmp_path / "ckpt", _nested(depth))
    with pytest.raises(fastload.CheckpointError, match=r"\[json-too-deep\]") as err:
        fastload.from_pretrained(Pair, directory)
    assert str(directory / INDEX_FILE) in str(err.value)


def test_an_index_nested_as_deep_as_allowed_loads(tmp_path: Path) -> None:
    # The index object, "metadata" and "x" take three levels of the 64.
    directory = _sharded(tmp_path / "ckpt", '{"x": ' + _nested(json_text.MAX_DEPTH - 2) + "}")
    assert isinstance(fastload.from_pretrained(Pair, directory), Pair)


@pytest.mark.parametrize("depth", [DEEP, SHALLOW_BOMB])
def test_tied_metadata_with_deeply_nested_json_is_a_checkpoint_error(
    tmp_path: Path, depth: int
) -> None:
    path = tmp_path / "model.safetensors"
    st_save_file(Pair().state_dict(), str(path), metadata={TIED_KEY: _nested(depth)})
    with pytest.raises(fastload.CheckpointError, match=r"\[json-too-deep\]") as err:
        fastload.from_pretrained(Pair, path)
    assert str(path) in str(err.value) and TIED_KEY in str(err.value)


def test_the_cli_reports_a_json_bomb_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _sharded(tmp_path / "ckpt", _nested(DEEP))
    for command in ("inspect", "verify"):
        assert main([command, str(directory)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "[json-too-deep]" in err and "Traceback" not in err, err


def test_a_header_with_deeply_nested_json_is_invalid_json_not_a_crash(tmp_path: Path) -> None:
    # serde_json stops at 128 levels.
    for where in ("metadata", "entry"):
        deep = _nested(DEEP)
        header = (
            '{"__metadata__": {"k": ' + deep + "}}"
            if where == "metadata"
            else '{"t": {"dtype": "F32", "shape": ' + deep + ', "data_offsets": [0, 0]}}'
        )
        path = tmp_path / f"{where}.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header.encode())
        with pytest.raises(fastload.CheckpointError, match=r"\[invalid-json\].*recursion limit"):
            fastload.load_file(path)


# --- fastload inspect and control characters ---------------------------------------------------

HOSTILE = "w\x1b[2J\x1b]0;pwned\x07\rOK forged line\n\u202eevil\x00"


def test_inspect_escapes_control_characters_in_names_and_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.safetensors"
    st_save_file({HOSTILE: torch.zeros(2)}, str(path), metadata={HOSTILE: HOSTILE})
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    for raw in ("\x1b", "\x07", "\r", "\u202e", "\x00"):
        assert raw not in out
    assert "w\\x1b[2J\\x1b]0;pwned\\x07\\rOK forged line\\n\\u202eevil\\x00" in out
    assert not any(line.startswith("OK forged line") for line in out.splitlines())


def test_inspect_escapes_control_characters_in_error_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = json.dumps({HOSTILE: {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}})
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(4))
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err and err.count("\n") == 1, repr(err)
    assert "[unknown-dtype]" in err


# --- seeded random-mutation fuzz of the Python-facing JSON parsers -------------------------------

FUZZ_CASES = 3000
_PIECES = ['{', '}', '[', ']', '"', ':', ',', '\\', 'null', '1e999', '-0', '"a"', '\x00', '\ud800',
           '"weight_map"', '"metadata"', '"../x"', '"/etc/passwd"', '"s1.safetensors"',
           _nested(300), '{"a":' * 200, ' ' * 50]  # fmt: skip


def _mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(text) + 1)
        op = rng.randrange(5)
        strings = list(re.finditer(r'"[^"]*"', text))
        if op == 4 and strings:  # a string value or key replaced by nested arrays (a bomb)
            m = rng.choice(strings)
            bomb = _nested(rng.choice([5, 70, 300, 5000]))
            text = text[: m.start()] + bomb + text[m.end() :]
        elif op == 0:  # insert a piece
            text = text[:at] + rng.choice(_PIECES) + text[at:]
        elif op == 1:  # delete a span
            text = text[:at] + text[at + rng.randint(1, 8) :]
        elif op == 2:  # replace one character
            text = text[:at] + chr(rng.randrange(0x80)) + text[at + 1 :]
        else:  # repeat a span
            span = text[at : at + rng.randint(1, 20)]
            text = text[:at] + span * rng.randint(2, 50) + text[at:]
    return text


def test_mutated_index_files_load_or_give_a_fastload_error(tmp_path: Path) -> None:
    rng = random.Random(20261202)
    directory = _sharded(
        tmp_path / "ckpt", '{"total_size": 48, "fastload.tied": {"c": "a.weight"}}'
    )
    index = directory / INDEX_FILE
    valid = index.read_text()
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(FUZZ_CASES):
        text = _mutate(rng, valid)
        index.write_bytes(text.encode("utf-8", "surrogatepass"))
        try:
            open_checkpoint(resolve(directory))
        except FastloadError:
            outcomes["refused"] += 1
        else:
            outcomes["loaded"] += 1
    # Both outcomes occur: the mutations neither all break the JSON nor all miss it.
    assert outcomes["loaded"] > 0 and outcomes["refused"] > 0, outcomes


def test_mutated_tied_metadata_is_used_ignored_or_refused_never_a_crash() -> None:
    rng = random.Random(1202)
    valid = json.dumps({"lm_head.weight": "embed.weight", "b": "a"})
    outcomes = {"used": 0, "ignored": 0, "refused": 0}
    for _ in range(FUZZ_CASES):
        text = _mutate(rng, valid)
        try:
            aliases = recorded_aliases([("model.safetensors", text)])
        except fastload.CheckpointError:
            outcomes["refused"] += 1
            continue
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items())
        outcomes["used" if aliases else "ignored"] += 1
    assert all(outcomes.values()), outcomes


def test_a_config_json_bomb_is_a_checkpoint_error_when_it_names_the_class(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    st_save_file(Pair().state_dict(), str(directory / "model.safetensors"))
    (directory / "config.json").write_text('{"architectures": ' + _nested(DEEP) + "}")
    with pytest.raises(fastload.CheckpointError, match=r"json-too-deep"):
        fastload.from_pretrained(None, directory)


def test_a_json_bomb_index_beside_a_shard_given_alone_does_not_stop_its_load(
    tmp_path: Path,
) -> None:
    directory = _sharded(tmp_path / "ckpt")
    (directory / INDEX_FILE).write_text('{"weight_map": ' + _nested(DEEP) + "}")
    tensors = fastload.load_file(directory / "s1.safetensors")
    model = fastload.from_pretrained(
        nn.Linear(2, 2), directory / "s1.safetensors", key_map={r"^a\.": ""}
    )
    assert set(tensors) == {"a.weight", "a.bias"} and isinstance(model, nn.Linear)
