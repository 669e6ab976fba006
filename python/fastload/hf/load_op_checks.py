"""Header checks of the stored tensors a quantizer's load operation makes a model tensor of
(:mod:`fastload.hf.load_ops`), one checker per operation fastload runs: what transformers'
operation needs of its inputs (dtypes, shapes, the companions beside a quantized tensor),
checked from the headers before anything is read, every refusal naming the stored tensor and
what was expected.

* ``Fp8Dequantize`` (``quant_method: fp8``): an FP8 ``weight`` of the model's shape and its
  ``weight_scale_inv``, one float scale per block of the config's ``weight_block_size``
  (``[ceil(rows/128), ceil(cols/128)]``), the blocks dividing the weight.
* ``Mxfp4Dequantize`` (``quant_method: mxfp4``, gpt-oss' experts): ``<proj>_blocks``, ``uint8``
  ``[experts, rows, cols/32, 16]`` (32 FP4 values of one row in 16 bytes, the low nibble first)
  and ``<proj>_scales``, ``uint8`` ``[experts, rows, cols/32]`` (a power-of-two exponent biased
  by 127 per 32 values), of the model's ``[experts, cols, rows]`` expert tensor (transformers'
  operation transposes the rows it unpacks).
* ``Bnb4bitDeserialize``, ``Bnb8bitDeserialize`` (``quant_method: bitsandbytes``):
  :mod:`fastload.hf.load_op_checks_bnb`.
* ``CompressedTensorsDequantize`` (``quant_method: compressed-tensors``, ``dequantize: true``):
  :mod:`fastload.hf.load_op_checks_ct`.
* ``TorchAoDeserialize`` (``quant_method: torchao``): :mod:`fastload.hf.load_op_checks_torchao`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fastload.core.basics.dtypes import CONVERTIBLE
from fastload.core.basics.errors import CheckpointError, ModelMismatchError, UnsupportedError
from fastload.hf.load_op_checks_bnb import check_4bit, check_8bit

#: stored dtypes of an FP8 block scale transformers' dequantize reads (float, or E8M0 exponents)
SCALE_DTYPES = frozenset({"F32", "BF16", "F16", "U8", "F8_E8M0"})
#: MXFP4: FP4 values per scale, and the stored dtype of the packed values and of the exponents
MX_BLOCK = 32
MX_DTYPE = "U8"


def check(
    op: Any, ckpt: Any, want: tuple[int, ...], quantizer: Any, source: str, model: Any
) -> bool:
    """Whether ``op`` (a :class:`~fastload.hf.load_ops.PlannedOperation`) runs the operation
    (``False``: a tensor stored as the model holds it, which the operation only casts); raises
    for inputs the operation cannot make the model's tensor ``want`` of. A float tensor stored
    without its quant state where the quantizer's module holds a quantized one (bitsandbytes'
    ``Int8Params``: a checkpoint saved unquantized under a bitsandbytes config) is refused
    naming it: transformers would put the float tensor in the quantized module as it is."""
    operation = type(op.converter.operations[0]).__name__
    checker = CHECKERS.get(operation)
    if checker is None:
        raise UnsupportedError(
            f"{source}: transformers' load operation {operation} for {op.target!r} is not one "
            f"fastload runs ({', '.join(sorted(CHECKERS))}): load it with transformers"
        )
    first, *companions = op.converter.source_patterns
    # the quantized tensor: the first source pattern, or one the format stores instead of it
    # (compressed-tensors' packed formats: weight_packed)
    first = next((p for p in _MAIN.get(operation, ()) if op.inputs.get(p)), first)
    companions = [p for p in op.converter.source_patterns if p != first]
    weights = op.inputs.get(first, [])
    scale_pattern = next((p for p in companions if _SCALE[operation](p)), None)
    scales = op.inputs.get(scale_pattern, []) if scale_pattern else []
    if not weights:
        stored = ckpt.tensors[op.names()[0]]
        wanted = " or ".join(repr(p) for p in _MAIN.get(operation, (first,)))
        raise CheckpointError(
            f"{ckpt.file_path(stored)}: tensor {stored.name!r} has no {wanted} beside it "
            f"(the model's {op.target!r} is made of them)"
        )
    weight = ckpt.tensors[weights[0]]
    if not scales:
        missing = stem(weight, first) + (scale_pattern or companions[0])
        if weight.st_dtype not in CONVERTIBLE:
            raise CheckpointError(
                f"{ckpt.file_path(weight)}: tensor {weight.name!r} is quantized "
                f"({weight.st_dtype}) but its scale {missing!r} is missing"
            )
        if quantizer.param_needs_quantization(model, op.target):
            raise CheckpointError(
                f"{ckpt.file_path(weight)}: tensor {weight.name!r} is stored unquantized "
                f"({weight.st_dtype}) where transformers' quantizer makes the model's "
                f"{op.target!r} quantized, of it and its scale {missing!r}, which is missing "
                "(a checkpoint saved before quantizing, under a quantization_config?)"
            )
        return False  # stored as the model holds it: transformers' operation casts it
    checker(op, ckpt, weight, ckpt.tensors[scales[0]], want, quantizer)
    return True


def _fp8(
    op: Any, ckpt: Any, weight: Any, scale: Any, want: tuple[int, ...], quantizer: Any
) -> None:
    size = getattr(quantizer.quantization_config, "weight_block_size", None)
    block = (int(size[0]), int(size[1])) if size else None
    got = weight.torch_shape
    if got != want:
        raise ModelMismatchError(
            f"{ckpt.file_path(weight)}: tensor {weight.name!r} has shape {list(got)}, the "
            f"model's {op.target!r} has shape {list(want)}"
        )
    if scale.st_dtype not in SCALE_DTYPES:
        raise CheckpointError(
            f"{ckpt.file_path(scale)}: tensor {scale.name!r} has dtype {scale.st_dtype}; a "
            f"block scale is one of {', '.join(sorted(SCALE_DTYPES))}"
        )
    rows, cols = (got[-2], got[-1]) if len(got) >= 2 else (1, 1)
    grid = tuple(scale.shape[-2:]) if len(scale.shape) >= 2 else None
    expected = (math.ceil(rows / block[0]), math.ceil(cols / block[1])) if block else grid
    if (
        grid is None
        or tuple(scale.shape[:-2]) != tuple(got[:-2])
        or grid != expected
        or rows % grid[0]
        or cols % grid[1]
    ):
        shown = list(got[:-2]) + list(expected) if expected else "a grid dividing it"
        raise ModelMismatchError(
            f"{ckpt.file_path(scale)}: tensor {scale.name!r} has shape {list(scale.shape)}; "
            f"the scale of {weight.name!r} {list(got)} in blocks of {list(block or ())} has "
            f"shape {shown} (whose cells divide the weight: transformers' "
            f"{type(op.converter.operations[0]).__name__} needs it)"
        )


def _mxfp4(
    op: Any, ckpt: Any, blocks: Any, scales: Any, want: tuple[int, ...], quantizer: Any
) -> None:
    if len(want) != 3 or want[1] % MX_BLOCK:
        raise UnsupportedError(
            f"{ckpt.file_path(blocks)}: the model's {op.target!r} has shape {list(want)}, not "
            f"[experts, cols, rows] with cols a multiple of {MX_BLOCK}: transformers' "
            "Mxfp4Dequantize does not make it; load it with transformers"
        )
    experts, cols, rows = want
    expected = {
        blocks.name: (blocks, [experts, rows, cols // MX_BLOCK, MX_BLOCK // 2]),
        scales.name: (scales, [experts, rows, cols // MX_BLOCK]),
    }
    for name, (stored, shape) in expected.items():
        if stored.st_dtype != MX_DTYPE:
            raise CheckpointError(
                f"{ckpt.file_path(stored)}: tensor {name!r} has dtype {stored.st_dtype}; "
                f"MXFP4 {'exponents' if stored is scales else 'packed values'} are stored "
                f"as {MX_DTYPE}"
            )
        if list(stored.shape) != shape:
            layout = "[experts, out, in/32, 16]" if stored is blocks else "[experts, out, in/32]"
            raise ModelMismatchError(
                f"{ckpt.file_path(stored)}: tensor {name!r} has shape {list(stored.shape)}; "
                f"the model's {op.target!r} is {list(want)} ([experts, in, out]), stored in "
                f"MXFP4 as {shape} ({layout}: {MX_BLOCK} values per scale, two per byte)"
            )


def stem(weight: Any, pattern: str) -> str:
    """The stored name of ``weight`` less its source pattern (``...q_proj.``)."""
    if weight.name.endswith(pattern):
        return weight.name[: -len(pattern)]
    return weight.name.rpartition(".")[0] + "."


def _compressed_tensors(
    op: Any, ckpt: Any, weight: Any, scale: Any, want: tuple[int, ...], quantizer: Any
) -> None:
    from fastload.hf.load_op_checks_ct import check_compressed

    check_compressed(op, ckpt, weight, scale, want, quantizer)


def _torchao(
    op: Any, ckpt: Any, qdata: Any, scale: Any, want: tuple[int, ...], quantizer: Any
) -> None:
    from fastload.hf.load_op_checks_torchao import check_torchao

    check_torchao(op, ckpt, qdata, scale, want, quantizer)


CHECKERS: dict[str, Callable[..., None]] = {
    "Fp8Dequantize": _fp8,
    "Mxfp4Dequantize": _mxfp4,
    "Bnb4bitDeserialize": check_4bit,
    "Bnb8bitDeserialize": check_8bit,
    "CompressedTensorsDequantize": _compressed_tensors,
    "TorchAoDeserialize": _torchao,
}
#: the source patterns of the quantized tensor, where a format stores another than the first
_MAIN = {"CompressedTensorsDequantize": ("weight", "weight_packed")}
#: which of the operation's companion patterns holds the scale, by operation
_SCALE: dict[str, Callable[[str], bool]] = {
    "Fp8Dequantize": lambda p: p.endswith("scale_inv"),
    "Mxfp4Dequantize": lambda p: p.endswith("_scales"),
    "Bnb4bitDeserialize": lambda p: p == "weight.absmax",
    "Bnb8bitDeserialize": lambda p: p == "SCB",
    "CompressedTensorsDequantize": lambda p: p == "weight_scale",
    "TorchAoDeserialize": lambda p: p.endswith("_scale") and not p.endswith("per_tensor_scale"),
}

__all__ = ["CHECKERS", "MX_BLOCK", "SCALE_DTYPES", "check", "stem"]
