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

Here: the parser, the delegated commands and the entry point; the commands' bodies are
:mod:`fastload.tools.cli_commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from fastload.core.basics.errors import FastloadError, RequestError
from fastload.core.checkpoint.side_files import DEFAULT_PATTERNS, WEIGHT_PATTERNS
from fastload.tools.cli_commands import (
    PROG,
    _emit,
    _UsageError,
    cmd_convert,
    cmd_fetch,
    cmd_inspect,
    cmd_verify,
)


def _usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    raise _UsageError(f"{parser.prog}: error: {message} (see {parser.prog} --help)")


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
