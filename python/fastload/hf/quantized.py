"""Pre-quantized checkpoints: transformers' quantizer decides what the model is, fastload reads.

transformers owns what a quantization method means: which modules are swapped, which tensors they
hold, in which dtypes, and what runs on them after loading. fastload drives transformers' own
quantizer through the hooks its ``from_pretrained`` calls, in the same order, and reads every
tensor with the engine:

1. ``get_hf_quantizer`` (its environment checks, their errors, the config merged) and
   ``update_dtype``;
2. ``preprocess_model`` on the meta skeleton (the module swaps; new parameters land on meta);
3. ``get_model_conversion_mapping(model, key_mapping, quantizer)`` (:mod:`fastload.hf.renames`,
   :mod:`fastload.hf.conversions`);
4. the read: every stored tensor goes straight into the parameter the swapped module declares
   (the core's plan: shapes and dtypes checked from the headers before anything is read);
5. ``model.hf_quantizer = quantizer`` and ``postprocess_model``.

Served are the formats stored as they run: the quantizer's load mode has no operation, so each
parameter is the stored tensor itself (:data:`SERVED_METHODS`, tested against transformers);
and the methods whose load operation fastload runs on tensors it read
(:data:`OPERATION_METHODS`, :mod:`fastload.hf.load_ops`: FP8 blocks, MXFP4 experts and
compressed-tensors dequantized, bitsandbytes and torchao deserialized). Any other method, and a
method whose quantizer asks for another load operation here (MXFP4 kept packed, a mode not
listed), is refused with ``UnsupportedError`` naming the method, and under the patch goes to
transformers' own loader; fastload never reimplements a method.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import CheckpointError, FastloadError, UnsupportedError, also_as
from fastload.hf.context import quantization_method
from fastload.hf.meta_compression import (
    compress_once_per_kind,
    no_clearing_of_fresh_modules,
    plain_replacement_of_layer_tensors,
)

#: the ``quant_method`` values fastload reads itself (stored as they run, without a load
#: operation, checked against transformers by tests/hf/test_hf_quantized.py, test_hf_gptq_awq.py
#: and, for FP8 kept in FP8 as transformers keeps it on a GPU, test_hf_fp8_dequantize.py)
SERVED_METHODS = frozenset({"compressed-tensors", "gptq", "awq", "fp8"})
#: the ``quant_method`` values whose quantizer's load operation fastload runs on tensors it read
#: (:mod:`fastload.hf.load_ops`), with the load mode it runs: FP8 blocks and gpt-oss' MXFP4
#: experts dequantized (what transformers does on a machine without a GPU, or with
#: ``dequantize=True``), bitsandbytes deserialized (its CPU backend), compressed-tensors with
#: ``dequantize: true`` (compressed-tensors is also in :data:`SERVED_METHODS`: without it)
OPERATION_METHODS = {
    "fp8": "dequantize",
    "mxfp4": "dequantize",
    "bitsandbytes": "deserialize",
    "compressed-tensors": "dequantize",
    "torchao": "deserialize",
}


@dataclass
class Quantization:
    """transformers' quantizer of one load, and what running its hooks cost."""

    quantizer: Any
    method: str
    #: seconds spent in the quantizer's hooks and load operations, apart from reads
    seconds: float = 0.0
    #: the checkpoint files, for ``preprocess_model``
    files: list[str] = field(default_factory=list)
    #: whether the quantizer has a load operation fastload runs (fastload.hf.load_ops)
    operation: bool = False
    #: the device map the quantizer made of the one it was given (``update_device_map``: of
    #: none, GPTQ's and bitsandbytes' ``{"": cpu}`` on a CPU), passed to ``preprocess_model`` as
    #: transformers passes it (GPTQ's kernel choice reads it, gptqmodel sets ``hf_device_map``)
    device_map: Any = None

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the quantizer builds the model in (``update_dtype``); a quantizer that
        changes it is refused: fastload's dtype rules were already applied to the plan."""
        wanted = self.quantizer.update_dtype(dtype)
        if wanted != dtype:
            raise UnsupportedError(
                f"quant_method={self.method!r}: transformers' quantizer builds the model in "
                f"{wanted}, not {dtype}; fastload does not load such a checkpoint: load it with "
                "transformers"
            )
        return dtype

    def preprocess(self, model: nn.Module, dtype: torch.dtype | None) -> None:
        """``preprocess_model`` on the skeleton (the module swaps), on the meta device as
        transformers runs it; compressed-tensors' compressors run once per kind of layer, and
        its layers, fresh, are not cleared of quantization parameters they do not hold
        (:mod:`fastload.hf.meta_compression`)."""
        start = time.perf_counter()
        try:
            with ExitStack() as stack:
                if self.method == "compressed-tensors":
                    stack.enter_context(compress_once_per_kind())
                    stack.enter_context(no_clearing_of_fresh_modules())
                    stack.enter_context(plain_replacement_of_layer_tensors())
                stack.enter_context(_no_empty_plan_updates(self.quantizer))
                stack.enter_context(torch.device("meta"))
                self.quantizer.preprocess_model(
                    model=model,
                    dtype=dtype,
                    device_map=self.device_map,
                    checkpoint_files=self.files or None,
                )
        except ValueError as e:  # what the quantizer read of the files (torchao's metadata)
            if isinstance(e, FastloadError) or not self.files:
                raise
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise also_as(CheckpointError, e)(
                f"{', '.join(self.files)}: transformers' {self.method} quantizer cannot prepare "
                f"the model from this checkpoint ({type(e).__name__}: {text})"
            ) from e
        self.seconds += time.perf_counter() - start

    def postprocess(self, model: nn.Module, not_loaded: set[str]) -> None:
        """What transformers does once the tensors are in: each loaded parameter trainable if it
        is floating (its loader wraps every tensor it sets in a new ``Parameter`` so: a scale the
        quantizer declared frozen becomes trainable, an integer weight stays frozen), then
        ``model.hf_quantizer`` set and ``postprocess_model``. ``not_loaded``: the parameters
        the checkpoint did not fill (they keep their own flag)."""
        start = time.perf_counter()
        for name, param in model.named_parameters():
            if name not in not_loaded:
                param.requires_grad_(param.is_floating_point())
        model.hf_quantizer = self.quantizer
        self.quantizer.postprocess_model(model)
        self.seconds += time.perf_counter() - start


