"""Per-tensor digests a checkpoint may carry, so that a reload reads only the tensors that changed.

A file written with ``save_file(..., digests=True)`` (or ``save_pretrained(..., digests=True)``)
holds, under the metadata key :data:`DIGESTS_KEY`, the JSON object ``{tensor name: digest}``: a
BLAKE2b digest (16 bytes, hex) of each tensor's stored bytes, prefixed with the algorithm's name.
Without the option the file is byte for byte what safetensors writes. A digest is the writer's
claim about the bytes it wrote; :func:`fastload.reload` trusts it to skip equal tensors, and
checks it against the bytes it read when staging (``atomic=True``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = [
    "DIGESTS_KEY",
    "ALGORITHM",
    "tensor_digest",
    "bytes_digest",
    "file_digests",
    "digest_metadata",
]

#: the metadata key holding a file's digests (a JSON object, tensor name -> digest)
DIGESTS_KEY = "fastload.digests"
#: the prefix of every digest: a reader that does not know it treats the tensor as unknown
ALGORITHM = "blake2b-128"


def bytes_digest(data: torch.Tensor) -> str:
    """The digest of a contiguous CPU tensor's bytes (``ALGORITHM:hex``); hashlib releases the
    GIL over large buffers."""
    if data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError("bytes_digest needs a contiguous CPU tensor")
    flat = data.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    h = hashlib.blake2b(raw.numpy().data, digest_size=16)
    return f"{ALGORITHM}:{h.hexdigest()}"


def tensor_digest(tensor: torch.Tensor) -> str:
    """The digest of the bytes a safetensors file stores for ``tensor`` (contiguous, on the
    CPU, conjugate and negative views resolved)."""
    data = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    return bytes_digest(data)


def file_digests(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The digests a file's metadata records (empty: none, or a record this reader does not
    know: another algorithm or malformed JSON, which only costs the skip, never correctness)."""
    text = (metadata or {}).get(DIGESTS_KEY)
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(parsed, dict):
        return {}
    return {
        k: v
        for k, v in parsed.items()
        if isinstance(k, str) and isinstance(v, str) and v.startswith(ALGORITHM + ":")
    }


def digest_metadata(tensors: Sequence[tuple[str, torch.Tensor]], threads: int | None = None) -> str:
    """The :data:`DIGESTS_KEY` value for ``tensors`` (name, contiguous CPU tensor of the bytes
    to store), hashed on up to ``threads`` threads (hashlib hashes without the GIL)."""
    workers = max(1, min(threads or os.cpu_count() or 1, 16, len(tensors) or 1))
    with ThreadPoolExecutor(workers) as pool:
        values = list(pool.map(lambda item: bytes_digest(item[1]), tensors))
    return json.dumps(dict(zip((n for n, _ in tensors), values, strict=True)), sort_keys=True)
