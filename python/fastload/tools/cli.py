"""The ``fastload`` command line.

* ``fastload inspect FILE|DIR [--json]``: tensors, dtypes, shapes, bytes and metadata;
* ``fastload verify FILE|DIR``: validates every shard's header, the index, and reads every byte;
* ``fastload convert IN OUT_DIR``: a pickle checkpoint (``.bin``/``.pt``, or a sharded
  ``pytorch_model.bin.index.json``) to safetensors, loaded with ``torch.load(weights_only=True)``
  and with tied (shared) tensors stored once;
* ``fastload bench``: the performance harness (:mod:`fastload.tools.bench.run`);
* ``fastload demo``: the all-MiniLM-L6-v2 demonstration (:mod:`fastload.tools.demo`).

Bad input (a malformed file, a missing path, a bad argument) exits with status 1 and one line on
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from fastload.core import json_text
from fastload.core.errors import CheckpointError, FastloadError, RequestError
from fastload.core.units import format_bytes

PROG = "fastload"

#: bytes of scratch memory ``verify`` reads tensor data through
VERIFY_CHUNK = 16 << 20

#: files next to a pickle checkpoint that ``convert`` copies, so the output loads as a model
COMPANION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "preprocessor_config.json",
)


class _UsageError(Exception):
    """A bad command line; reported as one line, exit status 1."""


def _usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    raise _UsageError(f"{parser.prog}: error: {message} (see {parser.prog} --help)")


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
    """``print`` for everything the CLI shows: one line per call, control characters escaped."""
    print(_escaped(" ".join(str(v) for v in values)), file=file)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _usage_error(self, message)


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    """Delegated commands build their own parsers: make their errors one line as well."""
    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _usage_error  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------


def _describe(path: str) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain data (the ``--json`` document)."""
    from fastload.core.checkpoint import open_checkpoint, resolve

    location = resolve(path)
    ckpt = open_checkpoint(location)
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


def cmd_inspect(args: argparse.Namespace) -> int:
    info = _describe(args.path)
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        _emit()
    else:
        _print_description(info)
    return 0


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from fastload.core.checkpoint import open_checkpoint, resolve
    from fastload.core.reading import read_every_byte, validate

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
    read = 0
    if not args.headers_only:
        for f in ckpt.files:
            read += read_every_byte(f, VERIFY_CHUNK)
    stray = []
    if location.index is not None:
        listed = {p.name for p in location.files}
        stray = sorted(
            p.name for p in location.directory.glob("*.safetensors") if p.name not in listed
        )
    where = location.index or location.files[0]
    checked = "headers checked" if args.headers_only else f"{format_bytes(read)} read"
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


def _pickle_sources(path: Path) -> list[Path]:
    """The pickle files of a checkpoint: one file, a directory, or a ``.bin.index.json``,
    resolved (and its index checked) exactly as ``from_pretrained(allow_pickle=True)`` does."""
    from fastload.core.checkpoint import resolve
    from fastload.core.pickle_file import is_pickle

    files = list(resolve(path, allow_pickle=True).files)
    if not all(is_pickle(f) for f in files):
        raise CheckpointError(f"{path}: already holds a safetensors checkpoint; nothing to convert")
    return files


def _load_pickle(path: Path) -> dict[str, Any]:
    from fastload.core.pickle_file import load_state_dict

    # Training checkpoints often wrap the weights: {"state_dict": {...}, "epoch": 3, ...}.
    return load_state_dict(path, unwrap=True)