@contextmanager
def _no_empty_plan_updates(quantizer: Any) -> Iterator[None]:
    """Within the block, the quantizer's ``update_parallel_plan`` (transformers' own, run by
    ``preprocess_model`` on the model's tensor and expert parallel plans) returns at once where
    it plainly adds nothing to the plan (:func:`_adds_nothing`): it names every parameter of the
    model through a regular expression to learn which of its candidate keys are parameters,
    about 2 ms a call for a 1 GiB Llama. A quantizer with its own ``update_parallel_plan``
    keeps it. Set on the quantizer object alone, removed on leaving."""
    from transformers.quantizers.base import HfQuantizer

    if type(quantizer).update_parallel_plan is not HfQuantizer.update_parallel_plan:
        yield
        return
    original = quantizer.update_parallel_plan

    def update_parallel_plan(model: Any, plan: Any) -> None:
        if not _adds_nothing(quantizer, model, plan):
            original(model, plan)

    try:
        quantizer.update_parallel_plan = update_parallel_plan
    except AttributeError:  # an object that takes no attribute: transformers' method as it is
        yield
        return
    try:
        yield
    finally:
        if quantizer.__dict__.get("update_parallel_plan") is update_parallel_plan:
            del quantizer.update_parallel_plan


def _adds_nothing(quantizer: Any, model: nn.Module, plan: Any) -> bool:
    """Whether transformers' ``HfQuantizer.update_parallel_plan(model, plan)`` plainly adds
    nothing: it adds each key ``key + suffix`` (a key of the plan, a suffix of the quantizer's
    ``serialized_names``) not in the plan that is the name of a parameter with its layer
    numbers made ``*``. Such a name ends with the parameter's own name in its module, or ``*``;
    where no candidate does, none is a parameter (an empty plan has no candidate)."""
    if type(plan) is not dict:
        return False
    if not plan:
        return True
    try:
        names = quantizer.serialized_names
        suffixes = {n.removeprefix(p) for p, ns in names.items() for n in ns}
    except Exception:  # noqa: BLE001 - not the names transformers' method reads: as it is
        return False
    candidates = {key + suffix for key in plan for suffix in suffixes} - plan.keys()
    if not candidates:
        return True
    ends = {"*"} | {n for m in model.modules() for n, p in m._parameters.items() if p is not None}
    return not any(c.rpartition(".")[2] in ends for c in candidates)


