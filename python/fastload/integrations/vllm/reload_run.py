"""One reload of a vLLM engine in progress (:class:`_Reload`, made by
:func:`~.reload.open_reload`): the stream of the tensors read, the check that the tensors left out
fed nothing vLLM still fills, and what happens when it ends (the layers left out get their kernel
tensors back, the record becomes the new checkpoint, the log line) or fails (every layer not yet
filled put back; the model marked torn where some took new bytes).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import ReloadError, RequestError
from fastload.core.basics.redaction import add_note, install, redact
from fastload.core.basics.units import format_bytes
from fastload.core.model.keys import format_names

from .adopt import CopyWatch
from .reload_state import (
    Catalog,
    Held,
    config_fields,
    mark,
    put_back,
    sample_layers,
    unmark,
)

#: the reload in progress on a model (between get_all_weights and the end of load_weights)
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, _Reload] = weakref.WeakKeyDictionary()


def _layerwise() -> tuple[Any, Callable[..., None]] | None:
    """vLLM's per-layer reload state and the function that puts a layer's kernel tensors back
    (``None`` where this vLLM has neither: a failure then leaves the layers as vLLM does)."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        return None
    info = getattr(layerwise, "LAYERWISE_INFO", None)
    place = getattr(layerwise, "_place_kernel_tensors", None)
    if info is None or place is None:
        return None
    return info, place


class _Reload:
    """One reload in progress on ``model``: the stream of the tensors read, and what happens
    when it ends or fails."""

    def __init__(
        self,
        model: nn.Module,
        model_config: Any,
        record: Held,
        stream: Any,
        weights: Iterator[tuple[str, torch.Tensor]],
        *,
        source: str,
        catalog: Catalog | None,
        digests: dict[str, str],
        left_out: set[str],
        watch: CopyWatch,
        log: Any,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.record = record
        self.stream = stream
        #: what is read (kept as given: a later reload naming no path reads it again)
        self.source = source
        #: what the log and the errors show: vLLM's logger has no redaction of its own
        self.label = redact(source)
        self.catalog = catalog
        self.digests = digests
        self.left_out = left_out
        #: the weight loaders' copies out of the stream's views, made by the engine
        self.watch = watch
        self.log = log
        install(log)  # whatever else is logged there about this reload
        self.start = time.perf_counter()
        #: layers all of whose inputs were left out (unchanged)
        self.unchanged_layers = {layer for name in left_out for layer in record.feeds.get(name, ())}
        self.iterator = self._iterate(weights)
        _ACTIVE[model] = self

    def _iterate(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from weights
        if self.left_out:
            self._check_complete()

    def _check_complete(self) -> None:
        """A layer left partly filled means a tensor left out feeds it after all (a weight
        loader that buffers): refused before vLLM would finish that layer from empty memory."""
        state = _layerwise()
        if state is None:
            return
        infos, _ = state
        short = []
        for name, layer in self.model.named_modules():
            info = infos.get(layer)
            if info is None or not info.can_load() or info.load_numel <= 0:
                continue
            if info.load_numel < self.record.numel.get(name, info.load_numel + 1):
                short.append(name)
        if short:
            raise RequestError(
                f"fastload: leaving out the tensors whose digests are unchanged left layers "
                f"partly filled: {format_names(short)} (this model's weight loaders do not copy "
                "each checkpoint tensor as it arrives); reload with "
                "model_loader_extra_config skip_unchanged=false"
            )

    def unchanged_params(self) -> set[str]:
        out = set()
        for name in self.unchanged_layers:
            module = self.model.get_submodule(name)
            out |= {
                f"{name}.{p}" if name else p for p, t in module._parameters.items() if t is not None
            }
        return out

    def finish(self) -> None:
        """The stream ended and the model took it: the layers left out get their kernel tensors
        back now (vLLM would warn that each failed to load), the record becomes the new
        checkpoint, a torn mark goes."""
        state = _layerwise()
        if state is not None:
            infos, place = state
            for name in self.unchanged_layers:
                layer = self.model.get_submodule(name)
                info = infos.get(layer)
                if info is not None and info.can_load() and info.load_numel == 0:
                    if info.kernel_tensors is not None:
                        place(layer, info)
                    info.reset()
        record = self.record
        record.model_arg = str(self.model_config.model)
        record.config = config_fields(self.model_config)
        record.source = self.source
        if self.catalog is not None:
            record.catalog = self.catalog
        record.digests = dict(self.digests)
        # what the layers hold now (those vLLM finishes after this are sampled as unknown)
        sample_layers(self.model, record, {n for f in record.feeds.values() for n in f})
        unmark(record)
        read = format_bytes(getattr(self.stream, "bytes", 0))
        fetched = getattr(self.stream, "fetched", None)  # tensor parallelism from a store
        if fetched is not None:
            read += f", of which this rank fetched {format_bytes(fetched.done)}: its slices"
        else:
            read += f", {format_bytes(self.watch.engine_bytes)} of it copied by the engine"
        kept = sum(_nbytes(*record.catalog[n][:2]) for n in self.left_out if record.catalog)
        self.log.info(
            "fastload: reloaded %s in %.2f s: %d tensors read (%s); %d unchanged tensors (%s, "
            "%d layers) neither read nor copied",
            self.label,
            time.perf_counter() - self.start,
            len(self.catalog or {}) - len(self.left_out),
            read,
            len(self.left_out),
            format_bytes(kept),
            len(self.unchanged_layers),
        )

    def recover(self, exc: BaseException) -> None:
        """After a failure inside ``load_weights``: every layer not yet filled gets its kernel
        tensors (its old weights) back; the error names the layers that took new bytes, if any,
        and the model then refuses to run (:func:`mark`)."""
        self.close()
        state = _layerwise()
        if state is None:
            raise exc
        infos, place = state
        fed = {layer for layers in self.record.feeds.values() for layer in layers}
        new: list[str] = []
        for name, layer in self.model.named_modules():
            info = infos.get(layer)
            if info is None:
                continue
            if info.can_load():
                if info.kernel_tensors is not None:
                    place(layer, info)
                info.reset()
            elif name in fed and name not in self.unchanged_layers:
                new.append(name)
        if not new:
            put_back(self.model_config, self.record)
            note = (
                "fastload: reload_weights failed before any layer took new weights; the engine "
                f"keeps its previous weights ({redact(self.record.source)}) whole"
            )
            # in the message itself where it can be (notes do not cross vLLM's RPC)
            if (
                exc.args
                and isinstance(exc.args[0], str)
                and type(exc).__str__ is BaseException.__str__
            ):
                exc.args = (f"{exc.args[0]}. {note}", *exc.args[1:])
            else:
                add_note(exc, note)
            raise exc
        self.record.digests = {}
        params = sorted(
            f"{n}.{p}" if n else p
            for n in new
            for p, t in self.model.get_submodule(n)._parameters.items()
            if t is not None
        )
        message = (
            f"fastload: reload_weights from {self.label} failed after {len(new)} layers "
            f"took new weights, the others keep their old ones: {format_names(params)}. The "
            "model refuses to run until a reload succeeds"
        )
        mark(self.model, self.record, params, message)
        if isinstance(exc, Exception):
            raise ReloadError(f"{message} ({type(exc).__name__}: {exc})", params) from exc
        add_note(exc, message)
        raise exc

    def close(self) -> None:
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()


def _nbytes(st_dtype: str, shape: tuple[int, ...]) -> int:
    from fastload import _core

    n = 1
    for s in shape:
        n *= s
    return n * _core.dtype_bits()[st_dtype] // 8
