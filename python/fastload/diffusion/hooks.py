"""The answers of a diffusers model to the core pipeline's questions
(:mod:`fastload.core.plan.hooks`).

diffusers' rules (``ModelMixin.from_pretrained`` and ``load_model_dict_into_meta`` in diffusers
0.40), as fastload's plan takes them:

* names: a checkpoint name is the model's name, unchanged (no base-model prefix, no legacy
  ``gamma``/``beta``); in a single-file checkpoint, the attention blocks diffusers built from its
  deprecated layout (``_from_deprecated_attn_block``) take their old names (``query``, ``key``,
  ``value``, ``proj_attn``) as ``to_q``, ``to_k``, ``to_v``, ``to_out.0``
  (``ModelMixin._fix_state_dict_keys_on_load``);
* dtype: with no dtype asked for (``dtype="auto"``), every floating tensor takes the skeleton's
  dtype, torch's default (float32); with a dtype, floating tensors are converted to it, except the
  tensors of ``_keep_in_fp32_modules`` (a module name among the dotted parts of the tensor's
  name), which become float32;
* finishing: ``_name_or_path`` registered in the config, and what diffusers says of missing,
  unused and re-initialized tensors said in its words, on its logger.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fastload.core.plan.hooks import ModelHooks

if TYPE_CHECKING:
    from fastload.core.checkpoint.opened import OpenCheckpoint
    from fastload.core.devices.device_map import DeviceMap
    from fastload.core.model.keys import Rename
    from fastload.core.plan.report import LoadReport

__all__ = ["DiffusersHooks", "deprecated_attention_renames", "keep_fp32_pattern"]

#: the logger diffusers' ``from_pretrained`` reports missing and unused weights on
DIFFUSERS_LOGGER = "diffusers.models.modeling_utils"

#: the old names of a deprecated attention block's layers -> diffusers' current ones
_DEPRECATED_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def deprecated_attention_renames(model: nn.Module) -> list[Rename]:
    """The renames of ``ModelMixin._fix_state_dict_keys_on_load``: under every module diffusers
    built from a deprecated attention block, ``<path>.query.weight`` -> ``<path>.to_q.weight``
    (and ``key``, ``value``, ``proj_attn``; weights and biases)."""
    paths = [
        name
        for name, module in model.named_modules()
        if getattr(module, "_from_deprecated_attn_block", False)
    ]
    if not paths:
        return []
    old = "|".join(_DEPRECATED_ATTENTION)
    pattern = re.compile(rf"^({'|'.join(re.escape(p) for p in paths)})\.({old})\.(weight|bias)$")

    def rename(name: str) -> str:
        m = pattern.match(name)
        if m is None:
            return name
        return f"{m.group(1)}.{_DEPRECATED_ATTENTION[m.group(2)]}.{m.group(3)}"

    return [rename]


def keep_fp32_pattern(model: nn.Module, dtype: torch.dtype | None) -> re.Pattern[str] | None:
    """diffusers' ``_keep_in_fp32_modules`` under an explicit ``dtype``, as one regex: a name one
    of whose dotted parts is such a module (``"norm1"`` keeps ``blocks.0.norm1.weight``, not
    ``blocks.0.norm10.weight``)."""
    modules = getattr(model, "_keep_in_fp32_modules", None)
    if dtype is None or not modules:
        return None
    if isinstance(modules, str):
        modules = [modules]
    parts = "|".join(re.escape(m) for m in modules if m)
    return re.compile(rf"(?:^|\.)(?:{parts})(?:\.|$)") if parts else None


class DiffusersHooks(ModelHooks):
    """Names, dtype rules and finishing of a diffusers ``ModelMixin``.

    ``name_or_path``: what the caller named the model with, as given (registered as the
    config's ``_name_or_path``, as diffusers registers it, and named in the warnings; ``None``:
    loaded from a state dict, nothing registered);
    ``sharded``: the checkpoint is a sharded one (diffusers renames deprecated attention keys in
    single files only); ``warn``: say what
    is missing, unused or re-initialized in diffusers' words, on diffusers' logger."""

    def __init__(self, *, name_or_path: Any, sharded: bool, warn: bool = True) -> None:
        self.name_or_path = name_or_path
        self.sharded = sharded
        self.warn = warn

    def renames(self, model: nn.Module, source: str) -> Sequence[Rename] | Callable[[], Any]:
        return [] if self.sharded else deprecated_attention_renames(model)

    def resolve_names(self, model: nn.Module) -> Callable[[str, str, set[str]], str] | None:
        return lambda name, stored, model_names: name

    def auto_dtype(self, ckpt: OpenCheckpoint) -> torch.dtype | None:
        # diffusers without torch_dtype: each tensor takes the skeleton's dtype, built under
        # torch's default one
        return torch.get_default_dtype()

    def keep_fp32(self, model: nn.Module, dtype: torch.dtype | None) -> re.Pattern[str] | None:
        return keep_fp32_pattern(model, dtype)

    def finish(
        self,
        model: nn.Module,
        *,
        directory: Path | None,
        built_here: bool,
        device_map: DeviceMap | None,
        report: LoadReport,
    ) -> None:
        register = getattr(model, "register_to_config", None)
        # from state_dict= (no name): the config stays as from_config built it
        if built_here and register is not None and self.name_or_path is not None:
            register(_name_or_path=self.name_or_path)
        if self.warn:
            name = "state_dict" if self.name_or_path is None else self.name_or_path
            warn_like_diffusers(model, name, report)


def warn_like_diffusers(model: nn.Module, name_or_path: Any, report: LoadReport) -> None:
    """The warnings diffusers' ``_load_pretrained_model`` gives, in its words, on its logger:
    unused checkpoint tensors, model tensors the checkpoint lacks (fastload initializes them the
    model's own way, where diffusers would leave them on ``meta``), and tensors re-initialized
    because their shapes differ (``ignore_mismatched_sizes=True``)."""
    logger = logging.getLogger(DIFFUSERS_LOGGER)
    cls = type(model).__name__
    if report.unexpected:
        logger.warning(
            f"Some weights of the model checkpoint at {name_or_path} were not used when "
            f"initializing {cls}: \n {[', '.join(report.unexpected)]}"
        )
    if report.missing:
        logger.warning(
            f"Some weights of {cls} were not initialized from the model checkpoint at "
            f"{name_or_path} and are newly initialized: {list(report.missing)}\nYou should "
            "probably TRAIN this model on a down-stream task to be able to use it for "
            "predictions and inference."
        )
    if report.mismatched:
        lines = "\n".join(
            f"- {key}: found shape {torch.Size(stored)} in the checkpoint and "
            f"{torch.Size(shape)} in the model instantiated"
            for key, stored, shape in report.mismatched
        )
        logger.warning(
            f"Some weights of {cls} were not initialized from the model checkpoint at "
            f"{name_or_path} and are newly initialized because the shapes did not match:\n"
            f"{lines}\nYou should probably TRAIN this model on a down-stream task to be able to "
            "use it for predictions and inference."
        )
