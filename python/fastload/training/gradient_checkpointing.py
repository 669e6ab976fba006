"""Gradient (activation) checkpointing as a runtime toggle on a loaded model.

Background: transformers #13657 moved the switch from the config to the model
(``gradient_checkpointing_enable``/``_disable``), because a training choice saved into a config
silently turned itself on for everyone who loaded the checkpoint later. Here the toggle is runtime
state only: it lives on the modules, is never written into a config or checkpoint, and asking for
it on a model with nothing to checkpoint raises instead of doing nothing.

transformers models use their own mechanism. Plain ``nn.Module`` models get their repeated blocks
wrapped: the children of an ``nn.ModuleList`` whose entries share one class, or the module classes
the caller names. The wrapper is an instance-level ``forward`` that runs the class's forward under
:func:`torch.utils.checkpoint.checkpoint`; disabling removes it, leaving the module as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastload.core.basics.arguments import check_bool, check_module
from fastload.core.basics.errors import UnsupportedError
from fastload.core.model.keys import within
from fastload.families import is_transformers_model

# Instance attributes fastload sets; their presence marks fastload's own changes.
_STATE_ATTR = "_fastload_checkpointing"
_INPUT_GRADS_ATTR = "_fastload_added_input_grad_hooks"

ModuleSpec = type[nn.Module] | str


@dataclass
class _WrapState:
    use_reentrant: bool
    # The instance-level ``forward`` the module had before wrapping (another library's hook, say);
    # ``None`` when it used its class's forward, which is then restored by deleting the wrapper.
    previous_forward: Any = None


class _CheckpointedForward:
    """Instance-level ``forward`` of a wrapped block.

    An object holding its module rather than a closure, so that ``copy.deepcopy`` and pickling of
    the model give a copy whose wrapper runs the copy's own block.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        state: _WrapState = module.__dict__[_STATE_ATTR]
        if state.previous_forward is not None:
            inner = state.previous_forward
        else:
            inner = functools.partial(type(module).forward, module)
        # Like transformers: only a training step with autograd on has activations worth dropping.
        if not (module.training and torch.is_grad_enabled()):
            return inner(*args, **kwargs)
        if state.use_reentrant:
            # The reentrant variant takes no keyword arguments; bind them to the function instead.
            fn = functools.partial(inner, **kwargs) if kwargs else inner
            return checkpoint(fn, *args, use_reentrant=True)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)


def _matches(module: nn.Module, specs: tuple[ModuleSpec, ...]) -> bool:
    for spec in specs:
        if isinstance(spec, str):
            if type(module).__name__ == spec:
                return True
        elif isinstance(module, spec):
            return True
    return False


