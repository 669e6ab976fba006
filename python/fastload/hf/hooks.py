"""The answers of a transformers model to the core pipeline's questions (:mod:`fastload.hooks`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fastload import keys as keymod
from fastload.hooks import ModelHooks

if TYPE_CHECKING:
    from fastload.device_map import DeviceMap
    from fastload.report import LoadReport
    from fastload.tying import Slot


class TransformersHooks(ModelHooks):
    """Renames, authorized names, fp32 modules and finishing of a transformers model.

    ``generation_config`` (transformers' option of that name) replaces the checkpoint's after
    loading.
    """

    def __init__(self, *, generation_config: Any = None) -> None:
        self.generation_config = generation_config

    def renames(self, model: nn.Module, source: str) -> Callable[[], Any]:
        from fastload.hf.renames import transformers_renames

        # Built only if some name does not match directly (transformers compiles ~1000 regexes).
        return functools.partial(transformers_renames, model, source)

    def authorized_unexpected(self, model: nn.Module, slots: list[Slot]) -> list[str]:
        # What transformers adds for buffers that used to be persistent (position_ids) or moved
        # (per-layer rotary inv_freq).
        patterns = []
        buffers = [s.name for s in slots if s.is_buffer]
        if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
            patterns.append(r"rotary_emb\.inv_freq")
        if any(b.endswith("position_ids") for b in buffers):
            patterns.append(r"(^|\.)position_ids$")
        return patterns

    def keep_fp32(self, model: nn.Module, dtype: torch.dtype | None) -> re.Pattern[str] | None:
        """transformers' ``_keep_in_fp32_modules`` (for float16) and ``..._strict`` (float16 and
        bfloat16) as one regex, searched in model names as transformers does."""
        patterns: list[str] = []
        if dtype == torch.float16:
            patterns += list(getattr(model, "_keep_in_fp32_modules", None) or ())
        if dtype in (torch.float16, torch.bfloat16):
            patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        return keymod.compile_patterns(p.replace("*", ".*") for p in patterns)

    def finish(
        self,
        model: nn.Module,
        *,
        directory: Path | None,
        built_here: bool,
        device_map: DeviceMap | None,
        report: LoadReport,
    ) -> None:
        from fastload.hf.finish import finish_transformers

        finish_transformers(
            model,
            directory=directory,
            load_generation_config=built_here,
            generation_config=self.generation_config,
            device_map=device_map,
        )
