"""The weights of a vLLM load read straight from object storage (the ``weights`` option).

vLLM 0.32 accepts an object-storage model (``s3://``, ``gs://``, ``az://``) only with its own
Run:ai load formats (its config check refuses any other ``--load-format``), so fastload takes the
weights' URL as an option instead: the model argument names the config and tokenizer (a local
directory, e.g. made by ``fastload fetch URL DIR``, or a hub name), and
``--model-loader-extra-config '{"weights": "s3://bucket/prefix/"}'`` where the tensors are.

Every file's header is read and validated (and the index checked against the shards) before the
first tensor is handed out. Where the model's parameters are in CPU memory, or under tensor
parallelism, the tensors are then handed out **unread** (:mod:`.remote_slices`): each weight
loader's copy is queued and fetched straight into the parameter by the Rust engine's ranged GETs,
behind the weight loaders (:mod:`.remote_fetches`), each rank fetching only the slices it takes;
nothing is held beside the model. Otherwise (parameters on an accelerator, one rank) the tensors
are read into CPU tensors in batches of :data:`BATCH_BYTES` on a helper thread one batch ahead of
the model's weight loaders, which copy them to the device: at most two batches are held at a
time, never the checkpoint.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.dtypes import torch_shape
from fastload.core.basics.progress import byte_progress
from fastload.core.checkpoint.opened import OpenCheckpoint, StoredTensor
from fastload.core.reads.reading import fill_many
from fastload.core.store import object_store
from fastload.distributed.collective import open_same, read_collectively
from fastload.distributed.group import RankGroup

from .remote_fetches import Fetches, FetchProgress, this_rank
from .remote_slices import unread_tensor
from .weights import Origin, Unread, refusing_unreadable

#: the bytes of one batch of tensors read together (a larger tensor is a batch of its own); the
#: load holds at most two batches beside the model
BATCH_BYTES = 256 << 20

_DONE = object()


def batches(tensors: list[StoredTensor], limit: int = BATCH_BYTES) -> list[list[StoredTensor]]:
    """``tensors`` in checkpoint order (file, then offset), cut into runs of at most ``limit``
    bytes (a tensor larger than that alone)."""
    ordered = sorted(tensors, key=lambda t: (t.file, t.begin))
    out: list[list[StoredTensor]] = []
    size = limit
    for t in ordered:
        if size + t.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.nbytes
    return out


def return_free_memory() -> None:
    """Hands the free memory of malloc's arenas back to the OS (glibc's ``malloc_trim``): the
    batches were allocated on the reader thread and freed one tensor at a time, below malloc's
    mapping threshold, into arenas that keep them, counted in the server's RSS after the load
    (measured on vLLM's 1.1 GiB benchmark model: 2.47 GiB after the load without this, 2.07 GiB
    with it, vLLM's Run:ai streamer 2.11-2.13 GiB). Elsewhere than glibc, nothing."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


class RemoteWeights:
    """The checkpoint at ``url``, opened and validated; iterate for ``(name, tensor)`` pairs in
    checkpoint order, each a CPU tensor of the stored dtype and shape that nothing else holds.
    ``skip``: names not to read (tensors the model does not take); ``batch_bytes``: the size of
    the batches read together (:data:`BATCH_BYTES`)."""

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, object] | None = None,
        threads: int | None = None,
        progress: bool = False,
        skip: Callable[[str], bool] | None = None,
        batch_bytes: int = BATCH_BYTES,
        tp_size: int = 1,
        origins: dict[int, Origin] | None = None,
        unread: bool | None = None,
        queue_fetches: bool = True,
        group: RankGroup | None = None,
    ) -> None:
        self.url = url
        #: the group sharing the fetch (``share_fetch``): each member fetches about 1/N of every
        #: batch and receives the rest; every tensor is read whole, and ``skip`` applies only to
        #: what is handed out (every member reads the same batches)
        self.group = group
        #: bytes this process fetched from the store and received from its peers (shared fetch)
        self.fetched_bytes = 0
        self.received_bytes = 0
        self._turn = 0
        self.threads = threads
        self.progress = progress
        self.batch_bytes = batch_bytes
        #: the tensor-parallel world size: above 1, tensors are handed out unread, recorded in
        #: ``origins`` (the load's, which :class:`~.adopt.CopyWatch` reads)
        self.tp_size = tp_size
        self.origins: dict[int, Origin] = {} if origins is None else origins
        #: whether tensors are handed out unread, their weight loaders' copies fetched straight
        #: into the parameters behind them (default: under tensor parallelism only)
        self.unread = (tp_size > 1 if unread is None else unread) and group is None
        #: the fetches those copies queue (:mod:`.remote_fetches`; ``queue_fetches`` false: made
        #: as each copy is)
        self.fetches = Fetches(threads, defer=queue_fetches)
        if group is None:
            self.checkpoint: OpenCheckpoint = object_store.open_checkpoint(url, storage_options)
        else:  # a store error on one member stops every member, naming it
            self.checkpoint = open_same(
                group,
                lambda: object_store.open_checkpoint(url, storage_options),
                "opening the checkpoint (share_fetch)",
            )
        for t in self.checkpoint.tensors.values():
            where = f"{self.checkpoint.file_path(t)}: tensor {t.name!r}"
            with refusing_unreadable("vLLM's runai_streamer (an s3:// model)"):
                torch_shape(t.st_dtype, list(t.shape), where=where)
                _ = t.dtype  # raises for a dtype torch lacks
        #: the tensors read, in checkpoint order (``skip``: those the model does not take)
        self.tensors = [
            t
            for t in self.checkpoint.tensors.values()
            if skip is None or group is not None or not skip(t.name)
        ]
        self._skip = skip
        #: (URL of the file, tensor name) of the tensor handed out last
        self.current: tuple[str, str] | None = None
        #: tensor bytes handed out
        self.bytes = 0
        self._stop = threading.Event()

    @property
    def fetched(self) -> _core.Progress | None:
        """Under tensor parallelism, the engine's count of the bytes this rank fetched (its
        weight loaders' slices); ``None`` otherwise (every tensor read whole)."""
        return self.fetches.counter if self.tp_size > 1 and self.unread else None

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.checkpoint.files]

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def _read(self, batch: list[StoredTensor], counter: Any) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        work: dict[int, list[tuple[str, torch.Tensor, None]]] = {}
        for t in batch:
            where = f"{self.checkpoint.file_path(t)}: tensor {t.name!r}"
            shape = torch_shape(t.st_dtype, list(t.shape), where=where)
            tensor = torch.empty(shape, dtype=t.dtype)
            work.setdefault(t.file, []).append((t.name, tensor, None))
            out.append((t.name, tensor))
        if self.group is not None:
            fills = [(name, tensor, None) for name, tensor in out]
            done = read_collectively(
                self.group,
                self.checkpoint,
                fills,
                threads=self.threads,
                turn=self._turn,
                progress=counter,
            )
            self._turn += 1
            self.fetched_bytes += done.storage_bytes
            self.received_bytes += done.received_bytes
            return out
        files = self.checkpoint.files
        fill_many([(files[i], items) for i, items in work.items()], self.threads, None, counter)
        return out

    def _unread(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor unread (:func:`~.remote_slices.unread_tensor`): the weight loaders'
        copies fetch what they take, queued behind them (:mod:`.remote_fetches`), drawn by a
        :class:`~.remote_fetches.FetchProgress`; the stream ends when every queued fetch is
        made. A packed sub-byte tensor (its torch shape not its stored one) is read whole now:
        the engine reads no slice of one."""
        slices = self.tp_size > 1
        bar = FetchProgress(
            self.total,
            self.total // self.tp_size,
            self.progress,
            slices=slices,
            rank=this_rank() if slices else None,
        )
        self.fetches.progress = bar
        try:
            yield from self._hand_out_unread()
            self.fetches.drain()
        finally:
            bar.close()

    def _hand_out_unread(self) -> Iterator[tuple[str, torch.Tensor]]:
        for t in self.tensors:
            path = self.checkpoint.file_path(t)
            shape = torch_shape(t.st_dtype, list(t.shape), where=f"{path}: tensor {t.name!r}")
            if list(shape) != list(t.shape):
                self.fetches.ask(t.nbytes)
                [(_, tensor)] = self._read([t], self.fetches.counter)
                self.current = (path, t.name)
                self.bytes += tensor.numel() * tensor.element_size()
                yield t.name, tensor
                continue
            origin = Origin(
                path,
                t.name,
                st_dtype=t.st_dtype,
                shape=tuple(shape),
                remote=Unread(self.checkpoint.files[t.file], fetches=self.fetches),
            )
            tensor = unread_tensor(shape, t.dtype, self.origins, origin)
            self.current = (path, t.name)
            self.bytes += tensor.numel() * tensor.element_size()
            yield t.name, tensor

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.unread:
            yield from self._unread()
            return
        by_name = self.checkpoint.tensors
        # one batch queued and one being read: two batches at most beside the one consumed
        ready: queue.Queue[Any] = queue.Queue(maxsize=1)

        def put(item: Any) -> bool:
            while not self._stop.is_set():
                try:
                    ready.put(item, timeout=0.5)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                with byte_progress(
                    self.total, self.progress, desc="fastload: loading weights"
                ) as counter:
                    for batch in batches(self.tensors, self.batch_bytes):
                        if not put(self._read(batch, counter)):
                            return
                put(_DONE)
            except BaseException as e:  # handed to the consumer, raised there
                put(e)

        reader = threading.Thread(target=produce, name="fastload-remote-weights", daemon=True)
        reader.start()
        try:
            while True:
                item = ready.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                # each tensor let go as it is handed out: once its weight loader copied it, the
                # batch holds it no longer (the batch's memory shrinks as it is consumed)
                item.reverse()
                while item:
                    name, tensor = item.pop()
                    if self.group is not None and self._skip is not None and self._skip(name):
                        continue  # read for the peers' sake, not taken here
                    self.current = (self.checkpoint.file_path(by_name[name]), name)
                    self.bytes += tensor.numel() * tensor.element_size()
                    yield name, tensor
                    del tensor
                del item
        finally:
            self.close()
            while reader.is_alive():  # a batch it could not hand over is dropped
                try:
                    ready.get(timeout=0.1)
                except queue.Empty:
                    pass
            reader.join()
            return_free_memory()

    def close(self) -> None:
        """Stops the helper thread after the batch it is reading (the iterator was dropped),
        and the fetches queued behind the weight loaders after the one being made."""
        self._stop.set()
        self.fetches.stop()


__all__ = ["BATCH_BYTES", "RemoteWeights", "batches"]
