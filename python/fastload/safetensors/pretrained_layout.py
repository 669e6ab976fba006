"""What of a model a transformers-layout checkpoint holds, for ``save_pretrained``: the model out
of its ``DistributedDataParallel``/``DataParallel`` wrapper, each tie group once under its
canonical name (:func:`tied_aliases`), the state dict split into shards the way huggingface_hub
splits, and the config files written by the config's own save.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastload.core.model.tying import find_tie_groups
from fastload.families import is_transformers_model
from fastload.training.gradient_checkpointing import LEGACY_CONFIG_KEY, drop_legacy_config_key


def _unwrap_parallel(model: nn.Module) -> nn.Module:
    # DistributedDataParallel/DataParallel would prefix every name with "module.".
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def _tie_target_patterns(model: nn.Module) -> list[str]:
    """The names transformers derives from another one (``_tied_weights_keys``; dict keys in
    transformers 5, a list in 4); transformers drops these on save and keeps the source."""
    patterns: list[str] = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or ()
        keys = tied.keys() if isinstance(tied, Mapping) else tied
        patterns.extend(f"{prefix}.{k}" if prefix else k for k in keys)
    return patterns


def tied_aliases(model: nn.Module, names: set[str] | None = None) -> dict[str, str]:
    """``{alias: canonical}`` for every tie group of ``model``: the canonical name is the one a
    checkpoint stores (for transformers models the one transformers keeps, otherwise the first
    in ``named_parameters`` order); each alias is the same Parameter under another name.

    ``names``, if given, restricts the groups to those names (a state dict's keys).
    """
    targets = _tie_target_patterns(model) if is_transformers_model(model) else []
    aliases: dict[str, str] = {}
    for group in find_tie_groups(model):
        present = [n for n in group if names is None or n in names]
        if len(present) < 2:
            continue
        sources = [n for n in present if not any(re.search(p, n) for p in targets)]
        canonical = sources[0] if sources else present[0]
        aliases.update({n: canonical for n in present if n != canonical})
    return aliases


def _split(state: Mapping[str, torch.Tensor], limit: int) -> tuple[list[list[str]], int]:
    """Shards in state-dict order, the way huggingface_hub splits: a tensor over the limit gets a
    shard of its own, otherwise a new shard starts when the next tensor would tip it over."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    for name, t in state.items():
        size = t.numel() * t.element_size()
        total += size
        if size > limit:
            shards.append([name])
            continue
        if current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    return shards, total


def _stage_config(model: nn.Module, staging: Path) -> list[str]:
    """Writes the model's config (and generation config) with their own save into ``staging``;
    returns the file names written."""
    config: Any = copy.deepcopy(model.config)  # a transformers PretrainedConfig
    # Runtime state only (transformers #13657): a legacy key must not be written back.
    drop_legacy_config_key(config)
    config.architectures = [type(model).__name__]
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(staging)
    config_file = staging / "config.json"
    if config_file.is_file():
        # Belt and braces for configs whose to_dict re-adds the key from elsewhere.
        data = json.loads(config_file.read_text(encoding="utf-8"))
        if data.pop(LEGACY_CONFIG_KEY, None) is not None:
            config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", "utf-8")
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(staging)
    return sorted(p.name for p in staging.iterdir() if p.is_file())


__all__ = ["tied_aliases"]