def read_method(config: Any, source: Any) -> str | None:
    """The ``quant_method`` of ``config`` (``None``: not quantized) when it is one fastload may
    read; ``UnsupportedError`` naming it otherwise (whether its load mode here is one fastload
    runs is :func:`quantization_for`'s to tell)."""
    method = quantization_method(config)
    known = SERVED_METHODS | set(OPERATION_METHODS)
    if method is not None and method not in known:
        raise UnsupportedError(
            f"{source}: the config has a quantization_config (quant_method={method!r}); fastload "
            f"reads pre-quantized checkpoints of {', '.join(sorted(known))} only and "
            "never loads a quantized checkpoint as another model: load it with transformers"
        )
    return method


def quantization_for(
    config: Any,
    source: Any,
    *,
    files: Callable[[], list[str]] = list,
    device_map: Any = None,
) -> Quantization | None:
    """transformers' quantizer for ``config`` when it carries a quantization config (``None``
    otherwise); ``UnsupportedError`` naming the method when fastload does not read it. ``files``
    gives the checkpoint's local files (for ``preprocess_model``), asked only for a quantized
    checkpoint; ``device_map`` is the user's, given to the quantizer as transformers gives it
    (normalized by transformers' ``check_and_set_device_map``, then its ``validate_environment``
    and ``update_device_map``).

    transformers' own errors (a missing package, an environment its quantizer refuses) are
    raised as transformers raises them."""
    method = read_method(config, source)
    if method is None:
        return None
    from transformers.quantizers.auto import get_hf_quantizer

    if device_map is not None:
        from transformers.integrations.accelerate import check_and_set_device_map

        device_map = check_and_set_device_map(device_map)
    quantizer, _, device_map = get_hf_quantizer(config, None, device_map, True, {})
    if quantizer is None:  # transformers does not know the method (it warned): it would skip it
        raise UnsupportedError(
            f"{source}: transformers has no quantizer for quant_method={method!r}; load it with "
            "transformers"
        )
    settings = quantizer.quantization_config
    mode = "dequantize" if getattr(settings, "dequantize", False) else "deserialize"
    operation = quantizer.get_load_operations().get(mode)
    if operation is not None and OPERATION_METHODS.get(method) == mode:
        return Quantization(quantizer, method, files=files(), operation=True, device_map=device_map)
    if operation is not None or quantizer.get_weight_conversions():
        name = getattr(operation, "__name__", "a load operation")
        raise UnsupportedError(
            f"{source}: quant_method={method!r} loads here through transformers' {name} "
            f"({mode}); fastload reads formats stored as they run, without a load operation, "
            f"and runs {', '.join(f'{m} ({o})' for m, o in OPERATION_METHODS.items())} only: "
            "load it with transformers"
        )
    if method not in SERVED_METHODS:
        raise UnsupportedError(
            f"{source}: quant_method={method!r} loads here without dequantizing ({mode}), "
            "which fastload does not read yet: load it with transformers"
        )
    return Quantization(quantizer, method, files=files(), device_map=device_map)


__all__ = [
    "OPERATION_METHODS",
    "SERVED_METHODS",
    "Quantization",
    "quantization_for",
    "read_method",
]
