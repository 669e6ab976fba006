"""transformers' own initialization around a fastload load, as its ``from_pretrained`` does it.

* while the skeleton is built: transformers' weight initialisation switched off (pointless on
  meta) and the classes users registered with ``transformers.monkey_patching`` swapped in
  (:func:`build_contexts`); afterwards its output recorders and ``tie_weights()``
  (:func:`prepare`), so ties declared through ``_tied_weights_keys`` are visible by Parameter
  identity;
* tensors the checkpoint lacks: the model's ``initialize_weights`` on them alone (loaded tensors
  are flagged ``_is_hf_initialized`` so its guarded init functions skip them)
  (:func:`initialize_missing`);
* after loading: non-persistent buffers recomputed (:func:`recompute_buffers`) and every tensor
  flagged as initialized (:func:`mark_initialized`).

Models that contain transformers models (a plain container of a ``BertModel``) get this for each
outermost transformers model inside them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastload.core.model.keys import within
from fastload.families import is_transformers_model

#: transformers' flag on a tensor (or module) already initialized: its init functions skip it
HF_FLAG = "_is_hf_initialized"


def build_contexts() -> list[Callable[[], contextlib.AbstractContextManager[Any]]]:
    """What a transformers model is built under (the switches its ``from_pretrained`` sets)."""
    contexts = []
    no_init = _transformers_attr("initialization", "no_init_weights")
    if no_init is not None:
        contexts.append(no_init)
    patches = _transformers_attr("monkey_patching", "apply_patches")
    if patches is not None:
        # Classes users registered with transformers.monkey_patching are swapped in during
        # __init__, as transformers' own from_pretrained does.
        contexts.append(patches)
    return contexts


def prepare(model: nn.Module) -> None:
    """Right after a transformers model's skeleton is built: its output recorders, and its ties
    made visible by Parameter identity."""
    if not is_transformers_model(model):
        return
    recorders = _transformers_attr("monkey_patching", "patch_output_recorders")
    if recorders is not None:
        recorders(model)
    model.tie_weights()


def initialize_missing(model: nn.Module, targets: dict[str, torch.Tensor]) -> set[str]:
    """Initializes the targets (model name -> NaN-filled tensor in the model) that lie in a
    transformers model inside ``model`` with its ``initialize_weights``; returns their names."""
    ids = {id(t) for t in targets.values()}
    done: set[str] = set()
    for root_name, root in _transformers_roots(model):
        names = [n for n in targets if within(root_name, n)]
        if names:
            _initialize_transformers(root, ids)
            done.update(names)
    return done


def _transformers_attr(module: str, name: str) -> Any:
    """``transformers.<module>.<name>``, or ``None`` in a transformers version without it."""
    import importlib

    try:
        return getattr(importlib.import_module(f"transformers.{module}"), name, None)
    except ImportError:
        return None


def _transformers_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers models inside ``model`` (``model`` itself if it is one)."""
    if is_transformers_model(model):
        return [("", model)]  # everything inside is under it: no walk
    roots: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not is_transformers_model(module):
            continue
        if any(within(r, name) for r, _ in roots):
            continue
        roots.append((name, module))
    return roots


def _under(name: str, root: str) -> bool:
    return within(root, name)


