"""The answers of a transformers model to the core pipeline's questions
(:mod:`fastload.core.plan.hooks`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fastload.core.plan.hooks import FamilyShards, ModelHooks, Operation
from fastload.families import is_transformers_model
from fastload.hf.conversions import transformers_merges
from fastload.hf.dtype_rules import auto_dtype, cast_kept_integers, keep_fp32_pattern
from fastload.hf.finish import finish_transformers
from fastload.hf.initialize import HF_FLAG, initialize_missing, prepare, recompute_buffers
from fastload.hf.renames import transformers_prefix_rule, transformers_renames

if TYPE_CHECKING:
    from fastload.core.checkpoint.opened import OpenCheckpoint
    from fastload.core.devices.device_map import DeviceMap
    from fastload.core.model.keys import KeyRules
    from fastload.core.model.tying import Slot
    from fastload.core.plan.hooks import Merge
    from fastload.core.plan.report import LoadReport
    from fastload.hf.quantized import Quantization


#: transformers' flag on a parameter it initialized or loaded (``_is_hf_initialized``): a
#: skeleton's flag is not carried over to the parameter that replaces it
TRANSFORMERS_FLAGS = frozenset({HF_FLAG})


class TransformersHooks(ModelHooks):
    """Renames, authorized names, fp32 modules and finishing of a transformers model.

    ``generation_config`` (transformers' option of that name) replaces the checkpoint's after
    loading; ``config`` is the config the model is built from (for ``dtype="auto"``).
    ``contract=True`` (under the patch): what loads at all is transformers' rule: a checkpoint
    none of whose tensors matches loads with every tensor missing, and of two checkpoint tensors
    mapping onto one model tensor the first in transformers' order loads.
    """

    def __init__(
        self, *, generation_config: Any = None, config: Any = None, contract: bool = False
    ) -> None:
        self.generation_config = generation_config
        self.config = config
        self.contract = contract
        #: the names kept in float32 in this load (fastload.hf.dtype_rules)
        self.keep_fp32_names: re.Pattern[str] | None = None
        #: transformers' tensor parallelism (fastload.hf.dtensor_tp), when asked for
        self.tp: Any = None
        #: where the checkpoint's side files (generation_config.json) are, when the core's
        #: location has no local directory (a checkpoint in object storage, fetched alongside)
        self.directory: Path | None = None
        #: transformers' quantizer of a pre-quantized checkpoint (fastload.hf.quantized)
        self.quantization: Quantization | None = None
        #: the checkpoint and the load operations planned on it (fastload.hf.load_ops)
        self._operations: tuple[Any, dict[str, Any]] | None = None

    def collision_order(self) -> Callable[[str], Any] | None:
        if not self.contract:
            return None
        try:  # transformers visits checkpoint names in this order; the first one loads
            from transformers.core_model_loading import dot_natural_key
        except ImportError:
            from fastload.hf.conversions import _natural as dot_natural_key
        return dot_natural_key

    def refuse_no_match(self) -> bool:
        return not self.contract

    def resolve_names(self, model: nn.Module) -> Callable[[str, str, set[str]], str] | None:
        if not self.contract:
            return None  # fastload's: a name that is a model name stays (README)
        return transformers_prefix_rule(getattr(model, "base_model_prefix", None))

    def tie_source_order(self, model: nn.Module) -> Callable[[str], Any] | None:
        # transformers ties after loading, pair by pair in `all_tied_weights_keys` order
        # ({target: source}, one source per group): the source keeps its stored values if the
        # checkpoint has it, else the first stored target in that order gives them to it, and
        # every other stored member is compared with those and untied if it differs
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        rank = {source: 0 for source in tied.values()}
        for i, target in enumerate(tied):
            rank.setdefault(target, i + 1)
        last = len(rank) + 1
        return lambda name: rank.get(name, last)

    def merges(
        self,
        model: nn.Module,
        ckpt: OpenCheckpoint,
        model_keys: set[str],
        rules: KeyRules,
    ) -> dict[str, Merge]:
        # the quantizer's load operations first: the stored tensors they take are no names a
        # merge needs (transformers' conversion mapping is built only if another name is not
        # a model name: it compiles ~1000 regexes)
        planned = self._plan_operations(model, ckpt, model_keys, rules)
        taken = {name for op in planned.values() for name in op.names()}
        return transformers_merges(
            model, ckpt, model_keys, rules, quantizer=self._quantizer(), taken=taken
        )

    def _plan_operations(
        self, model: nn.Module, ckpt: OpenCheckpoint, model_keys: set[str], rules: KeyRules
    ) -> dict[str, Any]:
        quant = self.quantization
        if quant is None or not quant.operation:
            return {}
        if self._operations is None or self._operations[0] is not ckpt:
            from fastload.hf.load_ops import plan_operations

            planned = plan_operations(quant.quantizer, model, ckpt, model_keys, rules)
            self._operations = (ckpt, planned)
        return self._operations[1]

    def operations(
        self,
        model: nn.Module,
        ckpt: OpenCheckpoint,
        model_keys: set[str],
        rules: KeyRules,
    ) -> dict[str, Operation]:
        planned = self._plan_operations(model, ckpt, model_keys, rules)
        return {t: Operation(t, op.names()) for t, op in planned.items()}

    def auto_dtype(self, ckpt: OpenCheckpoint) -> torch.dtype | None:
        return auto_dtype(self.config, ckpt)

    def renames(self, model: nn.Module, source: str) -> Callable[[], Any]:
        # Built only if some name does not match directly (transformers compiles ~1000 regexes).
        return functools.partial(transformers_renames, model, source, quantizer=self._quantizer())

    def _quantizer(self) -> Any:
        return self.quantization.quantizer if self.quantization is not None else None

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
        self.keep_fp32_names = keep_fp32_pattern(model, dtype)
        return self.keep_fp32_names

    def prepare(self, model: nn.Module) -> None:
        prepare(model)

    def initialize(self, model: nn.Module, targets: dict[str, torch.Tensor]) -> set[str]:
        return initialize_missing(model, targets)

    def dropped_attributes(self) -> frozenset[str]:
        return TRANSFORMERS_FLAGS

    def shard(self, model: nn.Module) -> FamilyShards | None:
        if self.tp is None:
            return None
        from fastload.hf.dtensor_tp import shard_like_transformers

        # transformers builds every state-dict tensor on meta; fastload's skeleton keeps
        # persistent buffers real: they are read (or initialized) like parameters
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    module._buffers[name] = buffer.to("meta")
        tied = set(getattr(model, "all_tied_weights_keys", None) or ())
        return FamilyShards(shard_like_transformers(model, self.tp), later=tied)

    def finish(
        self,
        model: nn.Module,
        *,
        directory: Path | None,
        built_here: bool,
        device_map: DeviceMap | None,
        report: LoadReport,
    ) -> None:
        if self._operations is not None:  # the quantizer's load operations, after the read
            from fastload.hf.load_ops import run_operations

            ckpt, planned = self._operations
            self._operations = None
            assert self.quantization is not None
            seconds, read = run_operations(planned, model, ckpt)
            self.quantization.seconds += seconds
            report.bytes_written += read
        if self.tp is not None:  # missing keys, buffers and ties, as transformers' TP loading
            from fastload.hf.dtensor_tp import finish_like_transformers

            missing = [*report.missing, *report.authorized_missing, *report.initialized]
            missing += [name for name, _, _ in report.mismatched]
            finish_like_transformers(model, self.tp, missing=missing)
        elif built_here:  # non-persistent buffers as transformers computes them
            recompute_buffers(model, every_module=self.contract)
        if self.contract and self.keep_fp32_names is not None:
            cast_kept_integers(model, self.keep_fp32_names, report)
        finish_transformers(
            model,
            directory=directory if directory is not None else self.directory,
            load_generation_config=built_here,
            generation_config=self.generation_config,
            device_map=device_map,
        )
        if self.quantization is not None:  # last, as in transformers' from_pretrained
            not_loaded = {*report.missing, *report.authorized_missing, *report.initialized}
            not_loaded |= {name for name, _, _ in report.mismatched}
            self.quantization.postprocess(model, not_loaded)
            report.quant_method = self.quantization.method
            report.quant_seconds = self.quantization.seconds


class ContainerHooks(ModelHooks):
    """A plain module holding transformers models (a ``BertModel`` inside a user's tagger):
    its missing tensors inside them are initialized the transformers way."""

    def initialize(self, model: nn.Module, targets: dict[str, torch.Tensor]) -> set[str]:
        return initialize_missing(model, targets)

    def dropped_attributes(self) -> frozenset[str]:
        return TRANSFORMERS_FLAGS


def family_hooks(module: nn.Module) -> ModelHooks:
    """The hooks of a model that the caller built or that a factory built: transformers' for a
    transformers model, :class:`ContainerHooks` for a module holding some, a plain module's
    otherwise."""
    if is_transformers_model(module):
        return TransformersHooks()
    if any(is_transformers_model(m) for m in module.modules()):
        return ContainerHooks()
    return ModelHooks()
