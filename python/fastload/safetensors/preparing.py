"""What a safetensors file is written from, for every writer (``save_file``, ``save_pretrained``,
``save``): the tensors checked (the refusals safetensors makes: a non-dict, a non-tensor, a sparse,
nested or meta tensor, tensors sharing memory), made CPU contiguous and put in the file's layout
order; the metadata checked; the digests added (``digests=True``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fastload.core.basics.dtypes import st_shape, to_st
from fastload.core.basics.errors import RequestError, TensorRefusedError
from fastload.core.checkpoint.digests import DIGESTS_KEY, digest_metadata

# safetensors' Dtype enum order; files are laid out by decreasing dtype like its writer does, so
# every tensor's data stays aligned to its element size.
_DTYPE_ORDER = [
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64",
    "I64", "U64",
]  # fmt: skip
_DTYPE_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}

# (name, safetensors dtype, shape, CPU contiguous tensor that owns the bytes)
_Prepared = tuple[str, str, list[int], torch.Tensor]


def _check_metadata(metadata: Mapping[str, str] | None, where: str) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise RequestError(f"{where}: metadata must be a dict of str to str, got {type(metadata)}")
    bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise RequestError(f"{where}: metadata keys and values must be str; not so for {bad!r}")
    return dict(metadata)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) that ``t`` touches in its storage."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _refuse_shared(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Tensors whose memory overlaps would be written twice and load as two independent tensors,
    silently breaking a tie; refuse them like safetensors does."""
    by_storage: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for name, t in tensors.items():
        if t.device.type == "meta" or t.numel() == 0:
            continue
        start, end = byte_span(t)
        key = (str(t.device), t.untyped_storage().data_ptr())
        by_storage.setdefault(key, []).append((start, end, name))
    for spans in by_storage.values():
        spans.sort()
        for (_, prev_end, prev), (start, _, name) in zip(spans, spans[1:], strict=False):
            if start < prev_end:
                raise TensorRefusedError(
                    f"{where}: tensors {prev!r} and {name!r} share memory; a file stores each "
                    "tensor's bytes separately, so the tie would be lost. Save one of them (or "
                    "use fastload.save_pretrained, which records ties), or .clone() the other"
                )


def _prepare(tensors: Mapping[str, torch.Tensor], where: str) -> list[_Prepared]:
    """Validates the tensors and returns CPU contiguous versions, in the file's layout order.

    The refusals use safetensors' exception classes (and, for a wrong argument, its words):
    ``ValueError`` for a non-dict, a non-tensor or a sparse tensor, ``RuntimeError`` for shared
    memory or a meta tensor, each also a ``fastload.FastloadError``.
    """
    if not isinstance(tensors, Mapping):
        raise RequestError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    sparse = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise RequestError(f"{where}: tensor names must be str, got {name!r}")
        if name == "__metadata__":
            raise RequestError(
                f"{where}: a tensor cannot be named '__metadata__': the format reserves that key "
                "for the metadata (pass metadata={...} instead)"
            )
        if not isinstance(t, torch.Tensor):
            raise RequestError(
                f"Key `{name}` is invalid, expected torch.Tensor but received {type(t)}"
            )
        if t.is_nested:
            raise RequestError(
                f"{where}: tensor {name!r} is a nested tensor, which a safetensors file cannot "
                "hold; save its components, or .to_padded_tensor(0.0)"
            )
        if t.layout != torch.strided:
            sparse.append(name)
    if sparse:
        raise RequestError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not "
            "support. You can make it a dense tensor before saving with `.to_dense()` but be "
            "aware this might make a much larger file than needed."
        )
    for name, t in tensors.items():
        if t.device.type == "meta":
            raise TensorRefusedError(
                f"{where}: tensor {name!r} is on the meta device: Cannot copy out of meta tensor; "
                "no data!"
            )
    _refuse_shared(tensors, where)
    out: list[_Prepared] = []
    for name, t in tensors.items():
        st = to_st(t.dtype)
        # resolve_conj/neg: lazy conjugate/negative views hold un-applied bytes.
        data = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        out.append((name, st, st_shape(t.dtype, t.shape, where=where), data))
    out.sort(key=lambda p: (-_DTYPE_RANK.get(p[1], -1), p[0]))
    return out


def _with_digests(
    meta: dict[str, str] | None, prepared: list[_Prepared], where: str, threads: int | None
) -> dict[str, str]:
    """``meta`` plus the digest of every prepared tensor
    (:mod:`fastload.core.checkpoint.digests`)."""
    meta = dict(meta or {})
    if DIGESTS_KEY in meta:
        raise RequestError(
            f"{where}: metadata already has the key {DIGESTS_KEY!r}, which digests=True writes; "
            "drop one of them"
        )
    meta[DIGESTS_KEY] = digest_metadata([(name, t) for name, _, _, t in prepared], threads)
    return meta
