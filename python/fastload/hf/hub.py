"""Finding a checkpoint by model id or path: the Hugging Face cache, subfolders, weight variants.

A local directory or file is used as is. Anything else that is a valid repo id
(``"org/name"``) is resolved by ``huggingface_hub``'s ``snapshot_download``: from the cache
(``HF_HOME`` / ``HF_HUB_CACHE`` or ``cache_dir``) when it holds the revision, downloading the
files a load needs otherwise, offline with ``HF_HUB_OFFLINE=1`` or ``local_files_only=True``.
The cache layout is the library's business; nothing here knows it.

``subfolder=`` and ``variant=`` are names inside the snapshot (or the local directory): one that
leads outside it (``..``, an absolute or drive path, a separator in a variant) is refused before
anything is read or downloaded, as huggingface_hub refuses such file names.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any
from urllib.parse import unquote

from fastload.core.basics.errors import (
    CheckpointError,
    FastloadIOError,
    UnsupportedError,
    from_os_error,
)
from fastload.core.checkpoint.files import INDEX_FILE, SINGLE_FILE

_PICKLE_SINGLE = "pytorch_model.bin"
_PICKLE_INDEX = "pytorch_model.bin.index.json"


@dataclass(frozen=True)
class Resolved:
    """A checkpoint found: the directory with ``config.json`` and the weights path for the core
    loader (a directory, a file or an index; or the URL of one in object storage, whose
    ``config.json`` and ``generation_config.json`` were fetched into ``directory``)."""

    directory: Path
    weights: Path | str


def _variant(name: str, variant: str | None) -> str:
    if not variant:
        return name
    # transformers' _add_variant: the variant before the last suffix (model.fp16.safetensors,
    # model.safetensors.index.fp16.json)
    head, _, last = name.rpartition(".")
    return f"{head}.{variant}.{last}"


def _download_patterns(
    subfolder: str, variant: str | None, pickle: bool, remote_code: bool
) -> list[str]:
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    names = ["config.json", "generation_config.json"]
    for single, index in [(SINGLE_FILE, INDEX_FILE)] + (
        [(_PICKLE_SINGLE, _PICKLE_INDEX)] if pickle else []
    ):
        names += [_variant(single, variant), _variant(index, variant)]
        stem = _variant(single, variant).rsplit(".", 1)[0]
        names.append(f"{stem}-*-of-*.{single.rsplit('.', 1)[1]}")
    patterns = [prefix + n for n in names]
    if remote_code:
        patterns.append("*.py")
    return patterns


def _check_subfolder(subfolder: str, where: str) -> None:
    """``FastloadIOError`` unless ``subfolder`` is a relative path inside ``where``.

    The rule is huggingface_hub's for repo file names (``_validate_relative_filename``), checked
    on the name alone (no symlink resolution: snapshot files are links to blobs elsewhere): no
    ``..`` segment (``/`` or ``\\`` separated), nothing absolute, drive-relative or UNC under
    POSIX or Windows rules, no NUL. An ``OSError`` (``FastloadIOError``) as transformers raises
    ``OSError`` for a subfolder the hub refuses.
    """
    segments = subfolder.replace("\\", "/").split("/")
    anchored = any(
        p.drive or p.root
        for p in [PurePosixPath(subfolder), *(PureWindowsPath(s) for s in subfolder.split("/"))]
    )
    if ".." in segments or anchored or "\x00" in subfolder:
        raise FastloadIOError(
            f"subfolder={subfolder!r} leads outside {where}: a subfolder is a relative path "
            "inside it, without '..'"
        )


def _check_variant(variant: str | None, where: str) -> None:
    """``FastloadIOError`` unless ``variant`` is a plain part of a file name (``fp16``)."""
    if variant and any(bad in variant for bad in ("/", "\\", "..", "\x00")):
        raise FastloadIOError(
            f"variant={variant!r} leads outside {where}: a variant is part of a file name "
            "(model.<variant>.safetensors), without '/', '\\' or '..'"
        )


def _probe(check: Callable[[], bool], path: Path, doing: str) -> bool:
    """``check()`` (``path.exists``, ``path.is_file``), an ``OSError`` it raises as the
    ``FastloadIOError`` naming ``path`` (``doing`` says which argument it came from): a name too
    long for the filesystem (``ENAMETOOLONG``) is raised by ``Path.exists()``, not answered
    ``False``."""
    try:
        return check()
    except OSError as e:
        raise from_os_error(e, path, doing) from e


def is_local(name: str | os.PathLike[str]) -> bool:
    """Whether ``name`` is an existing local path; a name too long for any path (a long model id)
    is not one."""
    try:
        return Path(os.fspath(name)).exists()
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            return False
        raise from_os_error(e, name) from e


def snapshot(
    repo_id: str,
    *,
    hub: dict[str, Any],
    subfolder: str = "",
    variant: str | None = None,
    pickle: bool = False,
    remote_code: bool = False,
    patterns: list[str] | None = None,
) -> Path:
    """The local snapshot directory of ``repo_id`` (downloading only what a load needs: a
    transformers model's files, or the ``patterns`` another layer names)."""
    try:
        # Each name from the submodule that defines it: huggingface_hub loads ``utils`` and
        # ``constants`` lazily, so ``huggingface_hub.utils`` fails in a process that has not
        # imported them (transformers does). ``snapshot_download`` is read at call time, so a
        # patched ``huggingface_hub.snapshot_download`` is the one called.
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        raise FastloadIOError(
            f"{repo_id}: no such file or directory (and huggingface_hub, which resolves model ids, "
            "is not installed)"
        ) from None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        longer = " (and longer than a model id may be: 96 characters)" if len(repo_id) > 96 else ""
        raise FastloadIOError(f"{repo_id}: no such file or directory{longer}") from None
    _check_subfolder(subfolder, f"the snapshot of {repo_id}")
    _check_variant(variant, f"the snapshot of {repo_id}")
    options = dict(hub)
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "") in (
        "1",
        "ON",
        "YES",
        "TRUE",
    ):
        options["local_files_only"] = True
    if options.get("revision") is None:
        options.pop("revision", None)
    try:
        path = snapshot_download(
            repo_id,
            allow_patterns=patterns or _download_patterns(subfolder, variant, pickle, remote_code),
            library_name="fastload",
            **options,
        )
    except Exception as e:  # the hub's many error classes: not found, gated, offline, network
        if not options.get("local_files_only"):
            unreachable = _unreachable(e)
            if unreachable is not None:
                raise FastloadIOError(_unreachable_message(repo_id, options, unreachable)) from e
        where = "in the local cache" if options.get("local_files_only") else "on the hub"
        raise FastloadIOError(
            f"{repo_id}: not found {where} ({type(e).__name__}: {_first_line(e)})"
        ) from e
    return Path(path)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _network_error(e: BaseException) -> bool:
    """Whether ``e`` is a failure to talk to a server (no name, no route, refused, timed out,
    TLS, proxy), from the HTTP client huggingface_hub uses or the OS; not an HTTP answer."""
    if isinstance(e, (ConnectionError, TimeoutError, socket.gaierror, socket.herror)):
        return True
    module = type(e).__module__.split(".")[0]
    if module not in ("httpx", "httpcore", "requests", "urllib3"):
        return False
    return not any(c.__name__ in ("HTTPStatusError", "HTTPError") for c in type(e).__mro__)