def _initialize_transformers(
    root: nn.Module, ids: set[int], *, parameters: bool = True, every_module: bool = False
) -> None:
    """Runs the model's own ``initialize_weights`` on the tensors whose ids are in ``ids``.

    As in transformers' ``from_pretrained``: every other tensor is flagged, so its guarded init
    functions skip it, and a tie group is initialized through its source only (the names
    ``all_tied_weights_keys`` lists as tied to another get a flagged stand-in meanwhile), so an
    embedding tied to a head keeps the embedding's init, padding row zeroed. Going further than
    transformers, a module whose whole subtree is flagged is skipped, so an init function writing
    through a view (Funnel zeroes ``word_embeddings.weight[padding_idx]``) never touches a loaded
    tensor; ``every_module=True`` runs every module's init as transformers does.
    """
    tied_targets = set(getattr(root, "all_tied_weights_keys", None) or ())
    stand_ins: list[tuple[dict[str, Any], str, Any]] = []
    by_tensor: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for prefix, module in root.named_modules(remove_duplicate=False) if parameters else ():
        for attr, param in module._parameters.items():
            if param is not None and id(param) in ids:
                name = f"{prefix}.{attr}" if prefix else attr
                by_tensor.setdefault(id(param), []).append((name, module, attr))
    for members in by_tensor.values():
        if len(members) < 2:
            continue
        sources = [m for m in members if m[0] not in tied_targets] or members[:1]
        for name, module, attr in members:
            if (name, module, attr) == sources[0]:
                continue
            param = module._parameters[attr]
            stand_in = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
            setattr(stand_in, HF_FLAG, True)
            stand_ins.append((module._parameters, attr, param))
            module._parameters[attr] = stand_in
    try:
        for module in root.modules():
            for tensor in _own_tensors(module):
                if id(tensor) in ids:
                    tensor.__dict__.pop(HF_FLAG, None)
                else:
                    tensor.__dict__[HF_FLAG] = True
        if every_module:
            for module in root.modules():
                module.__dict__.pop(HF_FLAG, None)
        else:
            _flag_loaded_subtrees(root, ids)
        root.initialize_weights()
    finally:
        for store, attr, param in reversed(stand_ins):
            store[attr] = param


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers ``module`` holds itself (not its children's)."""
    return [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]


def _flag_loaded_subtrees(root: nn.Module, ids: set[int]) -> bool:
    """Flags each module none of whose tensors (its own or its descendants') is a target;
    returns whether ``root`` has a target."""
    has = any(id(t) in ids for t in _own_tensors(root))
    for child in root.children():
        has = _flag_loaded_subtrees(child, ids) or has
    # through __dict__: nn.Module.__setattr__ costs ~8 us of checks per call, the same effect
    if has:
        root.__dict__.pop(HF_FLAG, None)
    else:
        root.__dict__[HF_FLAG] = True
    return has


def recompute_buffers(model: nn.Module, *, every_module: bool = False) -> None:
    """Recomputes the non-persistent buffers of the transformers models in ``model`` with their
    own init functions, as transformers' ``from_pretrained`` does after loading.

    transformers builds on ``meta`` and fills these buffers by ``_init_weights`` in float32 math
    cast to the buffer's dtype; a value ``__init__`` computed under a bfloat16 default dtype
    differs (GPT-J's ``embed_positions`` by up to 0.2). A buffer no init function covers keeps
    the value ``__init__`` computed.

    ``every_module=True`` (under the patch, where transformers' result is the contract) runs
    every module's init function, loaded ones included, as transformers' ``from_pretrained``
    does: an init writing through a view of a loaded tensor changes it there too (Funnel zeroes
    the stored ``word_embeddings`` row at ``pad_token_id``).
    """
    for _, root in _transformers_roots(model):
        buffers = [
            b
            for m in root.modules()
            for n, b in m._buffers.items()
            if b is not None and n in m._non_persistent_buffers_set
        ]
        if buffers or every_module:  # buffers only: no tied parameters to stand in for
            ids = {id(b) for b in buffers}
            _initialize_transformers(root, ids, parameters=False, every_module=every_module)


def mark_initialized(model: nn.Module) -> None:
    """Flags every tensor and module of the transformers models in ``model`` as initialised.

    This is the state transformers' own ``from_pretrained`` leaves, so a later
    ``initialize_weights()`` (e.g. from ``resize_token_embeddings``) does not overwrite loaded
    weights.
    """
    for _, root in _transformers_roots(model):
        for module in root.modules():  # one walk, flags set through __dict__ (see above)
            for tensor in _own_tensors(module):
                tensor.__dict__[HF_FLAG] = True
            module.__dict__[HF_FLAG] = True
