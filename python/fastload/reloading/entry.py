"""``fastload.reload``: the public entry of a reload.

It takes the sources a load takes. Local files, object storage URLs and state dicts go straight to
the reload (:func:`fastload.reloading.in_place.reload`); a model id, or a local directory with
``subfolder`` / ``variant``, is resolved first by the resolver the model's load recorded (for
``fastload.from_pretrained``, the hub's: :func:`fastload.hf.hub.reload_source`), so an RL loop can
reload the revision a trainer just pushed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from fastload.core.basics.errors import RequestError
from fastload.core.store.object_store import is_url
from fastload.distributed.steps import RANK_STEPS
from fastload.reloading.in_place import Source
from fastload.reloading.in_place import reload as reload_into
from fastload.reloading.record import record_of
from fastload.reloading.report import ReloadReport

__all__ = ["ReloadReport", "reload"]


def reload(
    model: nn.Module,
    source: Source,
    *,
    atomic: bool = False,
    skip_unchanged: bool = True,
    verify: bool = False,
    threads: int | None = None,
    storage_options: Mapping[str, object] | None = None,
    revision: str | None = None,
    subfolder: str = "",
    variant: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    process_group: Any = None,
) -> ReloadReport:
    """Writes the checkpoint ``source`` into ``model``, a model :func:`fastload.from_pretrained`
    loaded, in place: every parameter and buffer keeps its storage (``data_ptr``), ties stay
    ties, and each tensor is read as the load read it (key mapping, dtype, device,
    tensor-parallel part). Every header, name, shape and dtype is checked before the first byte
    is written. Reloads of one model run one at a time: a second one, from another thread,
    waits until the first has returned.

    Args:
        model: a module that ``fastload.from_pretrained`` returned (or that a reload refreshed).
        source: a checkpoint file, directory or sharded index; a Hugging Face model id
            (``"org/name"``, resolved by ``huggingface_hub``: its cache first, then the hub); an
            object storage URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``); or a state dict.
        atomic: read every new tensor into memory of its own first (within the memory budget:
            refused before reading when it does not fit), check it, and only then copy it into
            the model: any failure leaves the old weights whole.
        skip_unchanged: skip tensors whose digest (``save_pretrained(..., digests=True)``) is
            the same in the model's checkpoint and the new one. Equal digests are trusted: those
            tensors are neither read nor checked. Pass ``False`` when the model's weights were
            changed in place since (by training): the digests describe the files.
        verify: with ``atomic=True``, also check the bytes read against the digests the new
            files record before committing (a file rewritten in place or corrupted since it was
            written is refused); hashing costs about 0.6 GB/s per core. The bytes are checked
            as read, whatever the destination: a tensor converted, sliced (tensor parallelism)
            or on an accelerator is read whole in its stored dtype into host memory first.
        threads: the copy engine's threads (default: what the load used).
        storage_options: for an object storage URL (default: those of the load, when it read
            one too).
        revision: for a model id: the branch, tag or commit to read (default ``"main"``).
        subfolder: the checkpoint's folder inside the model id's snapshot or the directory.
        variant: the weights' variant (``model.<variant>.safetensors``).
        cache_dir: for a model id: the hub cache to use instead of ``HF_HUB_CACHE``.
        token: for a model id: the hub token (``huggingface_hub``'s own rules by default).
        local_files_only: for a model id: never download, read the cache only (also with
            ``HF_HUB_OFFLINE=1``).
        process_group: reload together with the other ranks of this ``torch.distributed``
            group (``torch.distributed.group.WORLD`` for all), each holding a model fastload
            loaded (with ``process_group=`` or ``tp_plan=``): every rank calls ``reload`` with
            the same options and a copy of the same checkpoint. Each changed tensor is read
            once across the group (each rank reads about 1/N of the bytes the group needs and
            receives the rest, as a collective load does) and each rank keeps what its model
            holds (its slices, under tensor parallelism). ``atomic`` and ``verify`` work as
            on one process (with ``verify``, the reads are shared and every rank hashes every
            tensor read, so all ranks refuse a mismatch alike). The ranks agree before any reads:
            a rank that refuses the reload (any error below), ranks whose checkpoints record
            other digests or that would skip other tensors stop every rank with one error
            naming the rank, nothing written. The sources a collective load reads: local files
            (each rank its own copy) or an object storage URL (every rank pinned to one version
            of each object); not a state dict.

    Returns:
        a :class:`~fastload.reloading.report.ReloadReport`.

    Raises:
        RequestError: ``model`` was not loaded by fastload, or hub options with a source that
            takes none (a URL or a state dict).
        FastloadIOError: a model id that is neither in the cache nor on the hub.
        UnsupportedError: the load left tensors on disk (``offload_folder``).
        CheckpointError: a tensor the model takes is missing, of a dtype that cannot convert, on
            the meta device (a state dict), the checkpoint holds tensors the model's did not, or
            stores a tie of the model under two names with different values (a reload cannot
            untie); ``ModelMismatchError`` for another shape. Nothing was written. With
            ``verify=True``, bytes read that do not match their digest (the model unchanged).
        MemoryBudgetError: ``atomic=True`` and the staged copies do not fit.
        ReloadError: the reload failed after writing into the model (see its ``tensors``).
            With ``process_group``, on every rank when one fails while the group reads (one
            error naming the rank; a rank that dies: ``[rank-lost]`` at once).
    """
    hub: dict[str, Any] = {
        name: value
        for name, value in (("revision", revision), ("cache_dir", cache_dir), ("token", token))
        if value is not None
    }
    if local_files_only:
        hub["local_files_only"] = True

    def resolve(source: Source) -> Source:
        asked = bool(hub or subfolder or variant is not None)
        if not isinstance(source, (str, os.PathLike)) or is_url(source):
            if asked:
                raise RequestError(
                    f"reload: {_given(hub, subfolder, variant)} apply to a model "
                    f"id or a local directory, not to {_kind(source)}"
                )
            return source
        # the core checked the record before calling this; the model's entry resolves ids
        record = record_of(model)
        resolve_id = None if record is None else record.resolve_id
        if resolve_id is None:
            if asked:
                raise RequestError(
                    f"reload: {_given(hub, subfolder, variant)} need a model id resolver, and "
                    "the entry that loaded this model recorded none: pass the checkpoint's path"
                )
            return source
        return resolve_id(source, hub, subfolder, variant)

    return reload_into(
        model,
        source,
        atomic=atomic,
        skip_unchanged=skip_unchanged,
        verify=verify,
        threads=threads,
        storage_options=storage_options,
        resolve=resolve,
        process_group=process_group,
        steps=RANK_STEPS,
    )


def _given(hub: dict[str, Any], subfolder: str, variant: str | None) -> str:
    return ", ".join(
        [*hub, *(["subfolder"] if subfolder else []), *(["variant"] if variant else [])]
    )


def _kind(source: Source) -> str:
    return "an object storage URL" if is_url(source) else "a state dict"
