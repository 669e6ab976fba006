"""Type stub of the Rust extension ``fastload._core``."""

import builtins
from collections.abc import Callable
from os import PathLike

MAX_HEADER_LEN: int
CHUNK: int
MAX_THREADS: int
#: alignment of direct reads into staging slots (offset, length, address)
STAGE_ALIGN: int

# (name, data pointer, byte length, safetensors dtype, selection)
# selection: None (whole tensor), [start, stop] (flat elements) or [dim, start, stop] (a slice).
#: (name, destination address, its byte length, dtype wanted, selection): ``None`` the whole
#: tensor, ``[start, stop]`` a flat range of elements, ``[dim, start, stop]`` a range of one
#: dimension, ``[first row, rows, row length, start, stop]`` elements ``[start, stop)`` of each of
#: ``rows`` rows of ``row length`` elements from ``first row`` (the flattened tensor as rows)
_Job = tuple[str, int, int, str, list[int] | None]

class SafetensorsFile:
    """An open safetensors file whose header has been read and validated.

    Raises ``fastload.CheckpointError`` naming the file and the broken rule for a malformed file,
    ``fastload.FastloadIOError`` (``FileNotFoundError`` ... with ``errno`` set) when the file
    cannot be read. ``strict`` also refuses an unknown tensor-entry field and a null
    ``__metadata__``, which are read by default as the safetensors crate reads them.
    """

    def __init__(
        self,
        path: str | PathLike[str],
        mode: str = "pread",
        dir_fd: int | None = None,
        name: str | PathLike[str] | None = None,
        *,
        strict: bool = False,
    ) -> None:
        """Open ``path``; with ``dir_fd``, open ``name`` relative to that open directory
        (``openat``) and show ``path`` in messages. Anything but a regular file is refused
        (``CheckpointError [not-regular-file]``) without blocking."""
    @staticmethod
    def from_bytes(label: str, data: bytes, *, strict: bool = False) -> SafetensorsFile:
        """A whole file held in memory; ``label`` stands for the path in messages."""
    @property
    def path(self) -> str:
        """The path it was opened with (the URL of an object in object storage)."""
    @property
    def mode(self) -> str:
        """The read path: "pread", "mmap", or "ranged-get" (an object in object storage)."""
    @property
    def remote(self) -> bool:
        """Whether the bytes come from object storage (read with ranged GETs)."""
    @property
    def version(self) -> tuple[int, str | None, str | None] | None:
        """``(size, etag, last_modified)`` of the object version every read asks for (an object
        in object storage; the date in RFC 3339, None where the store gave none); None for a
        local file."""
    @property
    def file_size(self) -> int: ...
    @property
    def data_start(self) -> int: ...
    def identity(self) -> tuple[int, int] | None:
        """(st_dev, st_ino) of the file as opened; None for a file held in memory."""
    def filesystem(self) -> tuple[str, bool] | None:
        """(name, local) of the file's filesystem ("ext4", "nfs", "fuse", ...); local is False
        for network, cluster and FUSE filesystems. None for a file held in memory."""
    def read_ahead(
        self,
        address: int,
        offset: int,
        length: int,
        threads: int | None = None,
        cached: bool = False,
        cold: bool = False,
    ) -> int:
        """Read the uncached pages (every page with ``cached``) of [address, address + length), a
        mapping of this file whose byte ``offset`` is at ``address``, into the mapping in
        parallel: uncached parts (every part with ``cold``, for a range found mostly uncached) are
        read through the page cache (``sendfile`` to /dev/null), then ``MADV_POPULATE_READ``; the
        bytes populated. An unmapped range raises FastloadIOError."""
    def read_through(
        self, offset: int | None = None, length: int | None = None, threads: int | None = None
    ) -> int:
        """Read the file's bytes [offset, offset + length) (default: the tensor data; clipped to
        the file) into the page cache with ``threads`` parallel readers (``sendfile`` to
        /dev/null, a descriptor each), mapping nothing; the bytes read (0 for a file held in
        memory)."""
    def mostly_uncached(self, offset: int | None = None, length: int | None = None) -> bool:
        """Whether most of the file's bytes [offset, offset + length) (default: the tensor data)
        are not in the page cache (``cachestat``, of 32 evenly spread windows of a range over
        8 MiB); False for a file held in memory or where the kernel cannot say."""
    def fileno(self) -> int | None:
        """The open file descriptor (None for a file held in memory)."""
    def keys(self) -> list[str]: ...
    def metadata(self) -> dict[str, str] | None: ...
    def tensors(self) -> list[tuple[str, str, list[int], int, int]]: ...
    def info(self, name: str) -> tuple[str, list[int], int, int]: ...
    def _copy_into(
        self, jobs: list[_Job], threads: int | None = None, progress: Progress | None = None
    ) -> int:
        """Validate every job, then fill the destinations in parallel with the GIL released.

        Private: the jobs name raw addresses. Call ``fastload.core.basics.engine.copy_into``, which
        takes tensors and derives each address and length from one.

        ``threads``: 1..MAX_THREADS (``RequestError`` otherwise). A long copy, or one given
        ``progress``, runs signal handlers (Ctrl-C: ``KeyboardInterrupt``) and ``progress``'s
        callback every few tens of milliseconds. A file rewritten in place during the copy is
        ``CheckpointError [file-changed]``. The caller must keep every destination alive and
        untouched until this returns.
        """
    def __len__(self) -> int: ...
    def __contains__(self, name: str) -> bool: ...

