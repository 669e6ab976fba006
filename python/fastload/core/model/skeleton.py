"""Building a model on the meta device, and initialising the parameters a checkpoint lacks.

The skeleton has its parameters on ``meta`` and its buffers real: like accelerate's
``init_empty_weights(include_buffers=False)``, only ``nn.Module.register_parameter`` is patched, so
the values ``__init__`` computes for buffers (``position_ids``, ``inv_freq``...) are kept, while no
parameter memory is written before the loader knows where each parameter goes. (A parameter's
``torch.empty`` storage exists for an instant before it moves to ``meta``; it is never written, so
the operating system does not back it with memory.)

Missing parameters are initialised the model's own way: the model family's first (its hooks'
``initialize``, :class:`fastload.core.plan.hooks.ModelHooks`), then ``reset_parameters()`` of their
modules.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import RequestError, UninitializedTensorError

logger = logging.getLogger("fastload")

#: parameters up to this many elements keep the value their constructor gave them, for a
#: parameter no initialization function covers (a learned scalar scale, a head's bias)
CONSTRUCTOR_VALUE_MAX_ELEMENTS = 1 << 16

# module -> {attribute: the value its constructor gave the parameter}, for skeleton modules
_CONSTRUCTED: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)

# A skeleton build patches process-wide state (nn.Module.register_parameter, torch's default dtype,
# a model family's init switches), so builds run one at a time: unserialized, two threads restore
# each other's patch and leave register_parameter patched for good.
_BUILD_LOCK = threading.RLock()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block is moved to ``meta``; buffers stay real."""
    original = nn.Module.register_parameter
    owner = threading.get_ident()

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        # Modules other threads build meanwhile keep real parameters.
        if param is None or param.device.type == "meta" or threading.get_ident() != owner:
            return
        registered = module._parameters[name]
        if registered.numel() <= CONSTRUCTOR_VALUE_MAX_ELEMENTS:
            _CONSTRUCTED.setdefault(module, {})[name] = registered.detach().clone()
        cls = type(registered)
        if cls is nn.Parameter:
            moved = nn.Parameter(registered.to("meta"), requires_grad=registered.requires_grad)
            moved.__dict__.update(registered.__dict__)
        else:  # Parameter subclasses take their attributes as constructor arguments (accelerate)
            kwargs = dict(registered.__dict__)
            kwargs["requires_grad"] = registered.requires_grad
            moved = cls(registered.to("meta"), **kwargs)
        module._parameters[name] = moved

    # what it wraps: for a parameter on meta it does nothing more (registers_as_torch)
    register_parameter._fastload_wraps = original  # type: ignore[attr-defined]

    # Large Linear and Embedding weights are created on meta outright: allocating them on the CPU
    # first costs an mmap/munmap pair each, which a concurrent read-ahead into the same address
    # space (WarmUp) slowed 3-5x. Nothing changes for the module: registration would move the
    # weight to meta at once, and no constructor value is kept at that size anyway.
    layers = {
        nn.Linear: ("in_features", "out_features"),
        nn.Embedding: ("num_embeddings", "embedding_dim"),
    }
    inits = {cls: cls.__init__ for cls in layers}

    def on_meta(init: Callable[..., None], names: tuple[str, str]) -> Callable[..., None]:
        # the position of `device` among the positional arguments (after self)
        at = list(inspect.signature(init).parameters).index("device") - 1

        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            if len(args) < at and kwargs.get("device") is None and threading.get_ident() == owner:
                dims = [*args[:2], *(kwargs.get(n) for n in names[len(args[:2]) :])]
                if (
                    all(type(d) is int for d in dims)
                    and dims[0] * dims[1] > CONSTRUCTOR_VALUE_MAX_ELEMENTS
                ):
                    kwargs["device"] = "meta"
            init(self, *args, **kwargs)

        return __init__

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    for cls, names in layers.items():
        cls.__init__ = on_meta(inits[cls], names)  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        for cls, init in inits.items():
            cls.__init__ = init  # type: ignore[method-assign]


