"""compressed-tensors' preprocessing of the meta skeleton: compression run once per kind of
layer, no clearing of layers that hold nothing to clear.

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

The block also spares two costs of compressed-tensors' per-layer bookkeeping that give nothing
on a skeleton:

* ``initialize_module_for_quantization`` first clears the quantization parameters a layer may
  hold from an earlier quantization (``QuantizationMetadata.clear_all_qparams``: 14 ``hasattr``,
  each under an onloading switch, a quarter of ``preprocess_model``); a fresh skeleton layer
  holds none. Where a module plainly holds none of those names (a plain ``nn.Module`` lookup: its
  own dicts and its class) the clearing is skipped; any other module goes to compressed-tensors'.
* the memo's own look-ups (shapes, strides, new meta tensors) run with torch's function modes
  off: ``preprocess_model`` runs under ``torch.device("meta")``, which adds a Python call to every
  tensor attribute read; the memo creates only meta tensors, with the device named.
* each compressed layer's tensors are then swapped in by ``replace_direct_state_dict``: a
  ``delattr`` and a ``setattr`` per tensor, each through ``nn.Module``'s attribute hooks and
  ``register_parameter`` (a third of ``compress_model``). Where the layer is a plain
  ``nn.Module`` holding parameters only, every new tensor is a meta tensor and torch's
  registration would do nothing but store it (no registration hook, no name it refuses),
  the same entries go into the layer's ``_parameters`` directly, in the same order; any other
  layer goes to compressed-tensors' own.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from fastload.core.model.skeleton import registers_as_torch

#: one preprocess at a time wraps compressed-tensors' classes (the wrapping is process-wide); the
#: preprocess's own thread enters both blocks
_LOCK = threading.RLock()

#: what a compressor returned for one kind of layer: per output name, the input name it passed
#: through, the (shape, stride, dtype) of a new meta tensor, or None (an absent bias)
_Outcome = dict[str, "str | tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None"]


def _signature(tensors: dict[str, Any]) -> tuple[Any, ...] | None:
    """The meta inputs' shapes, strides and dtypes, or ``None`` when one is not a meta tensor."""
    signature: list[tuple[Any, ...]] = []
    for name, tensor in tensors.items():
        if tensor is None:  # an absent bias
            signature.append((name,))
        elif type(tensor) is torch.Tensor and tensor.device.type == "meta":  # no subclass
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
        #: id -> (scheme, a copy of it when serialized, its JSON): the layers of a group share
        #: one scheme object, serialized again only where it no longer equals its copy
        self.schemes: dict[int, tuple[Any, Any, str]] = {}
        self.calls = 0
        self.runs = 0
        self.owner = threading.get_ident()

    def compress(self, function: Any, cls: type, args: tuple[Any, ...], kwargs: dict) -> Any:
        if threading.get_ident() != self.owner or kwargs or len(args) != 2:
            return function(cls, *args, **kwargs)  # not the load's call: as it is
        state_dict, scheme = args
        self.calls += 1
        with torch._C.DisableTorchFunction():  # reads of shapes and dtypes, not the meta mode's
            signature = _signature(state_dict) if isinstance(state_dict, dict) else None
        key = None
        if signature is not None:
            try:
                key = (cls, self._serialized(scheme), signature)
            except Exception:  # noqa: BLE001 - a scheme not to be keyed: not memoized
                key = None
        if key is not None and self.outcomes.get(key) is not None:
            outcome = self.outcomes[key]
            assert outcome is not None
            with torch._C.DisableTorchFunction():  # every tensor made names its device
                return {name: _made(how, state_dict) for name, how in outcome.items()}
        self.runs += 1
        outputs = function(cls, state_dict, scheme)
        if key is not None:
            self.outcomes[key] = _outcome(state_dict, outputs)
        return outputs

    def _serialized(self, scheme: Any) -> str:
        """``scheme.model_dump_json()``, or what it gave for this very scheme while it still
        equals (pydantic's ``==``, a fifth of the cost) a copy taken then."""
        known = self.schemes.get(id(scheme))
        if known is not None and known[0] is scheme and scheme == known[1]:
            return known[2]
        text: str = scheme.model_dump_json()
        self.schemes[id(scheme)] = (scheme, scheme.model_copy(deep=True), text)
        return text


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
    with _LOCK, _replaced([(cls, "compress", lambda f: _wrapped(memo, f)) for cls in classes]):
        yield memo


