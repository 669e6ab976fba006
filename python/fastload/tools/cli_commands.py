"""The bodies of the ``fastload`` command's own commands: ``inspect``, ``verify``, ``fetch`` and
``convert`` (the parser and the entry point are :mod:`fastload.tools.cli`), and what they share
with the entry: the program's name, the usage error, and the one way anything is shown
(:func:`_emit`: control characters escaped, no URL's query or user-info).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import unicodedata
from pathlib import Path
from typing import Any, TextIO

from fastload.core.basics import json_text
from fastload.core.basics.errors import CheckpointError, FastloadError, RequestError
from fastload.core.basics.redaction import redact, redact_value
from fastload.core.basics.units import format_bytes
from fastload.core.checkpoint.side_files import DEFAULT_PATTERNS

PROG = "fastload"

#: bytes of scratch memory ``verify`` reads tensor data through
VERIFY_CHUNK = 16 << 20


class _UsageError(Exception):
    """A bad command line; reported as one line, exit status 1."""


def _escaped(text: str) -> str:
    """``text`` with control and format characters (ESC, CR, bidi overrides, line separators)
    written as escapes: names and metadata come from the file and must not drive the terminal
    or forge output lines."""
    return "".join(
        c.encode("unicode_escape").decode("ascii")
        if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")
        else c
        for c in text
    )


def _emit(*values: object, file: TextIO | None = None) -> None:
    """``print`` for everything the CLI shows: one line per call, control characters escaped,
    no URL's query or user-info (:mod:`fastload.core.basics.redaction`)."""
    print(_escaped(redact(" ".join(str(v) for v in values))), file=file)


# --------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------