def registers_as_torch() -> bool:
    """Whether ``nn.Module.register_parameter`` now registers a parameter on meta as torch's own
    does: it is torch's, or :func:`parameters_on_meta`'s around torch's (which adds nothing for
    a parameter already on meta)."""
    function = nn.Module.register_parameter
    function = getattr(function, "_fastload_wraps", function)
    return (
        getattr(function, "__module__", None) == "torch.nn.modules.module"
        and getattr(function, "__qualname__", None) == "Module.register_parameter"
    )


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` (a floating type) inside the block."""
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_skeleton(
    factory: Callable[[], nn.Module],
    *,
    dtype: torch.dtype | None,
    contexts: Sequence[Callable[[], contextlib.AbstractContextManager[Any]]] = (),
) -> nn.Module:
    """Calls ``factory`` with parameters going to ``meta`` and the default dtype set to ``dtype``.

    ``contexts`` are entered around the call too (a model family's own switches, such as one
    that turns its weight initialization off). Builds are serialized by a lock, as they
    patch process-wide state (``nn.Module.register_parameter``, the default dtype) while
    ``factory`` runs.
    """
    with _BUILD_LOCK, contextlib.ExitStack() as stack:
        stack.enter_context(parameters_on_meta())
        stack.enter_context(default_dtype(dtype))
        for context in contexts:
            stack.enter_context(context())
        model = factory()
    if not isinstance(model, nn.Module):
        raise RequestError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    return model


#: a model family's own initialization (:meth:`fastload.core.plan.hooks.ModelHooks.initialize`):
#: given the model and the targets, it initializes those it knows and returns their names
FamilyInit = Callable[[nn.Module, dict[str, torch.Tensor]], set[str]]


def initialize(
    model: nn.Module, targets: dict[str, torch.Tensor], family: FamilyInit | None = None
) -> None:
    """Initialises the tensors in ``targets`` (model name -> tensor already in the model): the
    model family's way first (``family``), then ``reset_parameters()`` of their modules.

    Every other tensor of the model is left untouched. Floating-point targets must arrive filled
    with NaN: one that is still all NaN afterwards was not initialised by anything; it gets the
    value its constructor gave it (kept for parameters of up to
    :data:`CONSTRUCTOR_VALUE_MAX_ELEMENTS` elements) with a warning naming it, and without one it
    is an ``UninitializedTensorError`` (a ``CheckpointError``) naming it.
    """
    if not targets:
        return
    ids = {id(t) for t in targets.values()}
    done = family(model, targets) if family is not None else set()
    rest = {n: t for n, t in targets.items() if n not in done}
    if rest:
        _initialize_torch(model, rest, ids)
    kept: list[str] = []
    for name, tensor in targets.items():
        if tensor.is_floating_point() and tensor.numel() and bool(torch.isnan(tensor).all()):
            if _constructor_value(model, name, tensor):
                kept.append(name)
                continue
            owner = _owner_name(model, name)
            raise UninitializedTensorError(
                f"{name}: not in the checkpoint, and {owner} does not initialize it; put it in the "
                "checkpoint or pass missing='error' to find such tensors up front"
            )
    if kept:
        logger.warning(
            "%d tensors are not in the checkpoint and no initialization covers them; they keep "
            "the value their constructor gave them: %s",
            len(kept),
            ", ".join(kept),
        )


def _constructor_value(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Fills ``tensor`` with the value the constructor gave parameter ``name``, if kept."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    value = _CONSTRUCTED.get(module, {}).get(attr)
    if value is None or value.shape != tensor.shape:
        return False
    with torch.no_grad():
        tensor.copy_(value)
    return True


def forget_constructor_values(model: nn.Module) -> None:
    """Drops the constructor values kept for ``model``'s parameters (once it is loaded)."""
    for module in model.modules():
        _CONSTRUCTED.pop(module, None)


def _owner_name(model: nn.Module, name: str) -> str:
    module_name = name.rpartition(".")[0]
    module = model.get_submodule(module_name) if module_name else model
    return type(module).__name__


def _initialize_torch(model: nn.Module, targets: dict[str, torch.Tensor], ids: set[int]) -> None:
    owners: dict[int, tuple[str, nn.Module]] = {}
    for name in targets:
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name) if module_name else model
        owners.setdefault(id(module), (name, module))
    for name, module in owners.values():
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise UninitializedTensorError(
                f"{name}: not in the checkpoint, and its module ({type(module).__name__}) has no "
                "reset_parameters() to initialize it"
            )
        # reset_parameters() resets all of the module's tensors; keep the loaded ones.
        keep = {
            attr: t.detach().clone()
            for attr, t in [*module._parameters.items(), *module._buffers.items()]
            if t is not None and id(t) not in ids and t.device.type != "meta"
        }
        with torch.no_grad():
            reset()
            for attr, saved in keep.items():
                current = module._parameters.get(attr)
                if current is None:
                    current = module._buffers[attr]
                current.copy_(saved)