def _outermost(candidates: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drops candidates nested inside another candidate: checkpointing the outer block already
    recomputes the inner one, and checkpointing both only adds recomputation."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in sorted(candidates, key=lambda c: c[0].count(".") if c[0] else -1):
        if any(within(p, name) and name != p for p, _ in chosen):
            continue
        chosen.append((name, module))
    return chosen


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of every ``nn.ModuleList`` whose entries all share one class."""
    found: list[tuple[str, nn.Module]] = []
    for list_name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        prefix = f"{list_name}." if list_name else ""
        found.extend((f"{prefix}{i}", child) for i, child in enumerate(module))
    return found


def _blocks_to_wrap(
    model: nn.Module, modules: Iterable[ModuleSpec] | ModuleSpec | None
) -> list[tuple[str, nn.Module]]:
    if modules is None:
        candidates = _repeated_blocks(model)
        how = "no nn.ModuleList whose entries share one module class"
    else:
        if isinstance(modules, (str, type)):
            modules = [modules]
        specs = tuple(modules)
        for spec in specs:
            is_class = isinstance(spec, type) and issubclass(spec, nn.Module)
            if not (isinstance(spec, str) or is_class):
                raise UnsupportedError(
                    f"modules= takes nn.Module subclasses or class names, got {spec!r}"
                )
        candidates = [(n, m) for n, m in model.named_modules() if n and _matches(m, specs)]
        names = ", ".join(s if isinstance(s, str) else s.__name__ for s in specs)
        how = f"no submodule of the classes named in modules= ({names})"
    blocks = _outermost(candidates)
    if not blocks:
        raise UnsupportedError(
            f"{type(model).__name__} has nothing to checkpoint: {how}. Name the repeated block "
            "classes with modules=[...]"
        )
    return blocks


def _wrap(module: nn.Module, use_reentrant: bool) -> None:
    state = module.__dict__.get(_STATE_ATTR)
    if state is not None:  # already wrapped: only the option can change
        state.use_reentrant = use_reentrant
        return
    previous = module.__dict__.get("forward")
    module.__dict__[_STATE_ATTR] = _WrapState(use_reentrant, previous)
    module.__dict__["forward"] = _CheckpointedForward(module)


def _unwrap(module: nn.Module) -> None:
    state: _WrapState | None = module.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    if state.previous_forward is not None:
        module.__dict__["forward"] = state.previous_forward
    else:
        module.__dict__.pop("forward", None)


def _transformers_enable(model: nn.Module, use_reentrant: bool) -> None:
    name = type(model).__name__
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UnsupportedError(
            f"{name} does not support gradient checkpointing (its class sets "
            "supports_gradient_checkpointing = False); pass modules=[...] to checkpoint "
            "named block classes instead"
        )
    if getattr(model, _INPUT_GRADS_ATTR, False):
        # Enabling again would register the input-grad hooks a second time; start clean.
        _transformers_disable(model)
    had_hooks = bool(getattr(model, "_require_grads_hooks", None))
    kwargs = {"use_reentrant": use_reentrant}
    try:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    except ValueError as exc:  # transformers' own "not supported/compatible" errors
        raise UnsupportedError(f"{name}: {exc}") from exc
    if not had_hooks and getattr(model, "_require_grads_hooks", None):
        # transformers hooks the input embeddings so activations require grad under reentrant
        # checkpointing; remember that these hooks are ours to remove on disable.
        model.__dict__[_INPUT_GRADS_ATTR] = True


def _transformers_disable(model: nn.Module) -> None:
    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()
    if model.__dict__.pop(_INPUT_GRADS_ATTR, False):
        model.disable_input_require_grads()


def gradient_checkpointing_enable(
    model: nn.Module,
    *,
    use_reentrant: bool = False,
    modules: Iterable[ModuleSpec] | ModuleSpec | None = None,
) -> None:
    """Turns gradient (activation) checkpointing on for ``model``'s repeated blocks.

    A transformers model uses its own mechanism (``activation_checkpointing_enable``). Any other
    model, or any model when ``modules`` is given, has its blocks' ``forward`` wrapped with
    :func:`torch.utils.checkpoint.checkpoint`: the entries of every ``nn.ModuleList`` whose
    entries share one class, or the submodules whose class is one of ``modules`` (classes or class
    names; the outermost matches only). A wrapped block checkpoints only in training mode with
    autograd enabled, like transformers' layers.

    Calling it again is harmless (it only updates ``use_reentrant``). The switch is runtime state:
    it is never saved with the model.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``use_reentrant`` not a bool.
        UnsupportedError: the model has nothing to checkpoint (naming its class).
    """
    where = "gradient_checkpointing_enable"
    check_module(model, "model", where=where)
    check_bool(use_reentrant, "use_reentrant", where=where)
    if modules is None and is_transformers_model(model):
        _transformers_enable(model, use_reentrant)
        return
    for _, block in _blocks_to_wrap(model, modules):
        _wrap(block, use_reentrant)


def gradient_checkpointing_disable(model: nn.Module) -> None:
    """Turns gradient checkpointing off again; a no-op if it is not on.

    Wrapped blocks get their original ``forward`` back (no wrapper is left behind), and for a
    transformers model its own mechanism is switched off along with the input-grad hooks that
    :func:`gradient_checkpointing_enable` caused it to add. ``TypeError`` when ``model`` is not
    an ``nn.Module``.
    """
    check_module(model, "model", where="gradient_checkpointing_disable")
    for module in model.modules():
        _unwrap(module)
    if is_transformers_model(model):
        _transformers_disable(model)


def is_gradient_checkpointing(model: nn.Module) -> bool:
    """Whether any block of ``model`` is checkpointed (by fastload's wrappers or transformers').
    ``TypeError`` when ``model`` is not an ``nn.Module``."""
    check_module(model, "model", where="is_gradient_checkpointing")
    for module in model.modules():
        if _STATE_ATTR in module.__dict__:
            return True
        if getattr(module, "gradient_checkpointing", False) is True:  # transformers' flag
            return True
    return False


__all__ = [
    "gradient_checkpointing_enable",
    "gradient_checkpointing_disable",
    "is_gradient_checkpointing",
]


#: the key old transformers configs carry for what is now a run-time toggle (transformers #13657)
LEGACY_CONFIG_KEY = "gradient_checkpointing"


def drop_legacy_config_key(config: Any) -> bool:
    """Removes the legacy ``gradient_checkpointing`` attribute from a config object, so it is
    neither acted on when a model is built nor written back when one is saved; returns whether
    it asked for checkpointing."""
    values = vars(config)
    if LEGACY_CONFIG_KEY not in values:
        return False
    return bool(values.pop(LEGACY_CONFIG_KEY))
