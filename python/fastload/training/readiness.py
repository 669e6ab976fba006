"""Training readiness: which parameters get no gradient.

transformers #7272: a layer whose output the loss never uses (a BERT pooler under a token
classification head, say) gets no gradient, and DistributedDataParallel then fails at the next
step unless it is built with ``find_unused_parameters=True`` (which costs a graph traversal every
step). :func:`unused_parameters` finds those parameters with one forward/backward pass, so a
caller can freeze or drop them, or knowingly pass the flag.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch import nn

from fastload.core.basics.arguments import check_module
from fastload.core.basics.errors import RequestError


def _differentiable(value: Any) -> Iterator[torch.Tensor]:
    """Every floating-point tensor in ``value`` (nested tuples, lists, dicts, dataclasses and
    transformers' ``ModelOutput``) that is part of the autograd graph."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad and (value.is_floating_point() or value.is_complex()):
            yield value
    elif isinstance(value, Mapping):  # ModelOutput is an OrderedDict
        for item in value.values():
            yield from _differentiable(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _differentiable(item)
    elif is_dataclass(value) and not isinstance(value, type):
        for field in fields(value):
            yield from _differentiable(getattr(value, field.name))


def _default_loss(output: Any) -> torch.Tensor:
    outputs = list(_differentiable(output))
    if not outputs:
        raise RequestError(
            "unused_parameters: the model's output contains no tensor that requires grad, so no "
            "parameter can receive a gradient; pass loss_fn= to say how the output becomes a loss"
        )
    # Real part only, so complex outputs still give a real scalar; .sum() touches every element.
    return sum(torch.real(t).sum() for t in outputs)  # type: ignore[return-value]


def unused_parameters(
    model: nn.Module,
    *example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **example_kwargs: Any,
) -> list[str]:
    """Names of the trainable parameters that get no gradient from one forward/backward pass.

    Runs ``model(*example_inputs, **example_kwargs)`` in the model's current mode, turns the
    output into a scalar with ``loss_fn`` (default: the sum of every differentiable tensor in the
    output, so wrap the model the way training uses it if some output is ignored), and
    backpropagates. A parameter that is part of the graph counts as used even if its gradient
    is zero, which is what DistributedDataParallel checks. The ``.grad`` of every parameter is
    left as it was. Tied parameters are reported once, under their first name.

    Returns:
        The names, in ``model.named_parameters()`` order; empty when DDP needs no
        ``find_unused_parameters=True``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``loss_fn`` is neither ``None`` nor
            callable.
    """
    check_module(model, "model", where="unused_parameters")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"unused_parameters: loss_fn must be a callable or None, got "
            f"{type(loss_fn).__name__} {loss_fn!r}"
        )
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = [p.grad for _, p in params]
    try:
        for _, p in params:
            p.grad = None
        with torch.enable_grad():
            output = model(*example_inputs, **example_kwargs)
            loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise RequestError(
                    f"unused_parameters: loss_fn must return a one-element tensor, got "
                    f"{type(loss).__name__}"
                    + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                )
            if not loss.requires_grad:
                # Nothing in the graph: every trainable parameter is unused.
                return [n for n, _ in params]
            loss.backward()
        return [n for n, p in params if p.grad is None]
    finally:
        for (_, p), grad in zip(params, saved, strict=True):
            p.grad = grad


__all__ = ["unused_parameters"]
