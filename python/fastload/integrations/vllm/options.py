"""The options of vLLM's ``fastload`` load format, read from ``--model-loader-extra-config``.

vLLM hands every loader its ``model_loader_extra_config`` (the JSON of
``--model-loader-extra-config``, or ``LLM(model_loader_extra_config={...})``); this module checks
it once, where it enters, and turns it into one frozen record. Unknown keys are refused (a typo
must not silently load another way), and so are vLLM's own keys of other load formats, with what
to use instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fastload.core.basics.errors import RequestError
from fastload.core.basics.threads import MAX_THREADS
from fastload.core.basics.units import parse_bytes
from fastload.core.store.object_store import is_url
from fastload.core.store.store_config import check_storage_options
from fastload.distributed.rendezvous import parse_address

#: the load format's name, as users pass it to ``--load-format``
LOAD_FORMAT = "fastload"

#: ``mmap`` values: as ``fastload.from_pretrained(mmap=...)``
MMAP_MODES = ("auto", "shared", "copy")

#: ``share_fetch`` values
SHARE_SCOPES = ("node", "world")
#: the port where the processes sharing a fetch meet, unless ``share_fetch_address`` says
SHARE_PORT = 29651
#: the longest ``share_fetch_timeout``, in seconds (a year): a longer one cannot be waited for
#: (Python's and torch's time spans overflow)
MAX_SHARE_TIMEOUT = 365 * 24 * 3600.0

#: what each key means, for the error that lists them
KEYS = {
    "mmap": "'auto' (default: views of the file mapping on local filesystems, copies on network"
    " and FUSE ones), 'shared' (views wherever the file is) or 'copy' (always private copies)",
    "threads": f"read threads, 1..{MAX_THREADS} (default: the engine's)",
    "read_ahead": "true (default) reads the checkpoint ahead of the model's weight loaders",
    "share_weights": "true (default) lets a parameter kept exactly as stored be a view of the "
    "checkpoint's page cache instead of a copy (copy-on-write; needs mmap views)",
    "progress": "true/false: the progress bar (default: vLLM's use_tqdm_on_load)",
    "enable_weights_track": "vLLM's check that every parameter was loaded (default: vLLM's)",
    "staged": "'auto' (default: weights bound for an accelerator are read through fastload's "
    "staged ring into device memory ahead of the weight loaders, which then copy device to "
    "device; one rank only), true (also for CPU models: private copies through the ring) or "
    "false (host tensors, the weight loaders copy them to the device)",
    "window": "device memory the staged weights take ahead of the weight loaders at most "
    "(default '1GiB'; an int or a size such as '512MiB')",
    "weights": "an object storage URL (s3://, gs://, az://, http(s)://) of the checkpoint to "
    "read the weights from (the model argument then names only the config and tokenizer)",
    "storage_options": "the object store's options for 'weights' (as fastload.from_pretrained's "
    "storage_options; credentials otherwise from the standard environment and files)",
    "share_fetch": "'node' or 'world': the processes loading this checkpoint from 'weights' (the "
    "ranks of this engine and of other replicas) share one fetch: each fetches about 1/N of it "
    "from the store and receives the rest from the others ('node': the processes on this "
    "machine, meeting on 127.0.0.1; 'world': on every machine, meeting at share_fetch_address)",
    "share_fetch_address": "'host:port' where the processes sharing a fetch meet (default: "
    f"127.0.0.1:{SHARE_PORT} for 'node', vLLM's data_parallel_master_ip:{SHARE_PORT} for "
    "'world')",
    "share_fetch_peers": "how many processes share the fetch (default: this engine's ranks times "
    "its data-parallel replicas, on this node for 'node')",
    "share_fetch_timeout": "seconds a process waits for the others to arrive (default 300)",
    "share_fetch_node": "the machine this process is on, for 'world': each chunk crosses to "
    "each machine once, then goes to its processes (default: the host name; under Kubernetes, "
    "where each pod has its own, the node's name)",
    "skip_unchanged": "true (default): a reload (collective_rpc('reload_weights')) neither reads "
    "nor copies the layers whose checkpoint tensors carry the same fastload digests in the "
    "checkpoint the engine holds and the new one; false reads every tensor",
}

#: vLLM's keys for its own load formats, refused here with what fastload does instead
_OTHER_FORMATS = {
    "enable_multithread_load": "fastload always reads on several threads ('threads' sets how many)",
    "num_threads": "use 'threads'",
}


@dataclass(frozen=True)
class VllmLoadOptions:
    """The validated options of one ``--load-format fastload`` load."""

    mmap: str = "auto"
    threads: int | None = None
    read_ahead: bool = True
    share_weights: bool = True
    progress: bool | None = None
    enable_weights_track: bool | None = None
    #: "auto", True or False: weights staged into the model's device memory (see KEYS)
    staged: bool | str = "auto"
    #: bytes of device memory the staged weights take ahead of the weight loaders at most
    window: int = 1 << 30
    #: the object storage URL the weights are read from, if not from the model's files
    weights: str | None = None
    storage_options: Mapping[str, str] | None = None
    #: a reload skips the layers whose tensors' digests are unchanged
    skip_unchanged: bool = True
    #: "node" or "world": the fetch shared with the other processes loading ``weights``
    share_fetch: str | None = None
    #: where they meet ("host:port"; None: the scope's default)
    share_fetch_address: str | None = None
    #: how many they are (None: the engine's ranks times its data-parallel replicas)
    share_fetch_peers: int | None = None
    #: seconds one waits for the others to arrive
    share_fetch_timeout: float = 300.0
    #: the machine this process is on (None: its host name)
    share_fetch_node: str | None = None


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise RequestError(
            f"--model-loader-extra-config: {key!r} must be true or false, got {value!r}"
        )
    return value


def parse_options(
    extra_config: object, safetensors_load_strategy: object = None
) -> VllmLoadOptions:
    """The options in ``extra_config`` (vLLM's ``model_loader_extra_config``), checked.

    Raises :class:`~fastload.core.basics.errors.RequestError` for anything but a JSON object of the
    keys in :data:`KEYS` with values of their types, and for ``--safetensors-load-strategy`` (a
    strategy of vLLM's own safetensors reader: fastload reads its own way)."""
    if extra_config is None:
        extra_config = {}
    if not isinstance(extra_config, Mapping):
        raise RequestError(
            "--model-loader-extra-config must be a JSON object for --load-format "
            f"{LOAD_FORMAT}, got {type(extra_config).__name__}"
        )
    if safetensors_load_strategy not in (None, "lazy"):
        raise RequestError(
            f"--safetensors-load-strategy={safetensors_load_strategy} is a strategy of vLLM's own "
            f"safetensors reader; --load-format {LOAD_FORMAT} reads with fastload's engine (ahead "
            "of the weight loaders, in parallel): leave it unset"
        )
    known = ", ".join(f"{k!r} ({v})" for k, v in KEYS.items())
    for key in extra_config:
        if key in _OTHER_FORMATS:
            raise RequestError(
                f"--model-loader-extra-config: {key!r} is an option of vLLM's default loader, "
                f"not of --load-format {LOAD_FORMAT}: {_OTHER_FORMATS[key]}. Known keys: {known}"
            )
        if key not in KEYS:
            raise RequestError(
                f"--model-loader-extra-config: unknown key {key!r} for --load-format "
                f"{LOAD_FORMAT}. Known keys: {known}"
            )
    mmap = extra_config.get("mmap", "auto")
    if mmap not in MMAP_MODES:
        raise RequestError(
            f"--model-loader-extra-config: 'mmap' must be one of "
            f"{', '.join(map(repr, MMAP_MODES))}, got {mmap!r}"
        )
    threads = extra_config.get("threads")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS
    ):
        raise RequestError(
            f"--model-loader-extra-config: 'threads' must be an integer from 1 to {MAX_THREADS}, "
            f"got {threads!r}"
        )
    progress = extra_config.get("progress")
    track = extra_config.get("enable_weights_track")
    weights = extra_config.get("weights")
    if weights is not None and not is_url(weights):
        raise RequestError(
            "--model-loader-extra-config: 'weights' must be an object storage URL (s3://, gs://, "
            f"az://, http(s)://), got {weights!r}"
        )
    try:
        storage = check_storage_options(
            extra_config.get("storage_options"), "--model-loader-extra-config"
        )
    except TypeError as e:
        raise RequestError(str(e)) from None
    if storage is not None and weights is None:
        raise RequestError(
            "--model-loader-extra-config: 'storage_options' applies to 'weights', which is not set"
        )
    staged = extra_config.get("staged", "auto")
    if staged != "auto" and not isinstance(staged, bool):
        raise RequestError(
            f"--model-loader-extra-config: 'staged' must be 'auto', true or false, got {staged!r}"
        )
    window = parse_bytes(
        extra_config.get("window", 1 << 30),
        where="--model-loader-extra-config: 'window'",
        positive=True,
    )
    share = _share_options(extra_config, weights)
    return VllmLoadOptions(
        **share,
        staged=staged,
        window=window,
        mmap=mmap,
        threads=threads,
        read_ahead=_bool("read_ahead", extra_config.get("read_ahead", True)),
        share_weights=_bool("share_weights", extra_config.get("share_weights", True)),
        progress=None if progress is None else _bool("progress", progress),
        enable_weights_track=None if track is None else _bool("enable_weights_track", track),
        weights=weights,
        storage_options=storage,
        skip_unchanged=_bool("skip_unchanged", extra_config.get("skip_unchanged", True)),
    )


def _share_options(extra_config: Mapping[str, object], weights: object) -> dict[str, object]:
    """The ``share_fetch*`` keys, checked."""
    scope = extra_config.get("share_fetch")
    others = [k for k in extra_config if k.startswith("share_fetch_")]
    if scope is None:
        if others:
            raise RequestError(
                f"--model-loader-extra-config: {others[0]!r} applies to 'share_fetch', which is "
                "not set"
            )
        return {}
    if scope not in SHARE_SCOPES:
        raise RequestError(
            f"--model-loader-extra-config: 'share_fetch' must be 'node' or 'world', got {scope!r}"
        )
    if weights is None:
        raise RequestError(
            "--model-loader-extra-config: 'share_fetch' shares a fetch from object storage: "
            "set 'weights' to the checkpoint's URL (local files are read by each process from "
            "its own disk)"
        )
    address = extra_config.get("share_fetch_address")
    if address is not None:
        parse_address(address, "--model-loader-extra-config: 'share_fetch_address'")
    peers = extra_config.get("share_fetch_peers")
    if peers is not None and (isinstance(peers, bool) or not isinstance(peers, int) or peers < 1):
        raise RequestError(
            "--model-loader-extra-config: 'share_fetch_peers' must be a positive integer, got "
            f"{peers!r}"
        )
    timeout = extra_config.get("share_fetch_timeout", 300.0)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= MAX_SHARE_TIMEOUT
    ):
        raise RequestError(
            "--model-loader-extra-config: 'share_fetch_timeout' must be a positive number of "
            f"seconds, at most {MAX_SHARE_TIMEOUT:g} (a year), got {timeout!r}"
        )
    node = extra_config.get("share_fetch_node")
    if node is not None and (not isinstance(node, str) or not node):
        raise RequestError(
            "--model-loader-extra-config: 'share_fetch_node' must be a non-empty string, got "
            f"{node!r}"
        )
    return {
        "share_fetch_node": node,
        "share_fetch": scope,
        "share_fetch_address": address,
        "share_fetch_peers": peers,
        "share_fetch_timeout": float(timeout),
    }


__all__ = ["KEYS", "LOAD_FORMAT", "VllmLoadOptions", "parse_options"]
