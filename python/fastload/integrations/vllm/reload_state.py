"""What a vLLM engine's model holds, for :mod:`fastload.integrations.vllm.reload`: the
checkpoint its last successful fastload load or reload read (:class:`Held`), which layers each
checkpoint tensor feeds (:class:`FeedWatch`), and the checks and choices a reload makes against
it before anything moves.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fastload.core.basics.dtypes import CONVERTIBLE
from fastload.core.basics.errors import ReloadError, RequestError
from fastload.core.model.keys import format_names
from fastload.reloading.checks import refuse_unfit
from fastload.reloading.record import checkpoint_digests

#: stored tensor name -> (stored dtype, shape, file)
Catalog = dict[str, tuple[str, tuple[int, ...], str]]


@dataclass
class Held:
    """The checkpoint an engine's model holds: what the last successful fastload load or reload
    of it read."""

    #: ``model_config.model`` when it was read (a reload naming no path leaves it so)
    model_arg: str
    #: the directory or URL read
    source: str
    #: its tensors (``None``: not known, a pickle checkpoint)
    catalog: Catalog | None
    #: the digests its files record (empty: none, or they no longer describe the model)
    digests: dict[str, str]
    #: stored tensor -> the layers (module names) its copies went into, seen at the first load
    feeds: dict[str, frozenset[str]]
    #: layer -> elements the first load copied into it
    numel: dict[str, int]
    #: ``model_config`` fields a refused reload puts back (vLLM sets them before asking)
    config: dict[str, Any] = field(default_factory=dict)
    #: layer -> a sample of its tensors' bytes when a load or reload finished (:func:`sample`)
    samples: dict[str, list[torch.Tensor] | None] = field(default_factory=dict, repr=False)
    #: the forward pre-hook that refuses to run while the model is torn
    torn: Any = field(default=None, repr=False)


#: model -> what it holds (weak: the record goes with the model)
RECORDS: weakref.WeakKeyDictionary[nn.Module, Held] = weakref.WeakKeyDictionary()


def held(model: nn.Module) -> Held | None:
    """What ``model`` holds (``None``: fastload did not load it in this process)."""
    return RECORDS.get(model)


class FeedWatch(TorchFunctionMode):
    """During the first load's ``load_weights``: which layers each checkpoint tensor's copies go
    into, and how many elements each layer takes (``current()``: the tensor being consumed).
    Entered inside :class:`~fastload.integrations.vllm.adopt.CopyWatch`, so it sees every copy
    before that one takes it over."""

    def __init__(self, model: nn.Module, current: Callable[[], str | None]) -> None:
        super().__init__()
        self.current = current
        self._layers: dict[int, list[str]] = {}
        #: layer -> its elements (what vLLM's reload counts at most)
        self._size: dict[str, int] = {}
        for name, module in model.named_modules():
            for t in [*module._parameters.values(), *module._buffers.values()]:
                if t is not None and t.device.type != "meta" and t.numel():
                    self._layers.setdefault(t.untyped_storage().data_ptr(), []).append(name)
                    self._size[name] = self._size.get(name, 0) + t.numel()
        self.feeds: dict[str, set[str]] = {}
        self._numel: dict[str, int] = {}

    @property
    def numel(self) -> dict[str, int]:
        """Layer -> elements copied into it (at most its size: vLLM's reload counts so)."""
        return {k: min(v, self._size[k]) for k, v in self._numel.items()}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.Tensor.copy_ and args and isinstance(args[0], torch.Tensor):
            name = self.current()
            dst = args[0]
            layers = self._layers.get(dst.untyped_storage().data_ptr()) if name else None
            for layer in layers or ():
                self.feeds.setdefault(name, set()).add(layer)  # type: ignore[arg-type]
                self._numel[layer] = self._numel.get(layer, 0) + dst.numel()
        return func(*args, **(kwargs or {}))


def describe(stream: Any) -> tuple[Catalog | None, dict[str, str]]:
    """The tensors of a weight stream (:class:`~fastload.integrations.vllm.weights.
    CheckpointWeights` or :class:`~fastload.integrations.vllm.remote.RemoteWeights`) and the
    digests its files record."""
    ckpt = getattr(stream, "checkpoint", None)
    if ckpt is None:
        return stream.catalog(), stream.digests()
    catalog = {
        t.name: (t.st_dtype, tuple(t.shape), ckpt.file_path(t)) for t in ckpt.tensors.values()
    }
    return catalog, checkpoint_digests(ckpt)


def config_fields(model_config: Any) -> dict[str, Any]:
    return {k: getattr(model_config, k) for k in ("model", "model_weights", "revision")}


def _same_dtype_class(a: str, b: str) -> bool:
    return a == b or (a in CONVERTIBLE and b in CONVERTIBLE)


def check_fits(new: Catalog, old: Catalog, label: str, holds: str) -> None:
    """Refuses ``new`` unless it has exactly the tensors of ``old``, of the same shapes and of
    dtypes the weight loaders convert between, naming every tensor that does not fit."""
    shapes: list[str] = []
    other: list[str] = []
    for name, (st_dtype, shape, path) in sorted(new.items()):
        was = old.get(name)
        if was is None:
            continue
        if shape != was[1]:
            shapes.append(
                f"{path}: tensor {name!r} has shape {list(shape)}, the engine's was {list(was[1])}"
            )
        elif not _same_dtype_class(st_dtype, was[0]):
            other.append(
                f"{path}: tensor {name!r} is stored as {st_dtype}, the engine's as {was[0]}"
            )
    missing = sorted(set(old) - set(new))
    if missing:
        other.append(f"{len(missing)} tensors the engine's checkpoint has are missing: "
                     f"{format_names([repr(n) for n in missing])}")  # fmt: skip
    extra = sorted(set(new) - set(old))
    if extra:
        other.append(f"{len(extra)} tensors the engine's checkpoint did not have: "
                     f"{format_names([repr(n) for n in extra])}")  # fmt: skip
    refuse_unfit(
        shapes,
        other,
        f"{label} does not fit the model the engine serves ({holds}); reload_weights refused it "
        "before writing anything",
    )


#: elements sampled per tensor
SAMPLE = 64


def sample(layer: nn.Module) -> list[torch.Tensor] | None:
    """Bytes of :data:`SAMPLE` elements spread over each of ``layer``'s own tensors, copied (on
    their device); ``None`` where one cannot be sampled (on meta: vLLM has not finished it)."""
    out = []
    for t in [*layer._parameters.values(), *layer._buffers.values()]:
        if t is None or not t.numel():
            continue
        if t.is_meta or not t.is_contiguous():
            return None
        flat = t.detach().reshape(-1)
        picked = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].clone()
        out.append(picked.view(torch.uint8) if picked.dim() else picked)
    return out


