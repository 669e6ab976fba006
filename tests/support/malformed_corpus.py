"""A corpus of malformed safetensors files, one per way a single file can be broken.

Each case is written from bytes built here (no safetensors writer involved, so the corpus can hold
what no writer would produce) and names the rule of the Rust core's validation that must reject
it: the ``[rule-name]`` that ``fastload.CheckpointError`` messages carry. A case marked
``strict_only`` is a file the safetensors crate reads (an unknown entry field, null metadata):
fastload reads it by default too and refuses it only when asked to read strictly
(``strict=True``).

Importable (``write_corpus(directory)`` -> ``[(name, path, rule)]``) and runnable as a script::

    python tests/support/malformed_corpus.py OUT_DIR
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Shared pieces: two F32 tensors of 2 x 3 and 4 elements, laid out back to back.
_A = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
_B = {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}
_DATA = bytes(range(40))


def _raw(header: bytes, data: bytes = b"", prefix: int | None = None) -> bytes:
    """8-byte little-endian header length (``prefix`` overrides it), header, data."""
    length = len(header) if prefix is None else prefix
    return struct.pack("<Q", length) + header + data


def _file(entries: str | dict[str, object], data: bytes = _DATA) -> bytes:
    """A file from a header given as a dict (serialized) or as raw JSON text."""
    text = entries if isinstance(entries, str) else json.dumps(entries)
    return _raw(text.encode(), data)


_VALID = _file({"__metadata__": {"format": "pt"}, "a": _A, "b": _B})
_VALID_JSON_LEN = struct.unpack("<Q", _VALID[:8])[0]


@dataclass(frozen=True)
class Case:
    """One malformed file: its name, the rule that must reject it, and its bytes."""

    name: str
    rule: str
    build: Callable[[], bytes]
    description: str
    strict_only: bool = False


CASES: list[Case] = [
    Case("empty-file", "file-too-small", lambda: b"", "0 bytes"),
    Case("shorter-than-8-bytes", "file-too-small", lambda: b"\x10\x00\x00", "3 bytes"),
    Case(
        "truncated-in-header",
        "header-past-eof",
        lambda: _VALID[: 8 + _VALID_JSON_LEN // 2],
        "a valid file cut in the middle of its JSON header",
    ),
    Case(
        "truncated-in-data",
        "offsets-past-eof",
        lambda: _VALID[: 8 + _VALID_JSON_LEN + 30],
        "a valid file cut in the middle of its second tensor",
    ),
    Case(
        "header-length-larger-than-file",
        "header-past-eof",
        lambda: _raw(_VALID[8:], prefix=len(_VALID) + 100),
        "header length 100 bytes past the end of the file",
    ),
    Case(
        "header-length-near-2-64",
        "header-too-large",
        lambda: _raw(_VALID[8:], prefix=2**64 - 8),
        "header length 2**64 - 8",
    ),
    Case(
        "header-not-utf8",
        "header-not-utf8",
        lambda: _raw(b'{"\xff\xfe":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'),
        "invalid UTF-8 in a tensor name",
    ),
    Case("header-not-json", "invalid-json", lambda: _file('{"a": {"dtype": "F32",'), "cut JSON"),
    Case("header-json-array", "header-not-object", lambda: _file("[1, 2, 3]", b""), "a list"),
    Case("header-json-string", "header-not-object", lambda: _file('"weights"', b""), "a string"),
    Case(
        "unknown-dtype",
        "unknown-dtype",
        lambda: _file({"a": {**_A, "dtype": "F128"}, "b": _B}),
        "dtype F128",
    ),
    Case(
        "negative-shape",
        "invalid-shape",
        lambda: _file({"a": {**_A, "shape": [-2, 3]}, "b": _B}),
        "shape [-2, 3]",
    ),
    Case(
        "non-integer-shape",
        "invalid-shape",
        lambda: _file({"a": {**_A, "shape": [2.5, 3]}, "b": _B}),
        "shape [2.5, 3]",
    ),
    Case(
        "string-shape",
        "invalid-shape",
        lambda: _file({"a": {**_A, "shape": ["2", 3]}, "b": _B}),
        'shape ["2", 3]',
    ),
    Case(
        "shape-overflows",
        "invalid-shape",
        lambda: _file({"a": {**_A, "shape": [2**32, 2**32, 2]}, "b": _B}),
        "an element count past 2**64",
    ),
    Case(
        "empty-shape-with-a-dimension-past-i64",
        "invalid-shape",
        lambda: _file(
            {
                "e": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]},
                "b": {**_B, "data_offsets": [0, 16]},
            },
            _DATA[:16],
        ),
        "shape [0, 2**63]: no tensor has a dimension past 2**63 - 1",
    ),
    Case(
        "empty-shape-whose-strides-overflow",
        "invalid-shape",
        lambda: _file(
            {
                "e": {"dtype": "F32", "shape": [0, 2**40, 2**40], "data_offsets": [0, 0]},
                "b": {**_B, "data_offsets": [0, 16]},
            },
            _DATA[:16],
        ),
        "shape [0, 2**40, 2**40]: 0 elements, but a stride of 2**80",
    ),
    Case(
        "packed-dtype-not-whole-bytes",
        "invalid-shape",
        lambda: _file({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"\0\0"),
        "3 elements of 4 bits",
    ),
    Case(
        "shape-offset-disagreement",
        "span-mismatch",
        lambda: _file({"a": {**_A, "shape": [2, 2]}, "b": _B}),
        "shape [2, 2] of F32 (16 bytes) over a 24-byte span",
    ),
    Case(
        "overlapping-tensors",
        "overlap",
        lambda: _file(
            {"a": _A, "b": {**_B, "data_offsets": [20, 36]}, "c": {**_B, "data_offsets": [36, 52]}},
            bytes(52),
        ),
        "b starts inside a",
    ),
    Case(
        "hole-between-tensors",
        "gap",
        lambda: _file({"a": _A, "b": {**_B, "data_offsets": [28, 44]}}, bytes(44)),
        "4 bytes no tensor covers between a and b",
    ),
    Case(
        "offsets-past-end-of-file",
        "offsets-past-eof",
        lambda: _file({"a": _A, "b": {**_B, "data_offsets": [24, 40]}}, _DATA[:32]),
        "b ends 8 bytes past the end of the file",
    ),
    Case(
        "duplicate-names",
        "duplicate-name",
        lambda: _file('{"a": ' + json.dumps(_A) + ', "a": ' + json.dumps(_B) + "}", _DATA),
        "tensor a listed twice",
    ),
    Case(
        "metadata-non-string-value",
        "invalid-metadata",
        lambda: _file({"__metadata__": {"format": "pt", "step": 3}, "a": _A, "b": _B}),
        "__metadata__ value 3",
    ),
    Case(
        "metadata-not-an-object",
        "invalid-metadata",
        lambda: _file({"__metadata__": ["format", "pt"], "a": _A, "b": _B}),
        "__metadata__ is a list",
    ),
    Case(
        "missing-field",
        "invalid-tensor-entry",
        lambda: _file({"a": {"dtype": "F32", "shape": [2, 3]}, "b": _B}),
        "no data_offsets",
    ),
    Case(
        "unknown-field",
        "invalid-tensor-entry",
        lambda: _file({"a": {**_A, "device": "cuda"}, "b": _B}),
        "an extra 'device' field",
        strict_only=True,
    ),
    Case(
        "metadata-null",
        "invalid-metadata",
        lambda: _file({"__metadata__": None, "a": _A, "b": _B}),
        "__metadata__ is null",
        strict_only=True,
    ),
    Case(
        "json-config-as-weights",
        "not-safetensors",
        lambda: json.dumps({"architectures": ["BertModel"], "hidden_size": 32}).encode(),
        "a config.json passed as the weights file",
    ),
    Case(
        "zip-checkpoint-as-weights",
        "not-safetensors",
        lambda: b"PK\x03\x04" + bytes(60),
        "a torch.save zip archive passed as a safetensors file",
    ),
    Case(
        "entry-not-an-object",
        "invalid-tensor-entry",
        lambda: _file({"a": [1, 2, 3], "b": {**_B, "data_offsets": [0, 16]}}, _DATA[:16]),
        "a tensor entry that is a list",
    ),
    Case(
        "begin-after-end",
        "invalid-offsets",
        lambda: _file({"a": {**_A, "data_offsets": [24, 0]}, "b": _B}),
        "data_offsets [24, 0]",
    ),
    Case(
        "trailing-bytes",
        "trailing-bytes",
        lambda: _file({"a": _A, "b": _B}, _DATA + b"junk"),
        "4 bytes after the last tensor",
    ),
]


def write_corpus(directory: str | Path) -> list[tuple[str, Path, str]]:
    """Writes every case into ``directory``; returns ``[(case name, path, expected rule)]``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for case in CASES:
        path = out / f"{case.name}.safetensors"
        path.write_bytes(case.build())
        written.append((case.name, path, case.rule))
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for name, path, rule in write_corpus(argv[0]):
        print(f"{rule:22} {name:34} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