def _unreachable(e: BaseException) -> BaseException | None:
    """The failure to reach the hub behind ``e``, or None when the hub answered (a missing or
    gated repo, a missing revision). huggingface_hub reports a hub it could not ask, with no
    snapshot in the cache, as ``LocalEntryNotFoundError`` caused by the HTTP client's error."""
    seen: list[BaseException] = []
    cause: BaseException | None = e
    while cause is not None and cause not in seen and len(seen) < 16:
        seen.append(cause)
        if _network_error(cause):
            return cause
        cause = cause.__cause__ or cause.__context__
    if type(e).__name__ == "LocalEntryNotFoundError":
        return seen[-1]  # the hub could not be asked (an HTTP 5xx, a proxy): its last cause
    return None


def _unreachable_message(repo_id: str, options: dict[str, Any], cause: BaseException) -> str:
    from huggingface_hub import constants

    endpoint = options.get("endpoint") or constants.ENDPOINT
    cache = options.get("cache_dir") or constants.HF_HUB_CACHE
    return (
        f"{repo_id}: the Hugging Face hub could not be reached ({endpoint}: "
        f"{type(cause).__name__}: {_first_line(cause)}), and the cache {cache} holds no snapshot "
        "of it. Offline, fastload loads a model downloaded before from the cache (HF_HUB_OFFLINE=1 "
        "or local_files_only=True: without asking the hub), or a local path: a directory with "
        "config.json and the weights, or a .safetensors file"
    )


