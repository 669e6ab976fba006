"""What a load fills (:class:`Target`): a module passed in, or a function building the skeleton,
and the model family's hooks the entry chose for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import RequestError
from fastload.core.model.skeleton import build_skeleton
from fastload.core.plan.hooks import ModelHooks

__all__ = ["Target", "plain_target"]


@dataclass
class Target:
    """What a load fills: an already-built ``module`` (loaded in place, its train/eval mode kept)
    or a ``build`` function that makes the skeleton under a dtype (the model is then fastload's
    and ends in eval mode).

    The model family's hooks are chosen by the entry of the load: ``hooks`` when it knows the
    family up front, else ``choose_hooks`` is asked once the module exists (a factory's model);
    a plain ``nn.Module``'s by default."""

    module: nn.Module | None = None
    build: Callable[[torch.dtype | None], nn.Module] | None = None
    hooks: ModelHooks | None = None
    choose_hooks: Callable[[nn.Module], ModelHooks] = lambda module: ModelHooks()


def plain_target(
    model: Any,
    config: Any,
    model_kwargs: dict[str, Any],
    choose_hooks: Callable[[nn.Module], ModelHooks] | None = None,
) -> Target:
    """The target for an ``nn.Module`` passed in, or any module class or factory (called with
    ``**model_kwargs``, or ``(config, **model_kwargs)`` when ``config`` is given)."""
    if isinstance(model, nn.Module):
        if config is not None or model_kwargs:
            raise RequestError(
                "config and model keyword arguments only apply when fastload builds the model; "
                f"got an already-built {type(model).__name__} (and {sorted(model_kwargs)})"
            )
        target = Target(module=model)
    elif not callable(model):
        raise RequestError(
            "model must be an nn.Module class, a factory, a built module, a model id or "
            f"directory, or None; got {model!r}"
        )
    else:
        args = () if config is None else (config,)

        def build(dtype: torch.dtype | None) -> nn.Module:
            return build_skeleton(lambda: model(*args, **model_kwargs), dtype=dtype)

        target = Target(build=build)
    if choose_hooks is not None:
        target.choose_hooks = choose_hooks
    return target