class Progress:
    """Bytes written so far by the copies given this object, and a flag that cancels them
    between pieces (``LoadCancelledError``). ``callback(done)`` runs with the GIL held after each
    task of about ``CHUNK`` bytes and every few tens of milliseconds of a copy; an exception from
    it cancels the copy and is raised."""

    def __init__(self, callback: Callable[[int], object] | None = None) -> None: ...
    @property
    def done(self) -> int: ...
    @property
    def cancelled(self) -> bool: ...
    def cancel(self) -> None: ...
    def add(self, nbytes: int) -> None:
        """Count bytes copied outside the engine (pickle files, staged copies to a device) and
        call the callback with the new total (an exception from it cancels the copies)."""

class ObjectStore:
    """One bucket (container, host) in object storage and the client that reads it (the
    ``object_store`` crate), from ``url`` (``s3://bucket/prefix``, ``gs://...``, ``az://...``,
    ``https://host/path``), the environment (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``), ``defaults``
    read from configuration files (used where the environment is silent) and ``options`` (which
    win; ``max_retries``, ``retry_timeout``, ``retry_init_backoff``, ``retry_max_backoff``,
    ``retry_backoff_base`` set the retry policy). An ``http://`` endpoint allows plain HTTP.

    Failures raise ``FileNotFoundError`` (no such object or bucket), ``PermissionError``
    (denied), ``FastloadIOError`` (unreachable or failing after the retries),
    ``CheckpointError`` (an object that changed since it was opened, a malformed header) or
    ``RequestError`` (a URL or option the client cannot use), all naming the URL.
    """

    def __init__(
        self,
        url: str,
        options: dict[str, str] | None = None,
        defaults: dict[str, str] | None = None,
    ) -> None: ...
    @property
    def url(self) -> str:
        """The URL of the store's root (``s3://bucket``)."""
    @property
    def key(self) -> str:
        """The key inside the store that the URL it was made from addresses."""
    def url_of(self, key: str) -> str: ...
    def head(self, key: str) -> tuple[int, str | None] | None:
        """``(size, etag)`` of object ``key``, or None if there is no such object."""
    def get(self, key: str, max_bytes: int) -> bytes:
        """The whole of object ``key``; refused unread when larger than ``max_bytes``."""
    def _read_into(self, key: str, offset: int, address: int, length: int) -> int:
        """Fill ``length`` bytes at ``address`` with those of ``key`` at ``offset`` (one ranged
        GET, GIL released: the raw transport). Private: call
        ``fastload.core.store.object_store.read_into``, which takes the address from a tensor."""
    # builtins.list: inside the class body, after this method, ``list`` names the method
    def list(self, prefix: str) -> builtins.list[tuple[str, int]]:
        """``(key, size)`` of the objects directly under ``prefix``."""
    def open(
        self, keys: builtins.list[str], *, strict: bool = False
    ) -> builtins.list[SafetensorsFile]:
        """Objects ``keys`` as safetensors files (mode "ranged-get"), opened in parallel: each
        one's header is read (8 bytes, then the header) and validated before anything else."""

class StagedRead:
    """A staged read of one file (``fastload.core.reads.streaming``): the tensors' bytes laid out in
    fills of ``slot_bytes``, read ahead by the engine's own threads into the slots at the raw
    addresses ``slots`` (kept alive by the caller until ``close()`` or ``finish()`` returns), cold
    ranges past the page cache when ``direct``. Private to ``fastload.core.reads.streaming``."""

    def __init__(
        self,
        file: SafetensorsFile,
        spans: list[tuple[str, tuple[int, int] | None]],
        slots: list[int],
        slot_bytes: int,
        *,
        threads: int | None = None,
        direct: bool = True,
        chunk: int | None = None,
        progress: Progress | None = None,
    ) -> None: ...
    def fills(self) -> list[list[tuple[int, int, int, int]]]:
        """Per fill, ``(span index, start, stop, slot offset)`` of each piece it holds."""
    def wait(self, k: int) -> int:
        """Waits for fill ``k`` (Ctrl-C honoured); returns its slot. A failed read raises."""
    def release(self, k: int) -> None:
        """Gives fill ``k``'s slot back (in order)."""
    def finish(self) -> tuple[int, int]:
        """Joins the readers, checks the file is unchanged; ``(direct, cached)`` bytes read."""
    def close(self) -> None:
        """Stops and joins the readers; idempotent."""
    @property
    def stats(self) -> tuple[int, int]: ...
    @property
    def slots(self) -> int: ...

def _copy_files(
    items: list[tuple[SafetensorsFile, list[_Job]]],
    threads: int | None = None,
    progress: Progress | None = None,
) -> int:
    """``SafetensorsFile._copy_into`` for several files in one copy (their tasks on one pool).
    Private: call ``fastload.core.basics.engine.copy_files``."""

def write_file(
    path: str | PathLike[str],
    tensors: list[tuple[str, str, list[int], int, int]],
    metadata: dict[str, str] | None = None,
    threads: int | None = None,
) -> int:
    """Write (name, dtype, shape, pointer, nbytes) tensors to a new file, fsynced; bytes written."""

def serialize(
    tensors: list[tuple[str, str, list[int], int, int]],
    metadata: dict[str, str] | None = None,
) -> bytes:
    """The bytes of a safetensors file of (name, dtype, shape, pointer, nbytes) tensors."""

def validate(path: str | PathLike[str], *, strict: bool = False) -> int: ...
def dtype_bits() -> dict[str, int]: ...
def default_threads() -> int: ...
def redact_urls(text: str) -> str: ...
