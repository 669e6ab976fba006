"""Coverage-guided fuzz targets (atheris, libFuzzer) for the Python-facing parsers of untrusted
text: a sharded checkpoint's index JSON and the ``fastload.tied`` metadata a saved file carries.

Each target accepts any bytes; the contract is that a parser answers with a result or a
``FastloadError`` (``CheckpointError`` for bad text), never another exception, a hang or a crash.
Run one (``pip install -e '.[fuzz]'``)::

    python tests/fuzz/fuzz_json.py index tests/fuzz/corpus/index -max_total_time=300
    python tests/fuzz/fuzz_json.py tied tests/fuzz/corpus/tied -max_total_time=300

libFuzzer adds the inputs that reach new code to the corpus folder;
``tests/core/test_fuzz_corpus.py`` replays every corpus file through the same targets on each test
run, as ``cargo test`` does for the Rust targets in ``rust/fuzz``.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":
    import atheris  # the fuzz extra; the targets themselves need only fastload

    # coverage feedback from fastload's own code (instrumenting torch too is slow and useless)
    with atheris.instrument_imports(include=["fastload"]):
        import fastload.core.checkpoint.files  # noqa: F401 - imported here to be instrumented
        import fastload.core.model.keys  # noqa: F401
        import fastload.safetensors.saving  # noqa: F401

import torch  # noqa: E402

from fastload.core.basics.errors import FastloadError  # noqa: E402
from fastload.core.checkpoint.files import INDEX_FILE, resolve
from fastload.core.checkpoint.opened import open_checkpoint  # noqa: E402
from fastload.core.model.keys import recorded_aliases  # noqa: E402
from fastload.safetensors.saving import save_file  # noqa: E402

_SHARDS: Path | None = None


def _checkpoint() -> Path:
    """A directory with two small shards (``s1``: ``a.*``, ``s2``: ``b.*``); its index is the
    fuzzed input."""
    global _SHARDS
    if _SHARDS is None:
        _SHARDS = Path(tempfile.mkdtemp(prefix="fastload-fuzz-"))
        for shard, prefix in (("s1", "a"), ("s2", "b")):
            tensors = {f"{prefix}.weight": torch.ones(2, 2), f"{prefix}.bias": torch.ones(2)}
            save_file(tensors, _SHARDS / f"{shard}.safetensors")
    return _SHARDS


def index(data: bytes) -> None:
    """Resolves and opens a checkpoint whose index file holds ``data``."""
    directory = _checkpoint()
    (directory / INDEX_FILE).write_bytes(data)
    try:
        open_checkpoint(resolve(directory))
    except FastloadError:
        pass


def tied(data: bytes) -> None:
    """Reads ``data`` as the ``fastload.tied`` metadata of a saved file."""
    text = data.decode("utf-8", "surrogateescape")
    try:
        aliases = recorded_aliases([("model.safetensors", text)])
    except FastloadError:
        return
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise AssertionError(f"tied aliases must map names to names, got {aliases!r}")


TARGETS: dict[str, Callable[[bytes], None]] = {"index": index, "tied": tied}


def main(argv: list[str]) -> None:
    import atheris

    if len(argv) < 2 or argv[1] not in TARGETS:
        raise SystemExit(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [libFuzzer options]")
    atheris.Setup([argv[0], *argv[2:]], TARGETS[argv[1]])
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
