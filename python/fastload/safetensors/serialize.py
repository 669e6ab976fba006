"""The rest of ``safetensors.torch``: ``load``/``save`` (bytes) and ``save_model``/``load_model``.

``save_model`` and ``load_model`` follow safetensors' handling of tensors that share memory (tied
weights): one name of each shared group is stored (the sorted-first name whose tensor covers its
whole storage), the others are recorded in the metadata as ``{dropped: kept}`` and count as
neither missing nor unexpected when loading. ``load_model`` writes the file's tensors straight
into the model's own tensors (converting floating-point dtypes during the copy), where
safetensors reads a state dict first and copies it in.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import nn

from fastload import _core
from fastload.core.basics.arguments import check_bool, check_module
from fastload.core.basics.dtypes import CONVERTIBLE, TORCH_TO_ST, torch_shape
from fastload.core.basics.errors import ModelMismatchError
from fastload.core.devices.checks import DeviceArg, parse_device
from fastload.core.reads.reading import read_all
from fastload.safetensors.files import safe_open
from fastload.safetensors.preparing import _check_metadata, _prepare
from fastload.safetensors.saving import save_file

_BYTES = "<bytes>"  # stands for the path in messages about in-memory files


def load(data: bytes, *, strict: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``data`` (``safetensors.torch.load``), on the CPU,
    in data order. ``strict`` as in :func:`fastload.safe_open`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"load takes the bytes of a safetensors file, got {type(data).__name__}")
    check_bool(strict, "strict", where="load")
    file = _core.SafetensorsFile.from_bytes(_BYTES, bytes(data), strict=strict)
    return read_all(file, torch.device("cpu"), None, None)


def save(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file of ``tensors`` (``safetensors.torch.save``): the same
    bytes safetensors writes, with the same refusals as :func:`fastload.save_file`."""
    meta = _check_metadata(metadata, _BYTES)
    prepared = _prepare(tensors, _BYTES)
    specs = [
        (name, st, shape, t.data_ptr(), t.numel() * t.element_size())
        for name, st, shape, t in prepared
    ]
    # `prepared` holds the tensors, so every pointer stays valid during the call.
    return _core.serialize(specs, meta)


# --- shared tensors, as safetensors.torch finds them ------------------------------------------


def storage_ptr(tensor: torch.Tensor) -> int:
    """Address of the storage under ``tensor`` (0 for a meta tensor)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except NotImplementedError:
        return 0


def storage_size(tensor: torch.Tensor) -> int:
    """Bytes of the storage under ``tensor``."""
    try:
        return tensor.untyped_storage().nbytes()
    except NotImplementedError:
        return tensor.nelement() * tensor.element_size()


def _end_ptr(tensor: torch.Tensor) -> int:
    """One past the last byte ``tensor`` reaches."""
    if tensor.nelement():
        return tensor.view(-1)[-1].data_ptr() + tensor.element_size()
    return tensor.data_ptr()


def _filter_shared_not_shared(
    groups: list[set[str]], state_dict: Mapping[str, torch.Tensor]
) -> list[set[str]]:
    """Splits each same-storage group into groups whose byte ranges overlap."""
    out: list[set[str]] = []
    for shared in groups:
        if len(shared) < 2:
            out.append(shared)
            continue
        areas = sorted((state_dict[n].data_ptr(), _end_ptr(state_dict[n]), n) for n in shared)
        _, last_stop, first = areas[0]
        out.append({first})
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                out.append({name})
            else:
                out[-1].add(name)
            last_stop = stop
    return out


def _find_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """Groups of names whose tensors overlap in memory (meta and empty storages excluded)."""
    groups: dict[tuple[torch.device, int, int], set[str]] = defaultdict(set)
    for name, t in state_dict.items():
        if t.device.type != "meta" and storage_ptr(t) != 0 and storage_size(t) != 0:
            groups[(t.device, storage_ptr(t), storage_size(t))].add(name)
    return _filter_shared_not_shared(sorted(groups.values()), state_dict)


def _is_complete(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers its whole storage, densely."""
    return tensor.data_ptr() == storage_ptr(tensor) and (
        tensor.nelement() * tensor.element_size() == storage_size(tensor)
    )