def sample_layers(model: nn.Module, record: Held, names: set[str]) -> None:
    """Records a sample of each layer of ``names`` as the model holds it now."""
    for name in names:
        try:
            record.samples[name] = sample(model.get_submodule(name))
        except AttributeError:
            record.samples[name] = None


def moved(model: nn.Module, record: Held) -> set[str]:
    """The layers whose bytes are not what the last load or reload left (a sample differs, or
    none was taken): written since by something else (vLLM's sleep level 2 discards weights;
    a ``weights_iterator`` reload, an in-place edit), so a reload reads their inputs whatever
    the digests say."""
    out = set()
    for name in {layer for layers in record.feeds.values() for layer in layers}:
        then = record.samples.get(name)
        try:
            now = sample(model.get_submodule(name))
        except AttributeError:
            now = None
        if then is None or now is None or len(then) != len(now):
            out.add(name)
        elif not all(torch.equal(a, b) for a, b in zip(then, now, strict=True)):
            out.add(name)
    return out


def unchanged(
    record: Held,
    new: Catalog,
    new_digests: dict[str, str],
    stale: set[str] | None = None,
) -> set[str]:
    """The stored tensors a reload leaves out: every tensor feeding a layer none of whose
    inputs changed (equal digests in both checkpoints, same dtype) and whose bytes are still
    those the last load left (not in ``stale``). Nothing where a changed tensor's layers are
    not known (its copies were not seen: the model may buffer them)."""
    old = record.digests
    catalog = record.catalog or {}
    same = {
        name
        for name, (st_dtype, _, _) in new.items()
        if old.get(name) is not None
        and old.get(name) == new_digests.get(name)
        and catalog.get(name, ("",))[0] == st_dtype
    }
    changed_layers: set[str] = set(stale or ())
    for name in new:
        if name in same:
            continue
        feeds = record.feeds.get(name)
        if not feeds:
            return set()
        changed_layers |= feeds
    return {
        name
        for name in same
        if record.feeds.get(name) and not (record.feeds[name] & changed_layers)
    }


def mark(model: nn.Module, record: Held, names: list[str], message: str) -> None:
    """The model's forward raises ``ReloadError`` until a reload succeeds (:func:`unmark`)."""

    def refuse(module: nn.Module, args: Any) -> None:
        raise ReloadError(message, names)

    unmark(record)
    record.torn = model.register_forward_pre_hook(refuse)


def unmark(record: Held) -> None:
    if record.torn is not None:
        record.torn.remove()
        record.torn = None


def put_back(model_config: Any, record: Held) -> None:
    """The config fields vLLM set for a reload that did not happen: the next reload naming no
    path re-reads what the engine holds."""
    for key, value in record.config.items():
        setattr(model_config, key, value)


def choose_source(named: str, record: Held, weights_option: str | None) -> str:
    """What a reload reads: the path or URL the call named, or with none (``model_config.model``
    still the engine's model argument) the checkpoint the engine holds."""
    if named != record.model_arg:
        return named
    if weights_option is not None and os.path.isdir(named):
        if any(f.endswith((".safetensors", ".bin", ".pt")) for f in os.listdir(named)):
            raise RequestError(
                f"reload_weights: {named!r} is this engine's model argument, which names only its "
                f"config while its weights come from {record.source} (the 'weights' option), "
                "and it holds weight files: pass weights_path as the checkpoint to read (the "
                "directory under another name, or the object storage URL), or call "
                "reload_weights without weights_path to re-read the weights the engine holds"
            )
    return record.source


__all__ = [
    "RECORDS",
    "Catalog",
    "FeedWatch",
    "Held",
    "check_fits",
    "choose_source",
    "config_fields",
    "describe",
    "held",
    "mark",
    "moved",
    "put_back",
    "sample_layers",
    "unchanged",
    "unmark",
]
