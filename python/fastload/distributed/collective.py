"""Collective loading: the ranks of a ``torch.distributed`` group load one checkpoint together,
each reading about 1/N of its bytes from storage.

``from_pretrained(..., process_group=pg)`` (and every tensor-parallel load) plans as usual on
every rank; then the bytes the plan needs are cut into :data:`CHUNK_BYTES` chunks at page
boundaries, and the chunks are dealt to the ranks in contiguous, balanced runs
(:func:`deal`). Each rank reads only its own chunks, with positioned reads of exactly those
bytes (no mapping, no read-ahead of the whole file), and broadcasts each one to the group in
file order; every rank copies what it needs out of every chunk into its destinations. A rank's
helper thread reads its next chunks while the group exchanges earlier ones. The bytes go
straight where they belong on every rank (:mod:`fastload.distributed.landings`: a rank's own
tensors, its slices of them under a tensor-parallel plan, or the assembly of a tensor that must
be converted first), and no chunk buffer holds them on their way (a local file's chunks are read
into a few buffers: ``O_DIRECT`` needs aligned memory; the owner of a chunk from object storage
holds the bytes only other ranks keep in a scratch buffer until it has sent them).

Each rank ends with exactly the tensors a single-process load gives it (its shards, under a
tensor-parallel plan). The ranks may read different paths (each node's local copy of one
checkpoint): their headers are compared first (:func:`check_same_checkpoint`), and a mismatch is
a ``CheckpointError`` on every rank.

A checkpoint in object storage is read the same way, each rank fetching its chunks with the
engine's ranged GETs, every rank pinned to one version of each object
(:mod:`fastload.distributed.object_reads`, :mod:`fastload.distributed.pinning`). Before each
chunk its owner says whether it has it: a rank that failed to read stops every rank with one
error naming it (:mod:`fastload.distributed.group`).

gloo moves CPU buffers; with NCCL the buffers live on the rank's CUDA device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.errors import (
    CheckpointError,
    RequestError,
    UnsupportedError,
)
from fastload.core.checkpoint.opened import OpenCheckpoint, StoredTensor
from fastload.distributed.destinations import check_destination
from fastload.distributed.file_reads import PAGE, Chunk, FileReader
from fastload.distributed.group import RankGroup, abandon, agree_on_plan, together
from fastload.distributed.landings import Piece, Target, pieces, scatter
from fastload.distributed.moves import alone, land_chunk, move_buffer, owner_landing
from fastload.distributed.needs import Routes, need_of, sole_keepers
from fastload.distributed.object_reads import ObjectReader, deal_objects
from fastload.distributed.pinning import agree_on_versions

#: bytes of one exchanged chunk (smaller when the checkpoint is small, so every rank gets some)
CHUNK_BYTES = 32 << 20


def check_same_checkpoint(group: RankGroup, ckpt: OpenCheckpoint | Checkpoint) -> None:
    """``CheckpointError`` on every rank unless all ranks opened the same checkpoint layout (the
    same tensors, dtypes, shapes and byte offsets in files of the same sizes), naming the ranks
    that differ from rank 0 and their files. Objects in object storage must also be one version
    on every rank (:func:`~fastload.distributed.pinning.agree_on_versions`)."""
    agree_on_versions(group, ckpt.files)
    digest = hashlib.sha256()
    for i, file in enumerate(ckpt.files):
        digest.update(
            f"{i}:{getattr(file, 'file_size', -1)}:{getattr(file, 'data_start', -1)};".encode()
        )
    for t in sorted(ckpt.tensors.values(), key=lambda t: (t.file, t.begin, t.name)):
        digest.update(f"{t.name}|{t.file}|{t.st_dtype}|{t.shape}|{t.begin}|{t.nbytes};".encode())
    mine = (digest.hexdigest(), [f.path for f in ckpt.files])
    everyone = group.gather(mine)
    differ = [r for r, (d, _) in enumerate(everyone) if d != everyone[0][0]]
    if differ:
        listed = "; ".join(f"rank {r}: {', '.join(everyone[r][1])}" for r in [0, *differ])
        raise CheckpointError(
            f"collective load: the ranks opened different checkpoints (tensors, dtypes, shapes or "
            f"offsets differ from rank 0's): {listed}"
        )


def open_same(group: RankGroup, opener: Callable[[], OpenCheckpoint], what: str) -> OpenCheckpoint:
    """``opener()`` on every rank of ``group``: a rank that fails to open stops every rank
    (:func:`~fastload.distributed.group.together`, ``what`` naming the step), and the ranks must
    have opened the same checkpoint (:func:`check_same_checkpoint`)."""
    ckpt = together(group, opener, what)
    check_same_checkpoint(group, ckpt)
    return ckpt


def spans(needed: Sequence[tuple[StoredTensor, int]]) -> list[tuple[int, int, int]]:
    """The merged ``(file, start, stop)`` byte spans of the stored tensors in ``needed``
    (each with its file's data start)."""
    ranges = sorted(
        {(t.file, base + t.begin, base + t.begin + t.nbytes) for t, base in needed if t.nbytes}
    )
    out: list[tuple[int, int, int]] = []
    for file, start, stop in ranges:
        if out and out[-1][0] == file and start <= out[-1][2]:
            out[-1] = (file, out[-1][1], max(out[-1][2], stop))
        else:
            out.append((file, start, stop))
    return out


def deal(span_list: Sequence[tuple[int, int, int]], world_size: int) -> list[Chunk]:
    """The spans cut into chunks at page boundaries, dealt to the ranks as contiguous runs of
    about equal bytes (rank 0 the first run, in file order)."""
    total = sum(stop - start for _, start, stop in span_list)
    # small enough that every rank's share is within a small fraction of 1/N
    size = max(PAGE, min(CHUNK_BYTES, total // max(1, world_size * 16)) // PAGE * PAGE)
    pieces: list[tuple[int, int, int]] = []
    for file, start, stop in span_list:
        cut = start
        while cut < stop:
            end = min(stop, (cut // PAGE * PAGE) + size)  # page-aligned ends inside a span
            pieces.append((file, cut, end))
            cut = end
    out: list[Chunk] = []
    done = 0
    for file, start, stop in pieces:
        # the rank whose share of the byte stream this piece's middle falls into
        middle = done + (stop - start) // 2
        owner = min(world_size - 1, middle * world_size // max(total, 1))
        out.append(Chunk(file, start, stop, owner))
        done += stop - start
    return out


def pages(chunks: Sequence[Chunk]) -> int:
    """Bytes of the whole pages ``chunks`` touch in their files."""
    seen: set[tuple[int, int]] = set()
    for c in chunks:
        seen.update((c.file, p) for p in range(c.start // PAGE, (c.stop - 1) // PAGE + 1))
    return len(seen) * PAGE


@dataclass
class Exchange:
    """What one collective read did: bytes this rank read from storage (whole pages of a local
    file, exactly its chunks' bytes from object storage) and bytes it received from the
    others."""

    storage_bytes: int = 0
    received_bytes: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    #: every rank's chunks: who read which bytes from storage
    dealt: list[Chunk] = field(default_factory=list)


@dataclass
class Checkpoint:
    """The files of a load and their tensors, by name (what :class:`OpenCheckpoint` holds)."""

    files: Sequence[Any]
    tensors: dict[str, StoredTensor]

    @classmethod
    def of_file(cls, file: _core.SafetensorsFile) -> Checkpoint:
        """One opened safetensors file."""
        tensors = {
            name: StoredTensor(name, 0, st_dtype, tuple(shape), end - begin, begin)
            for name, st_dtype, shape, begin, end in file.tensors()
        }
        return cls([file], tensors)


def read_collectively(
    group: RankGroup,
    ckpt: OpenCheckpoint | Checkpoint,
    fills: Sequence[tuple[str, torch.Tensor, list[int] | None]],
    *,
    threads: int | None = None,
    turn: int = 0,
    progress: _core.Progress | None = None,
) -> Exchange:
    """Fills ``fills`` (stored name, destination, selection) on every rank, each rank reading
    only its chunks of the bytes they need (see the module docstring). Every rank of the group
    must call this with the same stored names (their destinations and selections may differ).
    ``turn``: from object storage, the rank dealt the first chunk (mod N; a caller making many
    small reads counts them, so that reads smaller than a chunk spread over the ranks).
    ``progress``: counts each chunk's bytes as it arrives."""
    try:  # a destination one rank cannot fill stops every rank at once, as one process
        for name, dest, selection in fills:
            check_destination(ckpt, name, dest, selection)
    except Exception as e:
        abandon(group, e)  # the others hear it in agree_on_plan below
    remote = [isinstance(f, _core.SafetensorsFile) and f.remote for f in ckpt.files]
    for file, from_store in zip(ckpt.files, remote, strict=True):
        local = isinstance(file, _core.SafetensorsFile) and file.fileno() is not None
        if not (from_store or local):
            raise UnsupportedError(
                f"{file.path}: a collective load reads safetensors files from storage; load a "
                "pickle checkpoint or a state dict on each rank without process_group"
            )
    targets: dict[str, Target] = {}
    for name, dest, selection in fills:
        stored = ckpt.tensors[name]
        base = ckpt.files[stored.file].data_start  # type: ignore[union-attr]
        target = targets.setdefault(name, Target(stored, base + stored.begin))
        target.fills.append((dest, selection))
    ordered = sorted(targets.values(), key=lambda t: (t.stored.file, t.start))
    extents = [
        (t.stored.file, t.start, t.start + t.stored.nbytes, t.stored.name, t.stored.st_dtype)
        for t in ordered
        if t.stored.nbytes
    ]
    chunks: list[Chunk] = []
    if any(remote):  # every file: the ranks agreed on one version of each, all from the store
        # dealt below, once every rank's needs are known: the plan is what the deal comes from
        plan = repr((turn, [e[:3] for e in extents]))
    else:
        needed = [(t.stored, t.start - t.stored.begin) for t in ordered]
        chunks = deal(spans(needed), group.world_size)
        plan = repr([(c.file, c.start, c.stop) for c in chunks])
    plans = agree_on_plan(group, hashlib.sha256(plan.encode()).hexdigest())
    if len(set(plans)) != 1:
        raise RequestError(
            "collective load: the ranks planned different reads (their models, options or "
            "checkpoints differ); every rank must load the same model the same way"
        )
    by_file: dict[int, list[Target]] = {}
    for t in ordered:
        by_file.setdefault(t.stored.file, []).append(t)
    # what each rank keeps of each tensor: a chunk goes to each rank as those bytes only
    kept = {
        t.stored.name: need_of(t.stored.torch_shape, t.stored.st_dtype, [s for _, s in t.fills])
        for t in ordered
    }
    spans_by_file = {
        f: [(t.stored.name, t.start, t.start + t.stored.nbytes) for t in ts]
        for f, ts in by_file.items()
    }
    for t in ordered:  # where its bytes land follows what this rank keeps of it
        t.needs = kept[t.stored.name]
    everyone = group.gather(kept)
    routes = Routes(everyone, spans_by_file)
    if any(remote):  # a range one rank alone keeps is that rank's to fetch (alike everywhere)
        keepers = {
            t.stored.name: sole_keepers(everyone, t.stored.name, t.stored.nbytes)
            for t in ordered
            if t.stored.name in routes.partial
        }
        dealt = deal_objects(extents, group.world_size, turn, keepers, routes.partial)
        chunks = [Chunk(*c) for c in dealt]
    mine = [c for c in chunks if c.owner == group.rank]
    result = Exchange(chunks=mine, dealt=list(chunks))
    # which chunks no rank but their owner keeps a byte of: decided once, alike on every rank
    solo = [alone(group, routes, c) for c in chunks]
    reader: FileReader | ObjectReader
    if any(remote):  # a store has no pages: exactly the chunks' bytes are fetched
        result.storage_bytes = sum(c.nbytes for c in mine)
        owned = [(c.file, c.start, c.stop) for c in mine]
        # on the CPU, each chunk is fetched straight into the tensors it belongs to
        land = (
            partial(owner_landing, group, by_file, routes) if group.device.type == "cpu" else None
        )
        solo_mine = [s for c, s in zip(chunks, solo, strict=True) if c.owner == group.rank]
        reader = ObjectReader(ckpt.files, extents, owned, group.device, threads, land, solo_mine)
    else:
        result.storage_bytes = pages(mine)
        reader = FileReader(ckpt, mine, group.device, threads)
    with reader:
        result.received_bytes = _exchange(group, chunks, solo, reader, by_file, routes, progress)
    unfilled = [t.stored.name for t in targets.values() if t.received != t.kept]
    if unfilled:  # a bug, not bad input: every needed byte lies in some chunk
        raise AssertionError(f"collective load: bytes of {unfilled[:3]} never arrived")
    return result


def _pieces(
    by_file: dict[int, list[Target]], file: int, start: int, stop: int
) -> list[Piece] | None:
    return pieces(start, stop, by_file.get(file, ()))


def _exchange(
    group: RankGroup,
    chunks: Sequence[Chunk],
    solo: Sequence[bool],
    reader: FileReader | ObjectReader,
    by_file: dict[int, list[Target]],
    routes: Routes,
    progress: _core.Progress | None = None,
) -> int:
    """Each chunk in turn, from its owner to every rank that keeps some of it (broadcast where
    every rank keeps all of it, else each rank sent only its bytes), into the targets; returns
    the bytes this rank received. Before each chunk that crosses the group every rank says
    whether it has read all its chunks so far: a rank that could not read one stops every rank
    (one error naming it and the cause: :func:`~fastload.distributed.group.together`), none is
    left waiting for a chunk that will not come. A chunk that no rank but its owner keeps a byte
    of (a column-wise slice, dealt to the rank that keeps it) crosses nothing: its owner lands it
    alone and the others go on without waiting for it (``solo``: by chunk, whether it is one).

    On the CPU a chunk's bytes travel straight from and to where they land on each rank
    (:mod:`fastload.distributed.landings`): the owner's fetched chunk is there already (object
    storage: the bytes it only sends on, in a scratch buffer of the chunk) or copied there from
    its read buffer (a local file, sent from that buffer), and the others receive them there;
    only a chunk that the tensors do not cover end to end goes through a buffer."""
    spare: torch.Tensor | None = None
    status = torch.zeros(1, dtype=torch.int32, device=group.device)
    received = 0
    on_cpu = group.device.type == "cpu"
    failure: BaseException | None = None  # this rank's failed read, told at the next check
    for index, (chunk, crosses_nothing) in enumerate(zip(chunks, solo, strict=True)):
        mine = chunk.owner == group.rank
        if crosses_nothing and not mine:  # nothing of it comes here, nor must this rank wait for it
            if progress is not None:
                progress.add(chunk.nbytes)
            continue
        got: Any = None
        if mine and failure is None:
            try:
                got = reader.next()
            except Exception as e:  # the others must hear of it
                failure = e
        if not crosses_nothing:
            _check(group, status, failure)
        if mine and got is None:
            continue  # its read failed: told at the next check
        parts = _pieces(by_file, chunk.file, chunk.start, chunk.stop) if on_cpu else None
        if parts is None:  # through a buffer
            buffer = got
            if buffer is None:
                if spare is None:
                    spare = torch.empty(
                        max(c.nbytes for c in chunks), dtype=torch.uint8, device=group.device
                    )
                buffer = spare[: chunk.nbytes]
            received += move_buffer(group, index, chunk, buffer, routes)
            scatter(chunk.start, chunk.stop, buffer, by_file.get(chunk.file, ()))
        else:
            received += land_chunk(group, index, chunk, parts, got, routes, len(chunks))
        if progress is not None:
            progress.add(chunk.nbytes)
        if mine:
            reader.release(got)  # (its scratch goes with it)
        got = None
    _check(group, status, failure)  # a failed read of a chunk that crossed nothing
    return received


def _check(group: RankGroup, status: torch.Tensor, failure: BaseException | None) -> None:
    """Every rank says whether a read of its failed; if one did, every rank raises one error
    naming it (:func:`~fastload.distributed.group.together`)."""
    status.fill_(0 if failure is None else 1)
    group.largest(status)
    if status.item():
        together(group, partial(_raise, failure), "reading its share of the checkpoint")


def _raise(failure: BaseException | None) -> None:
    if failure is not None:
        raise failure