def dedupe_shared(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Tensors sharing memory, made storable.

    Returns ``(tensors, aliases, cloned)``: views identical to an earlier tensor (same storage,
    offset, shape, strides and dtype: a tie) are dropped and recorded as ``{alias: canonical}``,
    the canonical name being the first in the state dict's order; tensors that only partly overlap
    another (a slice of a fused weight) are cloned, their names in ``cloned``.
    """
    import torch

    from fastload.safetensors.saving import byte_span

    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in state.items():
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            t.dtype,
            tuple(t.shape),
            t.stride(),
        )
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        if t.numel():
            seen[key] = name
        out[name] = t
    spans: dict[tuple[Any, int], list[tuple[int, int, str]]] = {}
    for name, t in out.items():
        if not t.numel():
            continue
        start, end = byte_span(t)
        spans.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((start, end, name))
    cloned: list[str] = []
    for group in spans.values():
        group.sort(key=lambda span: (span[0], -span[1]))  # the widest first: slices get copied
        reach = -1
        for start, end, name in group:
            if start < reach:
                out[name] = out[name].clone()
                cloned.append(name)
            reach = max(reach, end)
    return out, aliases, cloned


def cmd_convert(args: argparse.Namespace) -> int:
    from fastload.safetensors.saving import TIED_KEY, save_file

    source = Path(args.input)
    out_dir = Path(args.output)
    target = out_dir / "model.safetensors"
    if out_dir.exists() and not out_dir.is_dir():
        raise RequestError(f"{out_dir}: exists and is not a directory")
    if target.exists() and not args.overwrite:
        raise RequestError(f"{target}: already exists (pass --overwrite to replace it)")
    files = _pickle_sources(source)
    state: dict[str, Any] = {}
    for f in files:
        part = _load_pickle(f)
        clash = sorted(set(part) & set(state))
        if clash:
            raise CheckpointError(f"{f}: tensor {clash[0]!r} is also in another shard")
        state.update(part)
    tensors, aliases, cloned = dedupe_shared(state)
    metadata = {"format": "pt"}
    if aliases:
        metadata[TIED_KEY] = json.dumps(aliases, sort_keys=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, target, metadata=metadata)
    copied = []
    for name in COMPANION_FILES:
        companion = files[0].parent / name
        if companion.is_file() and not (out_dir / name).exists():
            shutil.copyfile(companion, out_dir / name)
            copied.append(name)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    _emit(f"wrote {target}: {len(tensors)} tensors, {format_bytes(nbytes)}")
    if aliases:
        _emit(
            "tied tensors stored once: "
            + ", ".join(f"{a} = {c}" for a, c in sorted(aliases.items()))
        )
    if cloned:
        _emit(f"partly overlapping tensors stored separately: {', '.join(cloned)}")
    if copied:
        _emit(f"copied: {', '.join(copied)}")
    return 0


# --------------------------------------------------------------------------------------------
# delegated commands
# --------------------------------------------------------------------------------------------


def _bench(argv: list[str]) -> int:
    from fastload.tools.bench import run as bench

    return int(bench.main(argv) or 0)


def _demo(argv: list[str]) -> int:
    from fastload.tools import demo

    main = getattr(demo, "main", None)
    if main is None:
        raise RequestError("this fastload build has no demo")
    return int(main(argv) or 0)


_DELEGATED: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "bench": (_bench, "run the loading benchmark (fastload bench --help for its options)"),
    "demo": (_demo, "load all-MiniLM-L6-v2 with fastload and transformers and compare"),
}


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="fastload: Rust-accelerated safetensors loading.")
    from fastload import __version__

    parser.add_argument("--version", action="version", version=f"fastload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "inspect",
        help="list a checkpoint's tensors, dtypes, shapes, bytes and metadata",
        description="List the tensors (dtype, shape, bytes) and metadata of a safetensors file, "
        "a checkpoint directory or a sharded index.",
    )
    p.add_argument("path", metavar="FILE|DIR", help="a .safetensors file, directory or index")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="validate every shard, the index, and read all tensor data",
        description="Validate a checkpoint: every shard's header (all safetensors rules), the "
        "index against the shards, then read every byte of tensor data.",
    )
    p.add_argument("path", metavar="FILE|DIR", help="a .safetensors file, directory or index")
    p.add_argument(
        "--headers-only", action="store_true", help="skip reading the tensor data (faster)"
    )
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser(
        "convert",
        help="convert a pickle checkpoint (.bin/.pt) to safetensors",
        description="Convert a pickle checkpoint to OUT_DIR/model.safetensors. It is loaded with "
        "torch.load(weights_only=True), which runs no code from the file; tensors that share "
        "memory (tied weights) are stored once. config.json and tokenizer files next to it are "
        "copied.",
    )
    p.add_argument("input", metavar="IN", help="a .bin/.pt file, its directory, or a .bin index")
    p.add_argument("output", metavar="OUT_DIR", help="the directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing model.safetensors")
    p.set_defaults(run=cmd_convert)

    for name, (_, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fastload`` script; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list and args_list[0] in _DELEGATED:
            run, _ = _DELEGATED[args_list[0]]
            with _one_line_usage_errors():
                return run(args_list[1:])
        args = build_parser().parse_args(args_list)
        return int(args.run(args))
    except _UsageError as e:
        return _fail(str(e), prefix="")
    except FastloadError as e:
        return _fail(str(e))
    except OSError as e:  # a file the OS refused outside fastload's own checks
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        return _fail(f"{where}{e.strerror or e}")
    except ImportError as e:
        return _fail(f"{PROG}: a dependency is missing: {e}")
    except KeyboardInterrupt:
        return _fail("interrupted", status=130)


def _fail(message: str, status: int = 1, prefix: str = f"{PROG}: error: ") -> int:
    # one line: messages from lower layers may contain newlines
    line = " ".join(message.split())
    _emit(f"{prefix}{line}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
