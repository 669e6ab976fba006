"""Quantization methods with a load operation: transformers' operation run on tensors fastload
read (FP8 fine-grained blocks and gpt-oss' MXFP4 experts, which transformers dequantizes on a
CPU).

A quantizer whose load mode has an operation (``get_load_operations``: ``Fp8Dequantize``,
``Mxfp4Dequantize``) adds general ``WeightConverter`` entries (``get_weight_conversions``): the
stored tensors of one model tensor (``weight``, ``weight_scale_inv``, ``activation_scale``;
``gate_up_proj_blocks``, ``gate_up_proj_scales``) are collected by source pattern and the
operation makes the model tensor of them. fastload matches the stored names to those converters
as transformers does (its renames first), checks them from the headers before anything is read
(:mod:`fastload.hf.load_op_checks`), and after the read of everything else runs each operation
in the order of the file: its inputs read by the engine into temporaries, transformers' own
``convert`` run on them, the result put in the model, the temporaries dropped (one operation's
inputs in memory at a time, never a second copy of the checkpoint). fastload never computes
what the operation does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import ModelMismatchError, UnsupportedError
from fastload.core.model import keys as keymod
from fastload.core.reads import reading
from fastload.hf.load_op_checks import check
from fastload.hf.renames import transformers_renames


@dataclass
class PlannedOperation:
    """One model tensor made by a converter's operations from the stored tensors ``inputs``
    (source pattern -> stored names)."""

    target: str
    converter: Any
    inputs: dict[str, list[str]] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [name for names in self.inputs.values() for name in names]


def load_op_converters(quantizer: Any) -> list[Any]:
    """The quantizer's general converters (its load operation alone on any parameter)."""
    return list(quantizer.get_weight_conversions())


def plan_operations(
    quantizer: Any,
    model: nn.Module,
    ckpt: Any,
    model_keys: set[str],
    rules: keymod.KeyRules,
) -> dict[str, PlannedOperation]:
    """The model tensors the quantizer's load operation makes, checked from the headers: a
    quantized weight without its scale, a scale without its weight, of a dtype the operation
    does not read or of the wrong shape, or a weight not of the model's shape, is refused
    naming the stored tensor, before any tensor is read. A tensor stored as the model holds it
    (a norm, the embeddings: the operation only casts it) is left to the ordinary read, but for
    an operation that passes such a tensor through uncast (:data:`PASS_THROUGH`) when its
    stored dtype is not the model's: transformers then keeps the stored dtype, and so does the
    operation run here."""
    converters = load_op_converters(quantizer)
    if not converters:
        return {}
    prefix = rules.base_model_prefix
    tensors = model.state_dict(keep_vars=True)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    renames: list[Any] | None = None  # transformers' renames, built only if a name needs them
    found: dict[str, PlannedOperation] = {}
    for stored in ckpt.tensors:
        name = rules.rename(stored)
        hit = _match(converters, name, prefix, model_keys)
        if hit is None and name not in model_keys:
            # not taken as it is: transformers' renames first (legacy names, a quantizer's own,
            # such as FP8's .scale to .weight_scale_inv); building them compiles ~1000 regexes
            if renames is None:
                renames = transformers_renames(model, rules.source, quantizer)
            renamed = name
            for r in renames:
                renamed = r(renamed)
            hit = _match(converters, renamed, prefix, model_keys) if renamed != name else None
        if hit is not None:
            target, pattern, converter = hit
            op = found.setdefault(target, PlannedOperation(target, converter))
            op.inputs.setdefault(pattern, []).append(stored)
    planned = {}
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    tied_names = set(tied) | set(tied.values())
    for target, op in found.items():
        if check(op, ckpt, shapes[target], quantizer, rules.source, model):
            planned[target] = op
        elif _uncast(op, ckpt, tensors[target]):
            if target in tied_names:
                stored = ckpt.tensors[op.names()[0]]
                raise UnsupportedError(
                    f"{ckpt.file_path(stored)}: transformers keeps {stored.name!r} in its stored "
                    f"{stored.st_dtype} ({type(op.converter.operations[0]).__name__} passes it "
                    f"through uncast), not the model's {tensors[target].dtype}, and the model "
                    "ties it to another tensor; fastload does not load it so: load it in the "
                    "stored dtype (dtype='auto'), or with transformers"
                )
            planned[target] = op
    for target in planned:
        module, _, leaf = target.rpartition(".")
        if leaf not in model.get_submodule(module)._parameters:
            raise UnsupportedError(
                f"{rules.source}: {target!r} is made by transformers' load operation but is "
                "not a parameter of the model; fastload does not load such a checkpoint"
            )
    return planned