@contextmanager
def no_clearing_of_fresh_modules() -> Iterator[None]:
    """Within the block, compressed-tensors' ``QuantizationMetadata.clear_all_qparams`` returns
    at once for a module that plainly holds none of the names it clears (the module's
    docstring), when called from this thread; any other call goes to compressed-tensors' own.
    Restored on leaving, as :func:`compress_once_per_kind` restores the compressors."""
    try:
        from compressed_tensors.quantization.quant_metadata import QuantizationMetadata
    except ImportError:
        yield
        return
    if not isinstance(QuantizationMetadata.__dict__.get("clear_all_qparams"), classmethod):
        yield  # another compressed-tensors than the one this was written for: as it is
        return
    owner = threading.get_ident()

    def clear(function: Any) -> Any:
        def clear_all_qparams(cls: type, module: Any, *args: Any, **kwargs: Any) -> Any:
            if not args and not kwargs and threading.get_ident() == owner:
                names = cls.all_qparam_names()  # type: ignore[attr-defined]
                if _holds_none(module, names):
                    return None
            return function(cls, module, *args, **kwargs)

        return clear_all_qparams

    with _LOCK, _replaced([(QuantizationMetadata, "clear_all_qparams", clear)]):
        yield


def _plain_lookup(module: Any) -> bool:
    """Whether ``module``'s attributes are looked up and set as ``nn.Module``'s are, in plain
    dicts (not a class with its own look-up, nor dicts an offloading cache replaced)."""
    cls = type(module)
    if not isinstance(module, nn.Module) or cls.__getattr__ is not nn.Module.__getattr__:
        return False
    if cls.__getattribute__ is not object.__getattribute__:
        return False
    own = module.__dict__
    return all(type(own.get(key)) is dict for key in ("_parameters", "_buffers", "_modules"))


def _holds_none(module: Any, names: list[str]) -> bool:
    """Whether ``hasattr(module, name)`` is false for every name, told from the module's own
    dicts and its class's as ``nn.Module`` looks attributes up; false where it cannot be told
    so (:func:`_plain_lookup`)."""
    if not _plain_lookup(module):
        return False
    own = module.__dict__
    wanted = set(names)
    tables: list[Mapping[str, Any]] = [own, own["_parameters"], own["_buffers"], own["_modules"]]
    tables.extend(vars(c) for c in type(module).__mro__)  # class attributes, properties
    return all(wanted.isdisjoint(table) for table in tables)


@contextmanager
def plain_replacement_of_layer_tensors() -> Iterator[None]:
    """Within the block, compressed-tensors' ``get_direct_state_dict`` and
    ``replace_direct_state_dict``, as its compressors call them, read a plain layer's tensors
    (:func:`_read_plainly`) and put its new meta tensors into its ``_parameters``
    (:func:`_replace_plainly`) directly, when called from this thread; any other call goes to
    compressed-tensors' own. Restored on leaving unless something else replaced them meanwhile."""
    try:
        base = importlib.import_module("compressed_tensors.compressors.base")
    except ImportError:
        yield
        return
    names = ("get_direct_state_dict", "replace_direct_state_dict")
    if not all(callable(base.__dict__.get(n)) for n in names):
        yield  # another compressed-tensors than the one this was written for: as it is
        return
    owner = threading.get_ident()

    def reading(read: Any) -> Any:
        def get_direct_state_dict(module: Any) -> Any:
            state = _read_plainly(module) if threading.get_ident() == owner else None
            return read(module) if state is None else state

        return get_direct_state_dict

    def replacing(replace: Any) -> Any:
        def replace_direct_state_dict(module: Any, new_state_dict: Any) -> None:
            if threading.get_ident() != owner or not _replace_plainly(module, new_state_dict):
                replace(module, new_state_dict)

        return replace_direct_state_dict

    changes = [
        (base, "get_direct_state_dict", reading),
        (base, "replace_direct_state_dict", replacing),
    ]
    with _LOCK, _replaced(changes):
        yield


