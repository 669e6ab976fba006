"""``fastload convert``: a pickle checkpoint (``.bin``/``.pt``, or a sharded
``pytorch_model.bin.index.json``) to one safetensors file, loaded with
``torch.load(weights_only=True)`` (no code from the file runs) and with tied (shared) tensors
stored once."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastload.core.basics.errors import CheckpointError, RequestError
from fastload.core.checkpoint import new_files

#: files next to a pickle checkpoint that ``convert`` copies, so the output loads as a model
COMPANION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "preprocessor_config.json",
)


@dataclass
class Converted:
    """What :func:`convert` wrote."""

    target: Path
    tensors: int
    nbytes: int
    #: ``{alias: canonical}`` of the tied tensors stored once
    aliases: dict[str, str] = field(default_factory=dict)
    #: tensors that partly overlapped another, stored as copies
    cloned: list[str] = field(default_factory=list)
    #: the files next to the checkpoint copied beside the output
    copied: list[str] = field(default_factory=list)


def convert(source: Path, out_dir: Path, *, overwrite: bool = False) -> Converted:
    """Converts the pickle checkpoint at ``source`` to ``out_dir/model.safetensors``, copying the
    :data:`COMPANION_FILES` next to it; ``RequestError`` if the output exists (without
    ``overwrite``), ``CheckpointError`` for a tensor in two shards."""
    from fastload.safetensors.saving import TIED_KEY, save_file

    target = out_dir / "model.safetensors"
    if out_dir.exists() and not out_dir.is_dir():
        raise RequestError(f"{out_dir}: exists and is not a directory")
    if target.exists() and not overwrite:
        raise RequestError(f"{target}: already exists (pass --overwrite to replace it)")
    files = pickle_sources(source)
    state: dict[str, Any] = {}
    for f in files:
        part = load_pickle(f)
        clash = sorted(set(part) & set(state))
        if clash:
            raise CheckpointError(f"{f}: tensor {clash[0]!r} is also in another shard")
        state.update(part)
    tensors, aliases, cloned = dedupe_shared(state)
    metadata = {"format": "pt"}
    if aliases:
        metadata[TIED_KEY] = json.dumps(aliases, sort_keys=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, target, metadata=metadata)
    copied = []
    for name in COMPANION_FILES:
        companion = files[0].parent / name
        # lexists: an entry already there, a link included, is left alone, never written through
        if companion.is_file() and not os.path.lexists(out_dir / name):
            staged = new_files.write_temporary(out_dir, companion.read_bytes())
            new_files.publish(staged, out_dir / name)
            copied.append(name)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return Converted(target, len(tensors), nbytes, aliases, cloned, copied)


def pickle_sources(path: Path) -> list[Path]:
    """The pickle files of a checkpoint: one file, a directory, or a ``.bin.index.json``,
    resolved (and its index checked) exactly as ``from_pretrained(allow_pickle=True)`` does."""
    from fastload.core.checkpoint.files import resolve
    from fastload.core.checkpoint.pickle_file import is_pickle

    files = list(resolve(path, allow_pickle=True).files)
    if not all(is_pickle(f) for f in files):
        raise CheckpointError(f"{path}: already holds a safetensors checkpoint; nothing to convert")
    return files


def load_pickle(path: Path) -> dict[str, Any]:
    from fastload.core.checkpoint.pickle_file import load_state_dict

    # Training checkpoints often wrap the weights: {"state_dict": {...}, "epoch": 3, ...}.
    return load_state_dict(path, unwrap=True)


def dedupe_shared(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Tensors sharing memory, made storable.

    Returns ``(tensors, aliases, cloned)``: views identical to an earlier tensor (same storage,
    offset, shape, strides and dtype: a tie) are dropped and recorded as ``{alias: canonical}``,
    the canonical name being the first in the state dict's order; tensors that only partly overlap
    another (a slice of a fused weight) are cloned, their names in ``cloned``.
    """
    import torch

    from fastload.safetensors.preparing import byte_span

    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in state.items():
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            t.dtype,
            tuple(t.shape),
            t.stride(),
        )
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        if t.numel():
            seen[key] = name
        out[name] = t
    spans: dict[tuple[Any, int], list[tuple[int, int, str]]] = {}
    for name, t in out.items():
        if not t.numel():
            continue
        start, end = byte_span(t)
        spans.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((start, end, name))
    cloned: list[str] = []
    for group in spans.values():
        group.sort(key=lambda span: (span[0], -span[1]))  # the widest first: slices get copied
        reach = -1
        for start, end, name in group:
            if start < reach:
                out[name] = out[name].clone()
                cloned.append(name)
            reach = max(reach, end)
    return out, aliases, cloned
