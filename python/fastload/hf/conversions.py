"""transformers' tensor-merging conversions (MoE experts), planned as reads into slices.

transformers 5 saves a mixture-of-experts layer one tensor per expert
(``mlp.experts.3.gate_proj.weight``) and merges them when loading, through the
``WeightConverter`` entries of its conversion mapping (``transformers.conversion_mapping``): the
experts of each projection are stacked (``MergeModulelist``) and the stacks concatenated
(``Concatenate``, e.g. gate and up into ``gate_up_proj``). fastload reads the mapping of the model
at run time, so a new MoE architecture registered there loads without a change here, and turns
each merge into a plan: the merged tensor is allocated once, and every stored expert tensor is
read by the copy engine straight into its slice of it (a :class:`Piece`), with no intermediate
copy. A slice along the leading dimensions of a contiguous tensor is contiguous, so the engine
writes it in place.

Fused tensors transformers splits on load (``Chunk``, ``Split``: ``qkv`` into ``q``, ``k``, ``v``)
are planned the other way round: each model tensor reads its rows of the stored tensor (a
selection of the copy engine). Only ``MergeModulelist``/``Concatenate`` chains and a lone
``Chunk``/``Split`` are planned; a checkpoint needing another operation is refused with an error
naming the tensor as stored in the file.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastload.core.basics.errors import ModelMismatchError, UnsupportedError
from fastload.core.model import keys as keymod
from fastload.core.plan.hooks import Merge, Narrow, Piece, Select, View
from fastload.hf.renames import transformers_renames


def converters_of(model: Any, quantizer: Any = None) -> list[Any]:
    """The ``WeightConverter`` entries transformers registers for ``model`` (with those its
    ``quantizer`` adds for a pre-quantized checkpoint; none for a transformers version without
    conversion mappings)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return []
    mapping = get_model_conversion_mapping(model, hf_quantizer=quantizer)
    # a quantizer's general converters (its load operation alone) are fastload.hf.load_ops'
    return [
        t
        for t in mapping
        if isinstance(t, WeightConverter)
        and not all(getattr(op, "hf_quantizer", None) is not None for op in t.operations)
    ]


def transformers_merges(
    model: Any,
    ckpt: Any,
    model_keys: set[str],
    rules: keymod.KeyRules,
    *,
    quantizer: Any = None,
    taken: set[str] = frozenset(),  # type: ignore[assignment]
) -> dict[str, Merge]:
    """The merges and splits transformers' conversion mapping makes for ``model`` on the
    checkpoint ``ckpt`` (``rules``: how names map); empty when every stored name already is a
    model name or one of ``taken`` (the stored tensors a quantizer's load operation takes onto
    model tensors: fastload.hf.load_ops)."""
    known = model_keys.union(rules.computed)
    if all(k in taken or rules.rename(k) in known for k in ckpt.tensors):
        return {}
    converters = converters_of(model, quantizer)
    if not converters:
        return {}
    renames = transformers_renames(model, rules.source, quantizer)
    prefix = rules.base_model_prefix

    def rename(name: str) -> str:
        name = rules.rename(name)
        for r in renames:
            name = r(name)
        return name

    def resolve(name: str) -> str | None:
        name = keymod.adjust(name, prefix, model_keys)
        return name if name in model_keys else None

    shapes = {n: t.torch_shape for n, t in ckpt.tensors.items()}
    model_shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    return plan_merges(
        shapes,
        converters,
        rename=rename,
        resolve=resolve,
        model_shapes=model_shapes,
        source=rules.source,
    )


