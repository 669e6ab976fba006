"""The ``(name, tensor)`` stream that vLLM's ``model.load_weights`` consumes, read by fastload.

:class:`CheckpointWeights` opens every file of the checkpoint before the first tensor is handed
out (each safetensors header validated by the Rust engine: offsets inside the file, contiguous and
non-overlapping data, known dtypes; the index checked against the shards), so a bad file stops the
load before any parameter is touched, with the file and the tensor named.

Tensors are then handed out in file order:

* as views of a private (copy-on-write) mapping of the file (:class:`fastload.core.memory.sharing.
  SharedMapping`) where the file may be mapped (local filesystems; ``mmap`` option), the files
  read into the page cache ahead of the weight loaders by helper threads (parallel reads, GIL
  released), never more than the memory budget's read-ahead room ahead of them
  (:mod:`fastload.core.memory.budget`). What the weight loaders copy out of a view the engine copies
  from the file, and a view a parameter keeps becomes that parameter
  (:mod:`fastload.integrations.vllm.adopt`). Under tensor parallelism nothing is read ahead
  blindly: the weight loaders' own slices are read when they copy them, so each rank reads its
  share;
* as private copies made by the engine otherwise (network filesystems, ``mmap='copy'``), on a
  helper thread ahead of the weight loaders, within the budget;
* ``.bin``/``.pt`` files through fastload's pickle reader (``torch.load(weights_only=True)``,
  mapped);
* for a model on an accelerator (one rank; the ``staged`` option), as device tensors filled
  through fastload's staged ring ahead of the weight loaders, within the ``window`` of device
  memory (:mod:`fastload.integrations.vllm.staged`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fastload import _core
from fastload.core.basics.dtypes import to_torch, torch_shape
from fastload.core.basics.engine import copy_into
from fastload.core.basics.errors import CheckpointError, UnsupportedError
from fastload.core.basics.progress import bar_wanted, binary_unit
from fastload.core.checkpoint.digests import file_digests
from fastload.core.checkpoint.pickle_file import is_pickle, load_state_dict
from fastload.core.memory.sharing import SharedMapping, file_sharing
from fastload.core.memory.staging import StagingPool

from .options import VllmLoadOptions
from .read_ahead import _MADV_RANDOM, ReadAhead, _File, _madvise
from .staged import staged_tensors

if TYPE_CHECKING:
    from .remote_fetches import Fetches


def natural_key(path: str) -> list[Any]:
    """The order vLLM reads shards in (``model-00002-...`` before ``model-00010-...``)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def check_index(index: str, folder: str) -> None:
    """Refuses an index that lists a shard missing from ``folder``, naming the index, the shard and
    a tensor it should hold (vLLM's own check names the file only)."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a readable safetensors index ({e})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no 'weight_map' object mapping tensor names to shards")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not os.path.isfile(os.path.join(folder, shard)):
            raise CheckpointError(
                f"{index}: tensor {name!r} is in shard {shard!r}, which is missing "
                f"(looked for {os.path.join(folder, str(shard))}) [missing-shard]"
            )


@contextmanager
def refusing_unreadable(instead: str) -> Iterator[None]:
    """An ``UnsupportedError`` raised inside (a stored dtype or shape torch has no tensor for)
    says that the load format refuses the checkpoint, and what serves it instead."""
    try:
        yield
    except UnsupportedError as e:
        raise UnsupportedError(
            f"{e}; --load-format fastload refuses the checkpoint rather than load it "
            f"differently: serve it with {instead}"
        ) from None


@dataclass
class Unread:
    """Where the bytes of a tensor handed out unread are (tensor parallelism from object
    storage, :mod:`.remote_slices`): its file in object storage; ``filled``: fetched whole since."""

    file: _core.SafetensorsFile
    filled: bool = False
    #: where a weight loader's copy of it is queued to be fetched behind the weight loaders
    #: (:mod:`.remote_fetches`); ``None``: fetched when copied
    fetches: Fetches | None = None


@dataclass(frozen=True)
class Origin:
    """Where a handed-out tensor came from: for messages, and for copying it (or a slice of it)
    with the engine."""

    path: str
    name: str
    #: the mapping the tensor is a view of (``None``: a copy, or a pickle file's tensor)
    mapping: SharedMapping | None = None
    #: the stored dtype (a safetensors name) and shape, where ``mapping`` or ``remote`` is set
    st_dtype: str = ""
    shape: tuple[int, ...] = ()
    #: an unread tensor of a file in object storage (tensor parallelism: :mod:`.remote_slices`)
    remote: Unread | None = None


class CheckpointWeights(ReadAhead):
    """Every file of a checkpoint, opened and validated; iterate for ``(name, tensor)`` pairs.

    ``tp_size``: the tensor-parallel world size (ranks then read only the slices their weight
    loaders take). ``progress``: draw a bar (the caller decides: rank 0 of a load that asks).
    ``weight_map``: the index's tensor -> shard table, checked against the shards. ``device``:
    where the model's parameters are (an accelerator's stages the weights there)."""

    def __init__(
        self,
        files: list[str],
        options: VllmLoadOptions,
        *,
        tp_size: int = 1,
        progress: bool = False,
        index: str | None = None,
        origins: dict[int, Origin] | None = None,
        device: torch.device | None = None,
        deferred: Fetches | None = None,
    ) -> None:
        self.options = options
        #: the engine's copies the weight loaders queue (:class:`~.adopt.CopyWatch`): the stream
        #: ends once they are made, so the load's end (and vLLM's timing of it) includes them
        self.deferred = deferred
        self.device = device if device is not None else torch.device("cpu")
        #: whether tensors are staged into the device's memory (see the ``staged`` option)
        self.staged = options.staged is True or (
            options.staged == "auto" and self.device.type != "cpu" and tp_size == 1
        )
        self._pool: StagingPool | None = None
        self.tp_size = tp_size
        self.progress = progress
        #: (path, tensor name) of the tensor handed out last
        self.current: tuple[str, str] | None = None
        #: storage address -> origin of every tensor handed out (shared by a load's streams)
        self.origins: dict[int, Origin] = {} if origins is None else origins
        #: views of the mapping handed out, and tensor bytes handed out in all
        self.views = 0
        self.bytes = 0
        self._files: list[_File] = []
        for path in sorted(files, key=natural_key):
            if is_pickle(path):
                self._files.append(_File(path, None))
                continue
            st = _core.SafetensorsFile(path, "pread")  # validates; names the file and the tensor
            entries = sorted(st.tensors(), key=lambda t: t[3])
            for name, st_dtype, shape, _b, _e in entries:
                with refusing_unreadable("vLLM's own loader (--load-format auto)"):
                    to_torch(st_dtype, where=f"{path}: tensor {name!r}")
                    torch_shape(st_dtype, shape, where=f"{path}: tensor {name!r}")
            self._files.append(_File(path, st, entries=entries))
        if index is not None:
            self._check_index_against_shards(index)
        for f in self._files:
            if self.staged:
                break  # the ring reads the files itself
            if f.st is not None and options.mmap != "copy" and file_sharing(f.st, options.mmap)[0]:
                f.mapping = SharedMapping(f.st)
                if tp_size > 1:
                    # Under TP a rank takes slices; a fault must read only the page it needs,
                    # not the kernel's read-around window (the other ranks' bytes).
                    _madvise(f.mapping.address, f.st.file_size, _MADV_RANDOM)
        self.total = sum(e[4] - e[3] for f in self._files for e in (f.entries or ()))
        self._consumed = 0
        self._wake = threading.Condition()
        self._stop = False
        self._reader: threading.Thread | None = None

    def _check_index_against_shards(self, index: str) -> None:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map") or {}
        by_name = {os.path.basename(f.path): f for f in self._files}
        for name, shard in weight_map.items():
            f = by_name.get(os.path.basename(str(shard)))
            if f is None or f.st is None:
                continue
            if name not in f.st:
                raise CheckpointError(
                    f"{index}: tensor {name!r} is listed in shard {shard!r}, but {f.path} does "
                    "not hold it [index-mismatch]"
                )

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self._files]

    def catalog(self) -> dict[str, tuple[str, tuple[int, ...], str]] | None:
        """``{name: (stored dtype, shape, path)}`` of every tensor of the safetensors files
        (``None`` where a file is a pickle, whose tensors are known only once read)."""
        if any(f.st is None for f in self._files):
            return None
        return {e[0]: (e[1], tuple(e[2]), f.path) for f in self._files for e in f.entries or ()}

    def digests(self) -> dict[str, str]:
        """The per-tensor digests the files record (:mod:`fastload.core.checkpoint.digests`)."""
        out: dict[str, str] = {}
        for f in self._files:
            if f.st is not None:
                names = {e[0] for e in f.entries or ()}
                out.update((k, v) for k, v in file_digests(f.st.metadata()).items() if k in names)
        return out

    def leave_out(self, names: set[str]) -> None:
        """Neither reads nor hands out the tensors ``names`` (a reload's unchanged tensors);
        before iterating."""
        for f in self._files:
            if f.entries is not None:
                f.entries = [e for e in f.entries if e[0] not in names]
        self.total = sum(e[4] - e[3] for f in self._files for e in (f.entries or ()))

    @property
    def mappings(self) -> list[SharedMapping]:
        return [f.mapping for f in self._files if f.mapping is not None]

    # -- handing tensors out ---------------------------------------------------------------------

    def _tensors(self, f: _File) -> Iterator[tuple[str, torch.Tensor, Origin]]:
        """``f``'s tensors in file order, each with where it came from."""
        if f.st is None:
            state = load_state_dict(f.path)
            for name in list(state):
                yield name, state.pop(name), Origin(f.path, name)
            return
        if self.staged:
            if self._pool is None:
                self._pool = StagingPool()
            staged = staged_tensors(
                f.st,
                f.entries or [],
                self.device,
                window=self.options.window,
                pool=self._pool,
                threads=self.options.threads,
                stopped=lambda: self._stop,
            )
            for name, tensor in staged:
                yield name, tensor, Origin(f.path, name)
            return
        if f.mapping is None:
            for name, tensor in self._copies(f):
                yield name, tensor, Origin(f.path, name)
            return
        for name, st_dtype, header_shape, _begin, _end in f.entries or ():
            # the tensor torch makes of the bytes (a packed dtype's header counts values)
            shape = torch_shape(st_dtype, header_shape, where=f"{f.path}: tensor {name!r}")
            view = f.mapping.view(name, to_torch(st_dtype))
            if view is None:  # an offset not aligned for the dtype: a copy
                view = torch.empty(shape, dtype=to_torch(st_dtype), device="cpu")
                copy_into(f.st, [(name, view, st_dtype, None)], self.options.threads)
                yield name, view, Origin(f.path, name)
                continue
            yield name, view, Origin(f.path, name, f.mapping, st_dtype, tuple(shape))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        bar = None
        if self.progress and bar_wanted(self.total, True):
            from tqdm.auto import tqdm

            unit, size = binary_unit(self.total)
            bar = tqdm(
                total=self.total / size,
                unit=unit,
                desc="fastload: loading weights",
                file=sys.stderr,
                bar_format="{l_bar}{bar}| {n:.2f}/{total:.2f} " + unit + " [{elapsed}<{remaining}]",
            )
        self._start_reader()
        try:
            for f in self._files:
                for name, tensor, origin in self._tensors(f):
                    self.current = (f.path, name)
                    nbytes = tensor.numel() * tensor.element_size()
                    if nbytes:  # a storage freed and reused by a later tensor: the later's
                        self.origins[tensor.untyped_storage().data_ptr()] = origin
                    yield name, tensor
                    self.bytes += nbytes
                    with self._wake:
                        self._consumed += nbytes
                        self._wake.notify_all()
                    if bar is not None:
                        bar.update(nbytes / binary_unit(self.total)[1])
            if self.deferred is not None:
                self.deferred.drain()  # raises a queued copy's failure, naming its tensor
        finally:
            self.close()
            if bar is not None:
                bar.close()


__all__ = ["CheckpointWeights", "Origin", "Unread", "check_index", "natural_key"]
