"""What a model family adds to the core pipeline, as a small interface.

The core loader knows torch modules only. A family of models with conventions of its own
(transformers models: registered renames, buffers that used to be persistent, finishing steps)
supplies a :class:`ModelHooks`; :func:`hooks_for` picks it. The Hugging Face layer
(:mod:`fastload.hf`) is imported only when a transformers model is detected, so the core never
imports it up front.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fastload.skeleton import is_transformers_model

if TYPE_CHECKING:
    from fastload.checkpoint import OpenCheckpoint
    from fastload.device_map import DeviceMap
    from fastload.keys import Rename
    from fastload.planning import Merge
    from fastload.report import LoadReport
    from fastload.tying import Slot


class ModelHooks:
    """The core's questions to a model family; the defaults are those of a plain ``nn.Module``."""

    def renames(self, model: nn.Module, source: str) -> Sequence[Rename] | Callable[[], Any]:
        """Renamings applied to checkpoint names before matching (may be a builder, called only
        when some name does not match directly)."""
        return ()

    def merges(
        self,
        model: nn.Module,
        ckpt: OpenCheckpoint,
        model_keys: set[str],
        options: dict[str, Any],
    ) -> dict[str, Merge]:
        """Model tensors assembled from pieces of stored tensors, by model name (``options``
        are :func:`fastload.keys.map_keys`'s). The stored tensors they use are not mapped by
        name."""
        return {}

    def collision_order(self) -> Callable[[str], Any] | None:
        """``None``: two checkpoint tensors that map onto one model tensor are refused
        (``CheckpointError``); a sort key of checkpoint names: the first in that order loads."""
        return None

    def refuse_no_match(self) -> bool:
        """Whether a checkpoint none of whose tensors matches the model is refused
        (``CheckpointError``: a checkpoint of another model, or the wrong file); ``False``
        loads it, every model tensor missing."""
        return True

    def auto_dtype(self, ckpt: OpenCheckpoint) -> torch.dtype | None:
        """What ``dtype="auto"`` means for a model built for this load (``None``: each
        tensor's stored dtype)."""
        return None

    def authorized_unexpected(self, model: nn.Module, slots: list[Slot]) -> list[str]:
        """Regex patterns of checkpoint names that are expected to have no place in the model."""
        return []

    def keep_fp32(self, model: nn.Module, dtype: torch.dtype | None) -> re.Pattern[str] | None:
        """Names that stay float32 under an explicit floating ``dtype``."""
        return None

    def finish(
        self,
        model: nn.Module,
        *,
        directory: Path | None,
        built_here: bool,
        device_map: DeviceMap | None,
        report: LoadReport,
    ) -> None:
        """Runs after the tensors are in place and before the train/eval mode is set."""


def hooks_for(model: nn.Module) -> ModelHooks:
    """The hooks of ``model``'s family: transformers' for a transformers model (the Hugging Face
    layer is imported here, at the point one is detected), plain ones otherwise."""
    if is_transformers_model(model):
        from fastload.hf.hooks import TransformersHooks

        return TransformersHooks()
    return ModelHooks()