def resolve_checkpoint(
    name: str | os.PathLike[str],
    *,
    hub: dict[str, Any],
    subfolder: str = "",
    variant: str | None = None,
    use_safetensors: bool | None = None,
    allow_pickle: bool = False,
    remote_code: bool = False,
) -> Resolved:
    """The local directory and weights of ``name``: a local path, or a model id."""
    path = Path(os.fspath(name))
    pickle = use_safetensors is False or (use_safetensors is None and allow_pickle)
    if not _local(path):
        path = snapshot(
            os.fspath(name),
            hub=hub,
            subfolder=subfolder,
            variant=variant,
            pickle=pickle,
            remote_code=remote_code,
        )
    else:
        # A local directory's subfolder is joined as given, as transformers joins it (the caller
        # names local paths anyway; ``subfolder="../other"`` is a sibling directory). A variant
        # is part of a file name everywhere, never a path.
        _check_variant(variant, f"the directory {path}")
        if hub.get("revision") not in (None, "main"):
            raise UnsupportedError(
                f"{path}: revision={hub['revision']!r} applies to model ids, not local directories"
            )
    if subfolder:
        path = path / subfolder
        if not _probe(path.exists, path, f"subfolder={subfolder!r}"):
            raise FastloadIOError(f"{path}: no such file or directory (subfolder={subfolder!r})")
    if _probe(path.is_file, path, "the checkpoint path"):
        return Resolved(path.parent, path)
    return Resolved(path, _weights(path, variant, use_safetensors))


def resolve_remote(
    url: str,
    destination: Path,
    *,
    hub: dict[str, Any],
    subfolder: str = "",
    variant: str | None = None,
    use_safetensors: bool | None = None,
    storage_options: Any = None,
    weights: Sequence[str] = (),
    side_files: Sequence[str] = ("config.json", "generation_config.json"),
) -> Resolved:
    """A checkpoint in object storage (``s3://bucket/prefix/`` ...): its ``side_files`` (those
    that exist) fetched into ``destination``, and the URL the core loader reads the weights from
    (:mod:`fastload.core.store.object_store`). ``subfolder`` and ``variant`` are names under the
    prefix, checked as for a model id; ``revision`` and pickle weights (``use_safetensors=False``)
    are refused. ``weights``: the names the weights may have under the prefix, the first that
    exists taken (another library's names, :mod:`fastload.diffusion`); by default a variant's
    ``model.<variant>.safetensors`` or its index, else whatever the core finds there."""
    from fastload.core.store.object_store import SCHEMES, fetch_files, open_store

    # a URL's path is percent-decoded and its dot segments resolved: "%2e%2e" is ".."
    _check_subfolder(unquote(subfolder), url)
    _check_variant(unquote(variant) if variant else variant, url)
    if hub.get("revision") not in (None, "main"):
        raise UnsupportedError(
            f"{url}: revision={hub['revision']!r} applies to model ids, not to object storage"
        )
    if use_safetensors is False:
        raise UnsupportedError(
            f"{url}: use_safetensors=False asks for pickle weights, which fastload does not read "
            "from object storage"
        )
    assert url.split("://", 1)[0].lower() in SCHEMES
    base = url if not subfolder else f"{url.rstrip('/')}/{subfolder.strip('/')}"
    if subfolder:
        _check_inside(base, url, subfolder, storage_options)
    if base.endswith(".safetensors") or base.endswith(".index.json"):  # the weights themselves
        prefix, url_of_weights = base.rsplit("/", 1)[0] + "/", base
    else:
        prefix, url_of_weights = base.rstrip("/") + "/", base.rstrip("/") + "/"
        names = list(weights)
        if variant and not names:
            names = [_variant(SINGLE_FILE, variant), _variant(INDEX_FILE, variant)]
        if names:
            store = open_store(prefix, storage_options)
            key = store.key.rstrip("/")
            found = next(
                (n for n in names if store.head(f"{key}/{n}" if key else n) is not None), None
            )
            if found is None:
                raise CheckpointError(f"{prefix}: no {' or '.join(names)} there")
            url_of_weights = prefix + found
    fetch_files(prefix, list(side_files), destination, storage_options=storage_options)
    return Resolved(destination, url_of_weights)