def _natural(name: str) -> list[Any]:
    # transformers collects a converter's tensors in this order (dot_natural_key)
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def plan_merges(
    names: Mapping[str, tuple[int, ...]],
    converters: Sequence[Any],
    *,
    rename: Callable[[str], str],
    resolve: Callable[[str], str | None],
    model_shapes: Mapping[str, tuple[int, ...]],
    source: str,
) -> dict[str, Merge]:
    """Plans the merges of the checkpoint tensors ``names`` (stored name -> shape).

    ``rename`` applies the renamings that come before a converter (the user's ``key_map`` and
    transformers' renamings); ``resolve`` turns a converted name into a model tensor name (the
    base-model prefix added or stripped) or ``None`` if the model has no such tensor;
    ``model_shapes`` are the model tensors' shapes. A stored tensor no converter matches, or whose
    target the model lacks, is left out of the plan.
    """
    if not converters:
        return {}
    collected: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    splits: dict[str, Merge] = {}
    for stored in sorted(names, key=_natural):
        renamed = rename(stored)
        for converter in converters:
            converted, pattern = converter.rename_source_key(renamed)
            if pattern is None:
                continue
            kinds = [type(op).__name__ for op in converter.operations]
            if kinds in (["Chunk"], ["Split"]):
                _check_own_operations(converter, stored, source)
                splits.update(
                    _split(
                        stored, names[stored], converted, converter, resolve, model_shapes, source
                    )
                )
                break
            target = resolve(converted)
            if target is not None:
                _check_own_operations(converter, stored, source)
                entry = collected.setdefault(target, (converter, {}))
                entry[1].setdefault(pattern, []).append(stored)
            break
    merges = {
        target: _merge(target, converter, by_pattern, names, source)
        for target, (converter, by_pattern) in collected.items()
    }
    merges.update(splits)
    return merges


#: the operations fastload plans as reads: merges of expert tensors, splits of fused ones
PLANNED = ("MergeModulelist", "Concatenate", "Chunk", "Split")


def _unplanned(converter: Any, stored: str, source: str) -> UnsupportedError:
    """The refusal of a conversion fastload does not plan, naming the operation it lacks
    (``PermuteForRope`` in a ``Chunk`` then ``PermuteForRope`` conversion)."""
    kinds = [type(op).__name__ for op in converter.operations]
    lacking = next((k for k in kinds if k not in PLANNED), kinds[0])
    steps = f" ({' then '.join(kinds)})" if len(kinds) > 1 else ""
    return UnsupportedError(
        f"{source}: tensor {stored!r} needs transformers' {lacking} conversion{steps}: "
        f"{converter.source_patterns} -> {converter.target_patterns}; fastload plans merges of "
        "expert tensors (MergeModulelist, Concatenate) and splits of fused ones (Chunk, Split) "
        "alone. Load it once with transformers and save it with fastload.save_pretrained"
    )


def _conversion_error(text: str) -> ModelMismatchError:
    """A conversion that cannot be made: a ``RuntimeError`` (and a ``CheckpointError``) in
    transformers' words, as its loader raises after a failed conversion."""
    return ModelMismatchError(
        f"We encountered some issues during automatic conversion of the weights: {text}"
    )


def _check_own_operations(converter: Any, stored: str, source: str) -> None:
    """``UnsupportedError`` unless every operation of ``converter`` is transformers' own class
    with transformers' own ``convert``: fastload plans what transformers' operations do, and an
    operation replaced or patched (a subclass, a plugin, a mock) may do anything else."""
    for op in converter.operations:
        cls = type(op)
        if getattr(op, "hf_quantizer", None) is not None:  # what a quantizer runs on load
            raise UnsupportedError(
                f"{source}: tensor {stored!r} needs {cls.__qualname__}, a load operation of "
                "transformers' quantizer (here before the conversion "
                f"{converter.source_patterns} -> {converter.target_patterns}); fastload reads "
                "quantized tensors as they are stored and runs no load operation: load it with "
                "transformers"
            )
        convert = getattr(cls, "convert", None)
        own = (
            cls.__module__ == "transformers.core_model_loading"
            and inspect.isfunction(convert)
            and convert.__module__ == cls.__module__
            and convert.__qualname__ == f"{cls.__name__}.convert"
        )
        if not own:
            raise UnsupportedError(
                f"{source}: tensor {stored!r} needs the conversion {cls.__qualname__}, whose "
                "convert is not transformers' own (replaced or patched); fastload only plans "
                "transformers' own conversions: load it with transformers"
            )