def _remove_duplicate_names(
    state_dict: Mapping[str, torch.Tensor],
    *,
    preferred_names: list[str] | None = None,
    discard_names: list[str] | None = None,
) -> dict[str, list[str]]:
    """``{kept name: [dropped names]}`` for each group of shared tensors: the kept one covers
    its whole storage (sorted first, ``preferred_names`` first, ``discard_names`` last)."""
    preferred = set(preferred_names or ())
    discard = set(discard_names or ())
    to_remove: dict[str, list[str]] = defaultdict(list)
    for shared in _find_shared_tensors(state_dict):
        complete = {n for n in shared if _is_complete(state_dict[n])}
        if not complete:
            raise RuntimeError(
                f"none of the tensors sharing memory {sorted(shared)} covers the whole storage, "
                "so keeping one would save more (or less) memory than they use; Refusing to "
                "save/load the model. Save .clone()s of them"
            )
        keep = sorted(complete)[0]
        kept = complete - discard
        if kept:
            keep = sorted(kept)[0]
        if preferred & complete:
            keep = sorted(preferred & complete)[0]
        to_remove[keep].extend(n for n in sorted(shared) if n != keep)
    return to_remove


# --- models -----------------------------------------------------------------------------------


def save_model(
    model: nn.Module,
    filename: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    force_contiguous: bool = True,
) -> None:
    """Saves ``model``'s state dict to ``filename`` (``safetensors.torch.save_model``): of each
    group of tensors sharing memory one is stored, the others recorded in the metadata as
    ``{dropped: kept}`` (a user value under the same key wins).

    ``force_contiguous`` is accepted for compatibility; fastload's ``save_file`` packs
    non-contiguous tensors in any case.
    """
    check_module(model, where="save_model")
    check_bool(force_contiguous, "force_contiguous", where="save_model")
    state_dict = model.state_dict()
    meta = dict(metadata) if metadata is not None else None
    for kept, dropped in _remove_duplicate_names(state_dict).items():
        for name in dropped:
            meta = {} if meta is None else meta
            meta.setdefault(name, kept)
            del state_dict[name]
    save_file(state_dict, filename, metadata=meta)


def load_model(
    model: nn.Module,
    filename: str | os.PathLike[str],
    strict: bool = True,
    device: DeviceArg = "cpu",
    *,
    backend: str | None = None,
    read_mode: str | None = None,
    threads: int | None = None,
) -> tuple[list[str], list[str]]:
    """Loads ``filename`` into ``model`` (``safetensors.torch.load_model``); returns
    ``(missing, unexpected)``: model names the file did not fill, file names the model lacks.

    Names that share memory in the model count once (the file may store any of them). Each
    tensor is written straight into the model's own tensor, floating-point dtypes converted
    during the copy; ``device`` is checked as safetensors' is, but the tensors stay where the
    model has them. ``strict=True`` raises :class:`ModelMismatchError` (a ``RuntimeError``) for
    missing or unexpected names; a shape that differs from the model's always raises it.
    """
    check_module(model, where="load_model")
    check_bool(strict, "strict", where="load_model")
    where = os.fspath(filename)
    parse_device(device, where=where)
    state = model.state_dict(keep_vars=True)
    with safe_open(filename, backend=backend, read_mode=read_mode, threads=threads) as f:
        on_file = f.keys()
        to_removes = _remove_duplicate_names(state, preferred_names=on_file)
        present = [k for k in on_file if k in state]
        stored = {k: f.file.info(k)[0] for k in present}
        shapes = {k: torch_shape(stored[k], list(f.shape(k)), where=where) for k in present}
        bad = [
            f"size mismatch for {k}: the file has {shapes[k]}, the model {list(state[k].shape)}"
            for k in present
            if shapes[k] != list(state[k].shape)
        ]
        if bad:
            raise ModelMismatchError(
                f"{where}: error(s) in loading state_dict for {type(model).__name__}:\n    "
                + "\n    ".join(bad)
            )
        direct, converted = {}, []
        for k in present:
            want = TORCH_TO_ST.get(state[k].dtype)
            if want == stored[k] or (stored[k] in CONVERTIBLE and want in CONVERTIBLE):
                direct[k] = state[k]
            else:  # e.g. an int64 buffer stored as I32: torch converts, as load_state_dict does
                converted.append(k)
        f.load_into(direct)
        with torch.no_grad():
            for k in converted:
                state[k].copy_(f.get_tensor(k))
    missing = {k for k in state if k not in on_file}
    unexpected = [k for k in on_file if k not in state]
    for dropped in to_removes.values():
        for name in dropped:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {type(model).__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(
                f'"{k}"' for k in sorted(missing)
            )
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(
                f'"{k}"' for k in sorted(unexpected)
            )
        raise ModelMismatchError(f"{where}: {error}")
    return sorted(missing), unexpected


__all__ = ["load", "save", "save_model", "load_model"]
