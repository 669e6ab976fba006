"""Header checks of bitsandbytes' pre-quantized tensors (``quant_method: bitsandbytes``), the
inputs of transformers' ``Bnb4bitDeserialize`` and ``Bnb8bitDeserialize``
(:mod:`fastload.hf.load_op_checks`), as bitsandbytes' ``Linear4bit`` / ``Linear8bitLt`` save
them:

* 4-bit (nf4, fp4): ``weight``, the values of the model's ``[out, in]`` weight two to a byte,
  stored as ``[ceil(out*in/2) / itemsize, 1]`` in the config's ``bnb_4bit_quant_storage``;
  ``weight.absmax`` one value per block of 32 to 4096 values (``F32``; ``U8`` with the config's
  ``bnb_4bit_use_double_quant``, beside ``weight.nested_absmax`` ``F32`` and
  ``weight.nested_quant_map`` ``F32 [256]``); ``weight.quant_map`` ``F32 [16]``; and
  ``weight.quant_state.bitsandbytes__<nf4|fp4>`` (``U8``, bitsandbytes' JSON of the rest), of
  the config's ``bnb_4bit_quant_type``.
* 8-bit (LLM.int8): ``weight`` ``I8`` of the model's shape and ``SCB`` ``F32 [out]`` (its
  ``weight_format``, when stored, is read and passed on).
"""

from __future__ import annotations

import math
from typing import Any

from fastload.core.basics.errors import CheckpointError, ModelMismatchError

#: bitsandbytes' block sizes (values per absmax)
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: the byte size of each stored dtype bnb_4bit_quant_storage may name
_ITEMSIZE = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4}


def _expect(
    ckpt: Any, stored: Any, dtypes: tuple[str, ...], shape: list[int] | None, why: str
) -> None:
    """``stored`` of one of ``dtypes`` and of ``shape`` (any, for ``None``), or refused naming
    it and ``why`` it is expected so."""
    if stored.st_dtype not in dtypes:
        raise CheckpointError(
            f"{ckpt.file_path(stored)}: tensor {stored.name!r} has dtype {stored.st_dtype}; "
            f"{why} is stored as {' or '.join(dtypes)}"
        )
    if shape is not None and list(stored.shape) != shape:
        raise ModelMismatchError(
            f"{ckpt.file_path(stored)}: tensor {stored.name!r} has shape {list(stored.shape)}; "
            f"{why} has shape {shape}"
        )


def _required(op: Any, ckpt: Any, weight: Any, patterns: list[str], what: str) -> dict[str, Any]:
    """The operation's stored tensors for ``patterns`` (``weight.quant_map`` ...), each one
    required beside the packed ``weight``."""
    found = {}
    for pattern in patterns:
        names = op.inputs.get(pattern, [])
        if not names:
            missing = weight.name.removesuffix("weight") + pattern
            raise CheckpointError(
                f"{ckpt.file_path(weight)}: tensor {weight.name!r} is quantized "
                f"({weight.st_dtype}) but {missing!r} ({what}) is missing"
            )
        found[pattern] = ckpt.tensors[names[0]]
    return found


def check_4bit(
    op: Any, ckpt: Any, weight: Any, absmax: Any, want: tuple[int, ...], quantizer: Any
) -> None:
    settings = quantizer.quantization_config
    kind = settings.bnb_4bit_quant_type
    double = bool(settings.bnb_4bit_use_double_quant)
    what = f"bitsandbytes' {kind} quant state"
    patterns = ["weight.quant_map", f"weight.quant_state.bitsandbytes__{kind}"]
    patterns += ["weight.nested_absmax", "weight.nested_quant_map"] if double else []
    found = _required(op, ckpt, weight, patterns, what)
    storage = str(settings.bnb_4bit_quant_storage).removeprefix("torch.")
    st_storage = {"uint8": "U8", "int8": "I8", "float16": "F16", "bfloat16": "BF16"}.get(
        storage, "F32" if storage == "float32" else storage.upper()
    )
    values = math.prod(want)
    packed = math.ceil(values / 2)
    itemsize = _ITEMSIZE.get(st_storage, 1)
    name = f"the {kind} weight of the model's {op.target!r} {list(want)}"
    _expect(
        ckpt, weight, (st_storage,), [math.ceil(packed / itemsize), 1], f"{name} ({packed} bytes)"
    )
    _expect(ckpt, absmax, ("U8",) if double else ("F32",), None, f"the absmax of {name}")
    blocks = absmax.shape[0] if len(absmax.shape) == 1 else -1
    if not any(math.ceil(values / b) == blocks for b in BLOCK_SIZES):
        raise ModelMismatchError(
            f"{ckpt.file_path(absmax)}: tensor {absmax.name!r} has shape {list(absmax.shape)}; "
            f"the absmax of {name} has one value per block of {BLOCK_SIZES[0]} to "
            f"{BLOCK_SIZES[-1]} values (shape [{math.ceil(values / 64)}] for bitsandbytes' "
            "blocks of 64)"
        )
    _expect(ckpt, found["weight.quant_map"], ("F32",), [16], f"the quant map of {name}")
    state = found[f"weight.quant_state.bitsandbytes__{kind}"]
    _expect(ckpt, state, ("U8",), None, f"{what} of {name}")
    if double:
        _expect(ckpt, found["weight.nested_absmax"], ("F32",), None, f"the nested absmax of {name}")
        nested_map = found["weight.nested_quant_map"]
        _expect(ckpt, nested_map, ("F32",), [256], f"the nested quant map of {name}")


def check_8bit(
    op: Any, ckpt: Any, weight: Any, scb: Any, want: tuple[int, ...], quantizer: Any
) -> None:
    name = f"the model's {op.target!r}"
    _expect(ckpt, weight, ("I8",), list(want), f"the LLM.int8 weight of {name}")
    _expect(ckpt, scb, ("F32",), [want[0]], f"the scale (SCB) of {name}, one per row,")


__all__ = ["BLOCK_SIZES", "check_4bit", "check_8bit"]
