"""Tensor-parallel loading: each rank reads only the rows or columns of the weights it owns.

A plan maps parameter-name patterns to a style, as transformers' ``base_model_tp_plan`` does:

* ``"colwise"``: an ``nn.Linear`` is split along its outputs. Its weight ``[out, in]`` is sliced
  along dim 0 and its bias ``[out]`` likewise; each rank computes a slice of the output features.
* ``"rowwise"``: split along its inputs. The weight is sliced along dim 1 (one strided read per
  row in the copy engine; the rank never reads the other columns) and the bias is replicated.
  Each rank computes a partial sum, which is all-reduced over the process group: ``from_pretrained``
  installs that reduction on the module (the bias is added once, after it), and the matching
  gradient reduction on column-parallel inputs (:func:`parallelize`).
* ``"replicate"``: every rank reads the whole tensor. Names no pattern matches are replicated too.

Patterns are dotted names where ``*`` matches within one name component (``layers.*.mlp.up_proj``).
A pattern matches a parameter when it matches the parameter's module name or the full name, as a
suffix at a component boundary, so ``"layers.*.mlp.up_proj"`` matches
``model.layers.3.mlp.up_proj.weight`` whatever the model's prefix. The first pattern that matches
(in the plan's order) decides.

Uneven sizes are an error: a dimension that ``world_size`` does not divide raises
``RequestError`` naming the tensor, rather than giving ranks shards of different sizes that the
model's reshapes (attention heads) would silently mis-split.

The model is described at its full size (a skeleton on ``meta``); after loading, each sharded
parameter holds only the rank's shard, and ``nn.Linear.in_features``/``out_features`` say so.
"""

from __future__ import annotations

import logging
import re
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import RequestError, UnsupportedError

logger = logging.getLogger("fastload")

STYLES = ("colwise", "rowwise", "replicate")

#: The plan for Llama-style decoders (Llama, Mistral, Qwen2, ...): attention projections and the
#: MLP's gate/up are column-parallel, the output and down projections row-parallel; embeddings,
#: norms and the LM head are replicated. Equal to transformers' ``LlamaConfig.base_model_tp_plan``
#: plus the replicated entries, which are spelled out for readers.
LLAMA_TP_PLAN: dict[str, str] = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "embed_tokens": "replicate",
    "*norm": "replicate",
    "lm_head": "replicate",
}

#: ready plans, by the name ``from_pretrained(tp_plan=...)`` accepts
PLANS: dict[str, dict[str, str]] = {"llama": LLAMA_TP_PLAN}

Selection = list[int] | None


def _compile(pattern: str) -> re.Pattern[str]:
    body = ".".join(
        "[^.]*".join(re.escape(piece) for piece in part.split("*")) for part in pattern.split(".")
    )
    # the module name (then ".weight"/".bias") or the full parameter name, at a component boundary
    return re.compile(rf"(?:^|\.){body}(?:\.[^.]+)?$")


def check_plan(plan: Mapping[str, str], *, where: str = "tp_plan") -> dict[str, str]:
    """``plan`` as a dict, every style checked (``UnsupportedError`` for styles such as
    transformers' ``"colwise_gather_output"`` that fastload does not implement)."""
    if not isinstance(plan, Mapping):
        raise RequestError(f"{where} must be a dict of name pattern -> style, got {plan!r}")
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise RequestError(f"{where}: pattern {pattern!r} is not a non-empty str")
        if style not in STYLES:
            raise UnsupportedError(
                f"{where}: style {style!r} of {pattern!r} is not supported; use one of {STYLES}"
            )
        out[pattern] = style
    return out