def _match(
    converters: list[Any], name: str, prefix: str | None, model_keys: set[str]
) -> tuple[str, str, Any] | None:
    """The model tensor, source pattern and converter the first converter whose pattern matches
    ``name`` takes it to, if that is a model tensor."""
    for converter in converters:
        converted, pattern = converter.rename_source_key(name)
        if pattern is None:
            continue
        target = keymod.adjust(converted, prefix, model_keys)
        return (target, pattern, converter) if target in model_keys else None
    return None


#: operations that give a tensor they collected alone back as it is, uncast (bitsandbytes'
#: deserializers: transformers' loader then sets it in the stored dtype, whatever dtype the
#: model was asked in)
PASS_THROUGH = frozenset({"Bnb4bitDeserialize", "Bnb8bitDeserialize"})


def _uncast(op: PlannedOperation, ckpt: Any, param: torch.Tensor) -> bool:
    """Whether ``op`` runs on a tensor stored as the model holds it to keep its stored dtype."""
    names = op.names()
    return (
        type(op.converter.operations[0]).__name__ in PASS_THROUGH
        and len(names) == 1
        and ckpt.tensors[names[0]].dtype != param.dtype
    )


def run_operations(
    planned: dict[str, PlannedOperation],
    model: nn.Module,
    ckpt: Any,
    *,
    threads: int | None = None,
) -> tuple[float, int]:
    """Runs every planned operation in the order of the file; returns the seconds spent in
    transformers' operations (apart from the reads) and the bytes read."""
    config = getattr(model, "config", None)
    first = {
        t: min((ckpt.tensors[n] for n in op.names()), key=lambda s: (s.file, s.begin))
        for t, op in planned.items()
    }
    order = sorted(planned, key=lambda t: (first[t].file, first[t].begin))
    seconds, read = 0.0, 0
    for target in order:
        op = planned[target]
        collected, read_now = _read_inputs(op, ckpt, threads)
        read += read_now
        start = time.perf_counter()
        for operation in op.converter.operations:
            collected = operation.convert(
                collected,
                source_patterns=op.converter.source_patterns,
                target_patterns=op.converter.target_patterns,
                full_layer_name=target,
                model=model,
                config=config,
                missing_keys=None,
            )
        seconds += time.perf_counter() - start
        _place(model, target, _result(collected, target), ckpt.file_path(first[target]), op)
        del collected  # the temporaries go with it
    return seconds, read


def _read_inputs(
    op: PlannedOperation, ckpt: Any, threads: int | None
) -> tuple[dict[str, list[torch.Tensor]], int]:
    """The operation's inputs read by the engine into new tensors (one call per file)."""
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[int, list[tuple[str, torch.Tensor, None]]] = {}
    for name in op.names():
        stored = ckpt.tensors[name]
        tensors[name] = torch.empty(stored.torch_shape, dtype=stored.dtype)
        by_file.setdefault(stored.file, []).append((name, tensors[name], None))
    read = sum(reading.fill(ckpt.files[i], items, threads) for i, items in by_file.items())
    collected = {p: [tensors[n] for n in names] for p, names in op.inputs.items()}
    return collected, read


def _result(collected: dict[str, Any], target: str) -> torch.Tensor:
    value = collected.get(target, next(iter(collected.values()), None))
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise UnsupportedError(
            f"transformers' load operation for {target!r} made {type(value).__name__}, not "
            "one tensor; fastload does not load such a checkpoint"
        )
    return value


def _place(model: nn.Module, target: str, value: torch.Tensor, where: str, op: Any) -> None:
    """``value`` into the model as transformers' loader sets it (``set_param_for_module``): a
    parameter the operation made (bitsandbytes' ``Params4bit``, ``Int8Params``, with their
    quant state) as it is, any other tensor in a new ``Parameter``; its shape checked against
    the model's unless the quantizer quantizes that parameter (a packed weight), its dtype
    unless the operation passed it through uncast (:data:`PASS_THROUGH`)."""
    module_name, _, leaf = target.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters[leaf]
    assert old is not None
    quantizer = getattr(op.converter.operations[0], "hf_quantizer", None)
    packed = quantizer is not None and quantizer.param_needs_quantization(model, target)
    uncast = type(op.converter.operations[0]).__name__ in PASS_THROUGH and len(op.names()) == 1
    if not packed and (
        tuple(value.shape) != tuple(old.shape) or (value.dtype != old.dtype and not uncast)
    ):
        raise ModelMismatchError(
            f"{where}: transformers' load operation made {target!r} "
            f"{list(value.shape)} {value.dtype}, the model's is {list(old.shape)} {old.dtype}"
        )
    if not isinstance(value, nn.Parameter):
        value = nn.Parameter(value, requires_grad=value.is_floating_point())
    module._parameters[leaf] = value


__all__ = [
    "PASS_THROUGH",
    "PlannedOperation",
    "load_op_converters",
    "plan_operations",
    "run_operations",
]
