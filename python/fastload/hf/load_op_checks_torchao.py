"""Header checks of torchao's pre-quantized tensors (``quant_method: torchao``), the inputs of
transformers' ``TorchAoDeserialize`` (:mod:`fastload.hf.load_op_checks`), as torchao's
``flatten_tensor_state_dict`` stores a quantized parameter: one stored tensor per tensor of its
tensor subclass, named ``<module>._<param>_<name>``, and the subclass, its tensor names and its
attributes as JSON in the file's metadata under the parameter's name.

Checked are the subclasses transformers 5.25 loads back on a CPU with torchao 0.18 (weight-only
and dynamic-activation int8, weight-only float8), whose values keep the model weight's shape:

* ``Int8Tensor``: ``qdata`` ``I8`` of the model's ``[out, in]``; ``scale`` (float) and
  ``zero_point`` (``I8``) ``[out/b0, in/b1]`` for the metadata's ``block_size`` ``[b0, b1]``;
* ``Float8Tensor``: ``qdata`` ``F8_E4M3`` / ``F8_E5M2`` of the model's shape; ``scale``
  (float) ``[out/b0, in/b1]``.

Any other subclass (int4 packings, which need CUDA or x86 kernels to load) is refused naming it.
"""

from __future__ import annotations

import json
from typing import Any

from fastload.core.basics.errors import CheckpointError, ModelMismatchError, UnsupportedError

#: the stored dtypes of each served subclass' values
QDATA_DTYPES = {"Int8Tensor": ("I8",), "Float8Tensor": ("F8_E4M3", "F8_E5M2")}
#: the stored dtypes of a scale and of a zero point
SCALE_DTYPES = ("F32", "BF16", "F16")
ZERO_DTYPES = ("I8",)


def check_torchao(
    op: Any, ckpt: Any, qdata: Any, scale: Any, want: tuple[int, ...], quantizer: Any
) -> None:
    """``op``'s stored tensors make the torchao subclass the file's metadata names for the
    model's ``op.target`` of shape ``want``; refused naming the stored tensor otherwise."""
    where = ckpt.file_path(qdata)
    entry = (getattr(quantizer, "metadata", None) or {}).get(op.target)
    try:
        meta = json.loads(entry) if entry is not None else None
    except (TypeError, ValueError):
        meta = None
    if not isinstance(meta, dict) or not isinstance(meta.get("_tensor_data_names"), list):
        raise CheckpointError(
            f"{where}: tensor {qdata.name!r} is stored as torchao stores a quantized tensor, but "
            f"the file's metadata has no torchao entry for {op.target!r} (its subclass and "
            "tensor names)"
        )
    kind = meta.get("_type")
    if kind not in QDATA_DTYPES:
        raise UnsupportedError(
            f"{where}: {op.target!r} is a torchao {kind}; fastload loads torchao's "
            f"{', '.join(sorted(QDATA_DTYPES))} only (the ones transformers loads on a CPU): "
            "load it with transformers"
        )
    prefix = "_" + op.target.rpartition(".")[2] + "_"
    names = {p.removeprefix(prefix): ckpt.tensors[v[0]] for p, v in op.inputs.items() if v}
    needed = list(meta["_tensor_data_names"])
    for name in needed:
        if name not in names:
            raise CheckpointError(
                f"{where}: tensor {qdata.name!r} is a torchao {kind} whose {name!r} "
                f"({qdata.name.removesuffix('qdata')}{name}) is missing"
            )
    for name, stored in names.items():
        if name not in needed:
            raise CheckpointError(
                f"{ckpt.file_path(stored)}: tensor {stored.name!r} is not one of the tensors of "
                f"{op.target!r}'s torchao {kind} ({', '.join(needed)}), as the metadata says"
            )
    _expect(ckpt, qdata, QDATA_DTYPES[kind], list(want), f"{kind}'s qdata of {op.target!r}")
    block = (meta.get("_data") or {}).get("block_size")
    if not (isinstance(block, list) and len(block) == len(want) and all(block)):
        raise CheckpointError(
            f"{where}: the metadata of {op.target!r} has block_size {block!r}, not one block "
            f"size per dimension of its shape {list(want)}"
        )
    grid = [-(-size // int(b)) for size, b in zip(want, block, strict=True)]
    _expect(ckpt, names["scale"], SCALE_DTYPES, grid, f"the scale of {kind} {op.target!r}")
    if "zero_point" in names:
        zero = names["zero_point"]
        _expect(ckpt, zero, ZERO_DTYPES, grid, f"the zero point of {kind} {op.target!r}")


def _expect(ckpt: Any, stored: Any, dtypes: tuple[str, ...], shape: list[int], why: str) -> None:
    if stored.st_dtype not in dtypes:
        raise CheckpointError(
            f"{ckpt.file_path(stored)}: tensor {stored.name!r} has dtype {stored.st_dtype}; "
            f"{why} is stored as {' or '.join(dtypes)}"
        )
    if list(stored.shape) != shape:
        raise ModelMismatchError(
            f"{ckpt.file_path(stored)}: tensor {stored.name!r} has shape {list(stored.shape)}; "
            f"{why} has shape {shape}"
        )


__all__ = ["check_torchao"]