def _split(
    stored: str,
    shape: tuple[int, ...],
    converted: str,
    converter: Any,
    resolve: Callable[[str], str | None],
    model_shapes: Mapping[str, tuple[int, ...]],
    source: str,
) -> dict[str, Merge]:
    """Each model tensor a fused stored tensor is split into, reading its part of it."""
    op = converter.operations[0]
    first = converter.target_patterns[0]
    targets = [resolve(converted.replace(first, t, 1)) for t in converter.target_patterns]
    if any(t is None for t in targets):
        return {}  # the model lacks a part: the stored tensor is reported unexpected
    if getattr(op, "num_shards_attribute", None) is not None:
        raise UnsupportedError(
            f"{source}: tensor {stored!r} needs transformers' Chunk conversion with a "
            "config-dependent number of parts, which fastload does not plan"
        )
    dim = op.dim % len(shape)
    length = shape[dim]
    if type(op).__name__ == "Chunk":
        step = -(-length // len(targets))
        sizes = [min(step, length - i * step) for i in range(len(targets))]
    else:
        sizes = [model_shapes[t][dim] for t in targets]  # type: ignore[index]
    if any(size <= 0 for size in sizes) or sum(sizes) != length:
        raise _conversion_error(
            f"{source}: tensor {stored!r} has shape {list(shape)}; it cannot be split along "
            f"dimension {dim} into the model's {targets}"
        )
    out: dict[str, Merge] = {}
    start = 0
    for target, size in zip(targets, sizes, strict=True):
        part = list(shape)
        part[dim] = size
        out[target] = Merge(target, tuple(part), [Piece(stored, (), (dim, start, start + size))])  # type: ignore[index]
        start += size
    return out


def _merge(
    target: str,
    converter: Any,
    by_pattern: dict[str, list[str]],
    names: Mapping[str, tuple[int, ...]],
    source: str,
) -> Merge:
    # Each intermediate tensor is (shape, [(stored name, views from it to the piece)]).
    parts: dict[str, tuple[tuple[int, ...], list[tuple[str, tuple[View, ...]]]] | list[str]]
    parts = dict(by_pattern)
    first = next(iter(by_pattern.values()))[0]
    for op in converter.operations:
        kind = type(op).__name__
        if kind == "MergeModulelist":
            parts = {p: _stack(v, op.dim, names, source) for p, v in parts.items()}
        elif kind == "Concatenate":
            order = [p for p in converter.source_patterns if p in parts]
            leaves = [leaf for p in order for leaf in _leaves(parts[p], names)]
            parts = {"": _concatenate(leaves, op.dim, source)}
        else:
            raise _unplanned(converter, first, source)
    if len(parts) != 1:
        raise UnsupportedError(
            f"{source}: tensor {first!r}: transformers' conversion {converter.source_patterns} -> "
            f"{converter.target_patterns} does not end in one tensor"
        )
    shape, pieces = next(iter(parts.values()))  # type: ignore[misc]
    return Merge(target, tuple(shape), [Piece(n, v) for n, v in pieces])


def _leaves(part: Any, names: Mapping[str, tuple[int, ...]]) -> list[Any]:
    """A merged part as is, or each stored tensor of a list not merged yet as its own part."""
    if isinstance(part, tuple):
        return [part]
    return [(tuple(names[n]), [(n, ())]) for n in part]


def _stack(
    stored: Any, dim: int, names: Mapping[str, tuple[int, ...]], source: str
) -> tuple[tuple[int, ...], list[tuple[str, tuple[View, ...]]]]:
    if isinstance(stored, tuple):  # already merged: stacking one tensor is the identity
        return stored
    shapes = {tuple(names[n]) for n in stored}
    if len(shapes) != 1:
        listed = ", ".join(f"{n!r} {list(names[n])}" for n in stored)
        raise _conversion_error(f"{source}: expert tensors to stack differ in shape: {listed}")
    shape = list(shapes.pop())
    dim = dim if dim >= 0 else dim + len(shape) + 1
    merged = tuple(shape[:dim] + [len(stored)] + shape[dim:])
    return merged, [(n, (Select(dim, i),)) for i, n in enumerate(stored)]


def _concatenate(
    parts: list[Any], dim: int, source: str
) -> tuple[tuple[int, ...], list[tuple[str, tuple[View, ...]]]]:
    shapes = [list(p[0]) for p in parts]
    dim = dim if dim >= 0 else dim + len(shapes[0])
    rest = {tuple(s[:dim] + s[dim + 1 :]) for s in shapes}
    if len(rest) != 1:
        stored = ", ".join(repr(p[1][0][0]) for p in parts)
        raise _conversion_error(
            f"{source}: tensors {stored} cannot be concatenated along dimension {dim}: shapes "
            f"{shapes}"
        )
    pieces: list[tuple[str, tuple[View, ...]]] = []
    offset = 0
    for shape, (_, inner) in zip(shapes, parts, strict=True):
        step = Narrow(dim, offset, shape[dim])
        pieces += [(n, (step, *views)) for n, views in inner]
        offset += shape[dim]
    merged = shapes[0][:]
    merged[dim] = offset
    return tuple(merged), pieces
