"""Header checks of compressed-tensors' stored tensors where transformers dequantizes them on
load (``quant_method: compressed-tensors`` with ``dequantize: true``: its
``CompressedTensorsDequantize`` on each dense module's tensors), from the config group that
quantizes the module (``scheme.weights``: type, bits, strategy, group or block size) and the
model's ``[out, in]`` weight:

* ``weight`` (int8, FP8: stored as it runs) of the model's shape; or ``weight_packed``: ints
  packed into ``I32`` ``[out, ceil(in*bits/32)]`` beside its ``weight_shape`` (``[2]``), FP4
  two to a ``U8`` ``[out, in/2]``;
* ``weight_zero_point``: present where the config group is asymmetric;
* ``weight_scale``: ``[1]`` per tensor, ``[out, 1]`` per channel, ``[out, ceil(in/group)]``
  per group, ``[ceil(out/b0), ceil(in/b1)]`` per block; floating, FP8 (NVFP4) or ``U8``
  exponents (MXFP4).

What the header cannot tell (the values of ``weight_shape``, a zero point's layout) is left to
compressed-tensors' decompressor, whose result is checked against the model's tensor before it
goes in (:func:`fastload.hf.load_ops.run_operations`).
"""

from __future__ import annotations

import math
from typing import Any

from fastload.core.basics.errors import CheckpointError, ModelMismatchError

#: stored dtypes of a compressed-tensors scale (floating; FP8 for NVFP4; E8M0 bytes for MXFP4)
CT_SCALE_DTYPES = frozenset({"F32", "BF16", "F16", "F8_E4M3", "U8", "F8_E8M0"})


def _scheme(op: Any, quantizer: Any) -> Any:
    from transformers.integrations.compressed_tensors import get_dense_scheme

    return op.converter.operations[0].scheme or get_dense_scheme(
        quantizer.compressor.quantization_config
    )


def _scale_shape(args: Any, rows: int, cols: int) -> list[int] | None:
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        return [1]
    if strategy == "channel":
        return [rows, 1]
    if strategy in ("group", "tensor_group") and args.group_size:
        return [rows, math.ceil(cols / args.group_size)]
    if strategy == "block" and args.block_structure:
        b0, b1 = args.block_structure
        return [math.ceil(rows / b0), math.ceil(cols / b1)]
    return None  # a strategy whose scale a weight header does not fix


def _refuse(ckpt: Any, stored: Any, want: list[int], what: str) -> None:
    raise ModelMismatchError(
        f"{ckpt.file_path(stored)}: tensor {stored.name!r} has shape {list(stored.shape)}; "
        f"{what} has shape {want}"
    )


def check_compressed(
    op: Any, ckpt: Any, weight: Any, scale: Any, want: tuple[int, ...], quantizer: Any
) -> None:
    """``weight`` (or ``weight_packed``) and ``weight_scale`` of the model's ``op.target``
    ``want``, as the module's config group stores them; refused naming the tensor and what was
    expected."""
    if len(want) != 2:
        return  # not a dense module's weight: left to the decompressor and the result's check
    rows, cols = want
    scheme = _scheme(op, quantizer)
    args = scheme.weights
    name = f"the model's {op.target!r} {list(want)}"
    kind = f"{args.type}{args.num_bits}"
    if weight.name.endswith("weight_packed"):
        shape_names = op.inputs.get("weight_shape", [])
        if args.type == "int":
            packed = [rows, math.ceil(cols * args.num_bits / 32)]
            dtype = "I32"
        elif args.type == "float" and args.num_bits == 4:
            packed, dtype = [rows, math.ceil(cols / 2)], "U8"
        else:
            packed, dtype = None, weight.st_dtype
        if weight.st_dtype != dtype:
            raise CheckpointError(
                f"{ckpt.file_path(weight)}: tensor {weight.name!r} has dtype "
                f"{weight.st_dtype}; the packed {kind} values of {name} are stored as {dtype}"
            )
        if packed is not None and list(weight.shape) != packed:
            _refuse(ckpt, weight, packed, f"the packed {kind} values of {name}")
        if args.type == "int" and not shape_names:
            missing = weight.name.removesuffix("weight_packed") + "weight_shape"
            raise CheckpointError(
                f"{ckpt.file_path(weight)}: tensor {weight.name!r} is packed but its "
                f"{missing!r} (the weight's shape, which compressed-tensors unpacks it to) is "
                "missing"
            )
        if shape_names:
            stored = ckpt.tensors[shape_names[0]]
            if list(stored.shape) != [2]:
                _refuse(ckpt, stored, [2], f"the shape of {name}")
    elif tuple(weight.torch_shape) != tuple(want):
        _refuse(ckpt, weight, list(want), f"the {kind} weight of {name}")
    if not args.symmetric and not op.inputs.get("weight_zero_point"):
        missing = scale.name.removesuffix("weight_scale") + "weight_zero_point"
        raise CheckpointError(
            f"{ckpt.file_path(weight)}: tensor {weight.name!r} is quantized asymmetrically (its "
            f"config group) but its zero point {missing!r} is missing"
        )
    if scale.st_dtype not in CT_SCALE_DTYPES:
        raise CheckpointError(
            f"{ckpt.file_path(scale)}: tensor {scale.name!r} has dtype {scale.st_dtype}; a "
            f"compressed-tensors scale is one of {', '.join(sorted(CT_SCALE_DTYPES))}"
        )
    expected = _scale_shape(args, rows, cols)
    got = list(scale.shape)
    if expected is not None and got != expected and not (expected == [1] and got == []):
        strategy = getattr(args.strategy, "value", args.strategy)
        _refuse(ckpt, scale, expected, f"the {strategy} scale of {name}")


__all__ = ["CT_SCALE_DTYPES", "check_compressed"]