def _check_inside(base: str, url: str, subfolder: str, storage_options: Any) -> None:
    """``FastloadIOError`` unless the key ``base`` addresses, as the store's URL parser reads it
    (percent-decoded, dot segments resolved), lies under the key of ``url``: the check of what
    is read, whatever the spelling of ``subfolder``."""
    from fastload.core.store.object_store import open_store

    inside = open_store(url, storage_options).key.strip("/")
    key = open_store(base, storage_options).key.strip("/")
    if inside and not key.startswith(f"{inside}/"):
        raise FastloadIOError(
            f"subfolder={subfolder!r} leads outside {url}: a subfolder is a relative path "
            "inside it, without '..'"
        )


def _local(path: Path) -> bool:
    """Whether ``path`` exists here. A name too long for the filesystem (``ENAMETOOLONG``) is
    neither a local path nor a model id (at most 96 characters): refused naming it, before the
    hub is asked."""
    return _probe(path.exists, path, "neither a local path nor a model id")


def _weights(directory: Path, variant: str | None, use_safetensors: bool | None) -> Path:
    """The weights of a directory for a variant and a safetensors/pickle choice; the directory
    itself when the core's own choice (safetensors first) is the right one."""
    if use_safetensors is False:
        candidates = [_PICKLE_SINGLE, _PICKLE_INDEX]
    elif use_safetensors is True:
        candidates = [SINGLE_FILE, INDEX_FILE]
    else:
        candidates = [SINGLE_FILE, INDEX_FILE, _PICKLE_SINGLE, _PICKLE_INDEX]
    if not variant and use_safetensors is None:
        return directory
    for candidate in candidates:
        f = directory / _variant(candidate, variant)
        if _probe(f.is_file, f, f"variant={variant!r}"):
            return f
    wanted = " or ".join(_variant(c, variant) for c in candidates)
    raise CheckpointError(f"{directory}: no {wanted} in the directory")


def reload_source(
    source: str | os.PathLike[str],
    hub: Mapping[str, Any],
    subfolder: str,
    variant: str | None,
) -> str | os.PathLike[str]:
    """The checkpoint a reload of a model loaded through ``from_pretrained`` reads for
    ``source``: a local path as it is, unless ``hub`` options (``revision``, ``cache_dir``,
    ``token``, ``local_files_only``), ``subfolder`` or ``variant`` ask for a resolution; a model id
    resolved as :func:`resolve_checkpoint` resolves it (the cache first, then the hub). Recorded
    with every load of :mod:`fastload.api` and :mod:`fastload.hf.front` for
    :func:`fastload.reload`."""
    if not hub and not subfolder and variant is None and is_local(source):
        return source
    weights: str | os.PathLike[str] = resolve_checkpoint(
        source, hub=dict(hub), subfolder=subfolder, variant=variant
    ).weights
    return weights