def shard_range(size: int, rank: int, world_size: int, *, name: str, dim: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s equal share of ``size`` (``RequestError`` if uneven)."""
    if size % world_size:
        raise RequestError(
            f"tensor parallel: {name!r} has size {size} along dim {dim}, which does not split "
            f"evenly over {world_size} ranks"
        )
    chunk = size // world_size
    return rank * chunk, (rank + 1) * chunk


@dataclass
class TPLayout:
    """A checked plan for one rank of a ``world_size``-rank group."""

    plan: dict[str, str]
    rank: int
    world_size: int
    _compiled: list[tuple[str, re.Pattern[str], str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.plan = check_plan(self.plan)
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise RequestError(f"tensor parallel: world_size must be >= 1, got {self.world_size}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise RequestError(
                f"tensor parallel: rank {self.rank} is outside [0, {self.world_size})"
            )
        self._compiled = [(p, _compile(p), s) for p, s in self.plan.items()]

    def style(self, name: str) -> str:
        """The style of parameter ``name``: the first matching pattern's, else ``"replicate"``."""
        for _, regex, style in self._compiled:
            if regex.search(name):
                return style
        return "replicate"

    def dim(self, name: str, ndim: int) -> int | None:
        """The dimension parameter ``name`` (with ``ndim`` dimensions) is split along, if any."""
        style = self.style(name)
        if style == "colwise" and ndim >= 1:
            return 0
        if style == "rowwise" and ndim >= 2:
            return 1
        return None  # replicated, a rowwise bias, or a scalar

    def selection(self, name: str, shape: Sequence[int]) -> Selection:
        """``[dim, start, stop]`` of this rank's shard of the full-size tensor ``name``, or
        ``None`` when the rank takes the whole tensor."""
        dim = self.dim(name, len(shape))
        if dim is None or self.world_size == 1:
            return None
        start, stop = shard_range(int(shape[dim]), self.rank, self.world_size, name=name, dim=dim)
        return [dim, start, stop]

    def unused_patterns(self, names: Iterable[str]) -> list[str]:
        """Patterns of the plan that match none of ``names`` (likely typos)."""
        names = list(names)
        return [p for p, regex, _ in self._compiled if not any(regex.search(n) for n in names)]


def shard_selections(
    plan: Mapping[str, str], shapes: Mapping[str, Sequence[int]], rank: int, world_size: int
) -> dict[str, Selection]:
    """``{name: selection}`` for every tensor of ``shapes`` (full sizes) on rank ``rank``."""
    layout = TPLayout(dict(plan), rank, world_size)
    return {name: layout.selection(name, shape) for name, shape in shapes.items()}


def resolve_tp_plan(tp_plan: str | Mapping[str, str], model: nn.Module) -> dict[str, str]:
    """The plan ``from_pretrained(tp_plan=...)`` means: a dict, the name of a ready plan
    (``"llama"``), or ``"auto"`` for the plan a transformers config declares
    (``config.base_model_tp_plan``)."""
    if isinstance(tp_plan, str):
        if tp_plan == "auto":
            declared = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
            if not declared:
                raise RequestError(
                    f"tp_plan='auto': {type(model).__name__} declares no base_model_tp_plan; "
                    f"pass a plan (ready ones: {sorted(PLANS)})"
                )
            return check_plan(declared, where=f"{type(model).__name__}.config.base_model_tp_plan")
        if tp_plan not in PLANS:
            raise RequestError(
                f"tp_plan {tp_plan!r} is not a ready plan ({sorted(PLANS)}), 'auto' or a dict"
            )
        return dict(PLANS[tp_plan])
    return check_plan(tp_plan)


def layout_for(
    tp_plan: str | Mapping[str, str], model: nn.Module, process_group: Any = None
) -> TPLayout:
    """The layout of this process's rank in ``process_group`` (default: the world group of an
    initialized ``torch.distributed``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RequestError(
            "tp_plan needs torch.distributed: call torch.distributed.init_process_group first"
        )
    plan = resolve_tp_plan(tp_plan, model)
    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    if rank < 0:
        raise RequestError("tp_plan: this process is not a member of process_group")
    return TPLayout(plan, rank, world)


# --------------------------------------------------------------------------------------------
# After loading: make the sharded modules compute their part.
# --------------------------------------------------------------------------------------------


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: after a row-parallel layer, every rank's
    partial sum enters the output with weight one (Megatron's "reduce from the tensor-parallel
    region")."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SharedInput(torch.autograd.Function):
    """Identity forward, all-reduce backward: the replicated input of a column-parallel layer
    gets a gradient from every rank's columns (Megatron's "copy to the tensor-parallel region"),
    so the replicated parameters before it train as in the full model."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _rowwise_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    partial = nn.functional.linear(x, self.weight)
    out = _SumOverRanks.apply(partial, self._fastload_tp_group)
    return out if self.bias is None else out + self.bias


def _colwise_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        x = _SharedInput.apply(x, self._fastload_tp_group)
    return nn.functional.linear(x, self.weight, self.bias)


def parallelize(model: nn.Module, layout: TPLayout, process_group: Any = None) -> list[str]:
    """Adapts the ``nn.Linear`` modules whose weights were loaded as shards; returns their names.

    A row-parallel ``nn.Linear`` all-reduces its partial product and then adds its (replicated)
    bias once. A column-parallel one computes the rank's slice of the output features as it is;
    in the backward pass the gradient of its (replicated) input is all-reduced, so the model also
    trains as the full one does. ``in_features``/``out_features`` are set to the local sizes.
    Other modules with a sharded weight hold their shard as loaded, and a warning says their
    ``forward`` is left as it is.
    """
    if layout.world_size == 1:
        return []
    adapted: list[str] = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        full = f"{name}.weight" if name else "weight"
        dim = layout.dim(full, weight.dim())
        if dim is None:
            continue
        if not isinstance(module, nn.Linear):
            logger.warning(
                "tensor parallel: %s (%s) holds a %s shard of its weight; fastload adapts only "
                "nn.Linear modules, its forward is left unchanged",
                name,
                type(module).__name__,
                layout.style(full),
            )
            continue
        module.out_features, module.in_features = weight.shape[0], weight.shape[1]
        module._fastload_tp_group = process_group
        rowwise = layout.style(full) == "rowwise"
        forward = _rowwise_linear_forward if rowwise else _colwise_linear_forward
        module.forward = types.MethodType(forward, module)
        adapted.append(name)
    return adapted


__all__ = [
    "LLAMA_TP_PLAN",
    "PLANS",
    "STYLES",
    "TPLayout",
    "check_plan",
    "layout_for",
    "parallelize",
    "resolve_tp_plan",
    "shard_range",
    "shard_selections",
]
