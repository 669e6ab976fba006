"""compressed-tensors' compression of the meta skeleton, run once per kind of layer.

transformers' compressed-tensors quantizer gives the skeleton the compressed layout before any
tensor is read: ``preprocess_model`` runs compressed-tensors' ``compress_model``, which runs each
quantized layer's compressor (``BaseCompressor.compress``: quantize, pack) on its meta tensors to
learn which tensors the layer holds and their shapes. On the meta device every one of those
operations goes through torch's Python reference kernels: about 3 ms a layer, 0.8 s for a 1 GiB
Llama's 294 layers, 5-10 times the read of its int8 weights.

A compressor's output on meta tensors depends only on the compressor, the layer's scheme and the
shapes, strides and dtypes of its tensors, and a model has a handful of kinds of layer. So while
``preprocess_model`` runs, each compressor's ``compress`` is wrapped: for meta inputs it runs
once per kind (the compressor's own code) and later layers of that kind get fresh meta tensors
of the same shapes, strides and dtypes, and the very input objects where the compressor passed
an input through (``replace_direct_state_dict`` keeps those). Anything else (a tensor with data,
an output not on meta) goes to the compressor as it is. The method stays compressed-tensors':
what each layer holds is what its compressor said for the first layer of its kind.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: one preprocess at a time wraps the compressors (the wrapping is process-wide)
_LOCK = threading.Lock()

#: what a compressor returned for one kind of layer: per output name, the input name it passed
#: through, the (shape, stride, dtype) of a new meta tensor, or None (an absent bias)
_Outcome = dict[str, "str | tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None"]


def _signature(tensors: dict[str, Any]) -> tuple[Any, ...] | None:
    """The meta inputs' shapes, strides and dtypes, or ``None`` when one is not a meta tensor."""
    signature: list[tuple[Any, ...]] = []
    for name, tensor in tensors.items():
        if tensor is None:  # an absent bias
            signature.append((name,))
        elif isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            signature.append((name, tuple(tensor.shape), tensor.stride(), tensor.dtype))
        else:
            return None
    return tuple(signature)


def _outcome(inputs: dict[str, Any], outputs: dict[str, Any]) -> _Outcome | None:
    """How to give another layer of this kind the same outputs, or ``None`` when they cannot be
    told apart from their shapes (an output with data)."""
    by_id = {id(tensor): name for name, tensor in inputs.items() if tensor is not None}
    outcome: _Outcome = {}
    for name, tensor in outputs.items():
        if tensor is None:
            outcome[name] = None
        elif id(tensor) in by_id:
            outcome[name] = by_id[id(tensor)]
        elif isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            outcome[name] = (tuple(tensor.shape), tensor.stride(), tensor.dtype)
        else:
            return None
    return outcome


def _made(how: Any, inputs: dict[str, Any]) -> Any:
    """One output of a layer of a kind already compressed, by its recorded outcome."""
    if how is None or isinstance(how, str):
        return None if how is None else inputs[how]
    shape, stride, dtype = how
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


class _Memo:
    """The outcomes of one ``preprocess_model``: (compressor, scheme, inputs) -> outcome. Only
    the thread that opened the block uses it; any other caller gets the compressor itself."""

    def __init__(self) -> None:
        self.outcomes: dict[tuple[Any, ...], _Outcome | None] = {}
        self.calls = 0
        self.runs = 0
        self.owner = threading.get_ident()

    def compress(self, function: Any, cls: type, args: tuple[Any, ...], kwargs: dict) -> Any:
        if threading.get_ident() != self.owner or kwargs or len(args) != 2:
            return function(cls, *args, **kwargs)  # not the load's call: as it is
        state_dict, scheme = args
        self.calls += 1
        signature = _signature(state_dict) if isinstance(state_dict, dict) else None
        key = None
        if signature is not None:
            try:
                key = (cls, scheme.model_dump_json(), signature)
            except Exception:  # noqa: BLE001 - a scheme not to be keyed: not memoized
                key = None
        if key is not None and self.outcomes.get(key) is not None:
            outcome = self.outcomes[key]
            assert outcome is not None
            return {name: _made(how, state_dict) for name, how in outcome.items()}
        self.runs += 1
        outputs = function(cls, state_dict, scheme)
        if key is not None:
            self.outcomes[key] = _outcome(state_dict, outputs)
        return outputs


def _compressors() -> list[type]:
    """Every compressor class that defines its own ``compress`` (registered or not)."""
    from compressed_tensors.compressors.base import BaseCompressor

    found, todo = [], [BaseCompressor]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if isinstance(cls.__dict__.get("compress"), classmethod):
            found.append(cls)
    return found


@contextmanager
def compress_once_per_kind() -> Iterator[_Memo | None]:
    """Within the block, compressed-tensors' compressors run once per kind of meta layer (the
    module's docstring), for calls from this thread. Yields the memo (its ``calls`` and
    ``runs``), or ``None`` where this compressed-tensors has no classmethod compressors to wrap
    (the block then runs unchanged). On leaving, each class gets its own ``compress`` back,
    unless something else replaced the wrapper meanwhile (then that stays)."""
    try:
        classes = _compressors()
    except (ImportError, AttributeError):
        classes = []
    if not classes:
        yield None
        return
    memo = _Memo()
    with _LOCK:
        originals = {cls: cls.__dict__["compress"] for cls in classes}
        wrappers = {cls: classmethod(_wrapped(memo, o.__func__)) for cls, o in originals.items()}
        for cls, wrapper in wrappers.items():
            cls.compress = wrapper  # type: ignore[attr-defined]
        try:
            yield memo
        finally:
            for cls, original in originals.items():
                if cls.__dict__.get("compress") is wrappers[cls]:
                    cls.compress = original  # type: ignore[attr-defined]


def _wrapped(memo: _Memo, function: Any) -> Any:
    def compress(cls: type, *args: Any, **kwargs: Any) -> Any:
        return memo.compress(function, cls, args, kwargs)

    compress.__wrapped__ = function  # type: ignore[attr-defined]
    return compress


__all__ = ["compress_once_per_kind"]