def _read_plainly(module: Any) -> dict[str, Any] | None:
    """What compressed-tensors' ``get_direct_state_dict(module)`` gives (each parameter's
    ``.data``), read with torch's function modes off (the meta mode's Python call per
    ``.data``) where the layer is plain (:func:`_plain_lookup`), holds no buffer and each of
    its parameters is a plain ``Parameter`` or ``None``; ``None`` otherwise (torch's
    ``isinstance`` checks for ``Parameter`` and ``Buffer`` also accept marked plain tensors)."""
    if not _plain_lookup(module) or module.__dict__["_buffers"]:
        return None
    state: dict[str, Any] = {}
    with torch._C.DisableTorchFunction():
        for name, tensor in module.__dict__["_parameters"].items():
            if type(tensor) is nn.Parameter:
                state[name] = tensor.data
            elif tensor is None:
                state[name] = None
            else:
                return None
    return state


def _replace_plainly(module: Any, new: Any) -> bool:
    """What compressed-tensors' ``replace_direct_state_dict(module, new)`` does, done on the
    module's ``_parameters`` when that is plainly all it does; ``False``, with nothing done,
    otherwise. It deletes each old tensor the new state lacks, then for each new entry in
    order: an absent tensor that stays absent is kept, any other is deleted (an old tensor
    is read as ``.data``, a new object, so never the new one) and set again as a frozen
    ``Parameter`` through ``nn.Module.__setattr__``, which here only stores it: a plain module
    (:func:`_plain_lookup`, ``nn.Module``'s own ``__setattr__``, ``__delattr__`` and
    ``register_parameter``, no buffers), a name it accepts that nothing else holds, a plain
    meta tensor, torch's registration (:func:`registers_as_torch`) without hooks."""
    if type(new) is not dict or not _plain_lookup(module) or module.__dict__["_buffers"]:
        return False
    cls = type(module)
    if (
        cls.__setattr__ is not nn.Module.__setattr__
        or cls.__delattr__ is not nn.Module.__delattr__
        or cls.register_parameter is not nn.Module.register_parameter
        or _global_parameter_hooks()
        or not registers_as_torch()
    ):
        return False
    own = module.__dict__
    params, modules = own["_parameters"], own["_modules"]
    kept = {n for n, v in new.items() if v is None and n in params and params[n] is None}
    with torch._C.DisableTorchFunction():  # reads of devices, not the meta mode's
        for name, value in new.items():
            if name in kept:
                continue
            if type(name) is not str or not name or "." in name:
                return False
            if type(value) is not torch.Tensor or value.device.type != "meta":
                return False
            # held otherwise: in the module's own dicts, or its class's (or metaclass's)
            if name in own or name in modules or hasattr(cls, name):
                return False
            if name in own.get("_non_persistent_buffers_set", ()):
                return False  # nn.Module.__setattr__ would discard it
    for name in [n for n in params if n not in new]:
        del params[name]
    for name, value in new.items():
        if name not in kept:
            params.pop(name, None)
            params[name] = nn.Parameter(value, requires_grad=False)
    return True


def _global_parameter_hooks() -> bool:
    """Whether torch has global parameter registration hooks (they may change what is stored);
    true where this torch keeps none where this looks."""
    return bool(getattr(_torch_module, "_global_parameter_registration_hooks", True))


@contextmanager
def _replaced(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each ``(owner, name, make)``: the owner's ``name`` (a class's classmethod or a module's
    function) replaced by ``make(its function)`` inside the block; on leaving, the original is
    put back where the replacement is still in place (something else that replaced it meanwhile
    stays)."""
    originals = [owner.__dict__[name] for owner, name, _ in changes]
    replacements = []
    for (owner, name, make), original in zip(changes, originals, strict=True):
        method = isinstance(original, classmethod)
        function = original.__func__ if method else original
        replacement = make(function)
        replacement.__wrapped__ = function
        replacements.append(classmethod(replacement) if method else replacement)
        setattr(owner, name, replacements[-1])
    try:
        yield
    finally:
        for (owner, name, _), original, replacement in zip(
            changes, originals, replacements, strict=True
        ):
            if owner.__dict__.get(name) is replacement:
                setattr(owner, name, original)


def _wrapped(memo: _Memo, function: Any) -> Any:
    def compress(cls: type, *args: Any, **kwargs: Any) -> Any:
        return memo.compress(function, cls, args, kwargs)

    return compress


__all__ = [
    "compress_once_per_kind",
    "no_clearing_of_fresh_modules",
    "plain_replacement_of_layer_tensors",
]