def _describe(path: str, options: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain data (the ``--json`` document)."""
    ckpt = _open(path, options)
    location = ckpt.location
    files = []
    for f in ckpt.files:
        tensors = sorted(f.tensors(), key=lambda t: t[3])
        files.append(
            {
                "path": f.path,
                "file_size": f.file_size,
                "metadata": f.metadata(),
                "tensors": [
                    {
                        "name": name,
                        "dtype": dtype,
                        "shape": list(shape),
                        "bytes": end - begin,
                        "offsets": [begin, end],
                    }
                    for name, dtype, shape, begin, end in tensors
                ],
            }
        )
    by_dtype: dict[str, dict[str, int]] = {}
    for t in ckpt.tensors.values():
        entry = by_dtype.setdefault(t.st_dtype, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += t.nbytes
    return {
        "path": os.fspath(path),
        "index": str(location.index) if location.index is not None else None,
        "index_metadata": location.index_metadata,
        "files": files,
        "tensors": len(ckpt.tensors),
        "bytes": ckpt.total_bytes,
        "parameters": sum(math.prod(t.shape) for t in ckpt.tensors.values()),
        "dtypes": by_dtype,
    }


def _print_description(info: dict[str, Any]) -> None:
    shown = info["index"] or info["files"][0]["path"]
    _emit(
        f"{shown}: {info['tensors']} tensors, {info['parameters']:,} elements, "
        f"{format_bytes(info['bytes'])} in {len(info['files'])} file(s)"
    )
    _emit(
        "dtypes: "
        + ", ".join(
            f"{k} {v['tensors']} ({format_bytes(v['bytes'])})"
            for k, v in sorted(info["dtypes"].items())
        )
    )
    if info["index_metadata"]:
        _emit(f"index metadata: {json.dumps(info['index_metadata'], sort_keys=True)}")
    for f in info["files"]:
        _emit()
        _emit(f"{f['path']} ({format_bytes(f['file_size'])})")
        if f["metadata"]:
            _emit(f"  metadata: {json.dumps(f['metadata'], sort_keys=True)}")
        rows = [
            (_escaped(t["name"]), t["dtype"], str(t["shape"]), format_bytes(t["bytes"]))
            for t in f["tensors"]
        ]
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(_HEADINGS)]
        _emit("  " + "  ".join(h.ljust(w) for h, w in zip(_HEADINGS, widths, strict=True)))
        for row in rows:
            _emit("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


_HEADINGS = ("name", "dtype", "shape", "bytes")


def _open(path: str, options: dict[str, str] | None = None) -> Any:
    """The checkpoint at ``path`` (local, or an object storage URL, read with the store
    ``options``) with every file opened."""
    from fastload.core.checkpoint.files import resolve
    from fastload.core.checkpoint.opened import open_checkpoint
    from fastload.core.store import object_store

    if object_store.is_url(path):
        return object_store.open_checkpoint(path, options)
    return open_checkpoint(resolve(path))


def _storage_options(pairs: list[str] | None) -> dict[str, str] | None:
    """``--storage-option KEY=VALUE`` arguments as ``storage_options``; a malformed one is a
    usage error naming it (the value is not shown: it may be a secret)."""
    if not pairs:
        return None
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise _UsageError(
                f"{PROG}: error: --storage-option takes KEY=VALUE, got one without '=' or key "
                f"(see {PROG} --help)"
            )
        options[key.strip()] = value
    return options


def cmd_inspect(args: argparse.Namespace) -> int:
    info = _describe(args.path, _storage_options(args.storage_option))
    if args.json:
        # every string of the document (the URL asked for, file paths, metadata) redacted as
        # the lines _emit prints are
        json.dump(redact_value(info), sys.stdout, indent=2)
        _emit()
    else:
        _print_description(info)
    return 0


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from fastload.core.checkpoint.files import resolve
    from fastload.core.checkpoint.opened import open_checkpoint
    from fastload.core.reads.reading import validate
    from fastload.core.store.object_store import is_url

    if is_url(args.path):  # every header read and validated (one request each), then every byte
        return _verified(
            _open(args.path, _storage_options(args.storage_option)), args.headers_only, []
        )
    location = resolve(args.path)
    if location.index is not None or Path(args.path).is_dir():
        config = location.directory / "config.json"
        if config.is_file():
            try:
                json_text.loads(config.read_text(encoding="utf-8"), config)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{config}: not valid JSON ({e})") from None
    # Every shard's header on its own first, so a broken shard is named even when the index
    # check would stop at another problem.
    failures: list[str] = []
    for f in location.files:
        try:
            validate(f)
        except FastloadError as e:
            failures.append(str(e))
    if failures:
        more = f" (and {len(failures) - 1} more broken files)" if len(failures) > 1 else ""
        raise CheckpointError(failures[0] + more)
    ckpt = open_checkpoint(location)  # the index against the headers
    stray = []
    if location.index is not None:
        listed = {p.name for p in location.files}
        stray = sorted(
            p.name for p in location.directory.glob("*.safetensors") if p.name not in listed
        )
    return _verified(ckpt, args.headers_only, stray)


def _verified(ckpt: Any, headers_only: bool, stray: list[str]) -> int:
    from fastload.core.reads.reading import read_every_byte

    read = 0
    if not headers_only:
        for f in ckpt.files:
            read += read_every_byte(f, VERIFY_CHUNK)
    location = ckpt.location
    where = location.index or location.files[0]
    checked = "headers checked" if headers_only else f"{format_bytes(read)} read"
    _emit(
        f"OK {where}: {len(ckpt.files)} file(s), {len(ckpt.tensors)} tensors, "
        f"{format_bytes(ckpt.total_bytes)} of tensor data ({checked})"
    )
    if stray:
        _emit(f"note: not in the index, ignored by loaders: {', '.join(stray)}")
    return 0


# --------------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------------


def cmd_fetch(args: argparse.Namespace) -> int:
    from fastload.core.store.object_store import download_files, is_url

    if not is_url(args.url):
        raise RequestError(
            f"{args.url}: not an object storage URL (s3://, gs://, az://, http(s)://)"
        )
    written = download_files(
        args.url,
        args.directory,
        patterns=args.pattern or DEFAULT_PATTERNS,
        storage_options=_storage_options(args.storage_option),
    )
    if not written:
        raise RequestError(
            f"{args.url}: no file there matches {', '.join(args.pattern or DEFAULT_PATTERNS)}"
        )
    for path in written:
        _emit(f"{path} ({format_bytes(path.stat().st_size)})")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from fastload.tools.convert import convert

    done = convert(Path(args.input), Path(args.output), overwrite=args.overwrite)
    _emit(f"wrote {done.target}: {done.tensors} tensors, {format_bytes(done.nbytes)}")
    if done.aliases:
        _emit(
            "tied tensors stored once: "
            + ", ".join(f"{a} = {c}" for a, c in sorted(done.aliases.items()))
        )
    if done.cloned:
        _emit(f"partly overlapping tensors stored separately: {', '.join(done.cloned)}")
    if done.copied:
        _emit(f"copied: {', '.join(done.copied)}")
    return 0
