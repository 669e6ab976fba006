"""The ``fastload`` command line.

* ``fastload inspect FILE|DIR|URL [--json]``: tensors, dtypes, shapes, bytes and metadata;
* ``fastload verify FILE|DIR|URL``: validates every shard's header, the index, and reads every
  byte (of an object storage checkpoint too);
* ``fastload convert IN OUT_DIR``: a pickle checkpoint to safetensors
  (:mod:`fastload.tools.convert`);
* ``fastload fetch URL DIR``: the config and tokenizer files of an object storage prefix (never
  the weights), e.g. for ``vllm serve DIR --load-format fastload`` with the weights read from
  ``URL``;
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
import sys
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from fastload.core import json_text
from fastload.core.errors import CheckpointError, FastloadError, RequestError
from fastload.core.redaction import redact, redact_value
from fastload.core.side_files import DEFAULT_PATTERNS, WEIGHT_PATTERNS
from fastload.core.units import format_bytes

PROG = "fastload"

#: bytes of scratch memory ``verify`` reads tensor data through
VERIFY_CHUNK = 16 << 20


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
    """``print`` for everything the CLI shows: one line per call, control characters escaped,
    no URL's query or user-info (:mod:`fastload.core.redaction`)."""
    print(_escaped(redact(" ".join(str(v) for v in values))), file=file)


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
    from fastload.core import object_store
    from fastload.core.checkpoint import open_checkpoint, resolve

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
    from fastload.core.checkpoint import open_checkpoint, resolve
    from fastload.core.object_store import is_url
    from fastload.core.reading import validate

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
    from fastload.core.reading import read_every_byte

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
    from fastload.core.object_store import download_files, is_url

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


def _add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="an object storage option, as storage_options= of a load (repeatable): timeouts "
        "(timeout, connect_timeout, read_timeout), retries (max_retries, retry_timeout), "
        "aws_endpoint, aws_region ...",
    )


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
    p.add_argument(
        "path", metavar="FILE|DIR|URL", help="a .safetensors file, directory, index or URL"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    _add_storage_option(p)
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="validate every shard, the index, and read all tensor data",
        description="Validate a checkpoint: every shard's header (all safetensors rules), the "
        "index against the shards, then read every byte of tensor data.",
    )
    p.add_argument(
        "path", metavar="FILE|DIR|URL", help="a .safetensors file, directory, index or URL"
    )
    p.add_argument(
        "--headers-only", action="store_true", help="skip reading the tensor data (faster)"
    )
    _add_storage_option(p)
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

    p = sub.add_parser(
        "fetch",
        help="copy the config and tokenizer files of an object storage prefix to a directory",
        description="Copy the small files directly under an object storage prefix (config, "
        f"tokenizer, chat template: {' '.join(DEFAULT_PATTERNS)} by default) into DIR, never a "
        f"weight file ({' '.join(WEIGHT_PATTERNS)}, in any letter case, whatever --pattern "
        "says), all or none of them, e.g. for vllm serve DIR --load-format fastload "
        '--model-loader-extra-config \'{"weights": "URL"}\'. Credentials and endpoints come '
        "from the standard environment (AWS_*, AWS_ENDPOINT_URL...) and files.",
    )
    p.add_argument("url", metavar="URL", help="s3://bucket/prefix/ (or gs://, az://, https://)")
    p.add_argument("directory", metavar="DIR", help="the local directory to write into")
    p.add_argument(
        "--pattern", action="append", metavar="GLOB", help="fetch these names instead (repeatable)"
    )
    _add_storage_option(p)
    p.set_defaults(run=cmd_fetch)

    for name, (_, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


class _Terminated(BaseException):
    """SIGTERM during a command: raised like Ctrl-C's ``KeyboardInterrupt``, so that what the
    command was writing is removed on the way out (a fetch's temporaries); exit status 143."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` while the command runs, where it would otherwise end
    the process on the spot (a handler or an ignore set by whoever started it is kept)."""
    import signal
    import threading

    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fastload`` script; returns the exit status (130 after Ctrl-C, 143
    after SIGTERM)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        with _sigterm_raises():
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
    except _Terminated:
        return _fail("terminated", status=143)


def _fail(message: str, status: int = 1, prefix: str = f"{PROG}: error: ") -> int:
    # one line: messages from lower layers may contain newlines
    line = " ".join(message.split())
    _emit(f"{prefix}{line}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
