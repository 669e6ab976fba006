"""Reloading a running vLLM engine through fastload: ``collective_rpc("reload_weights", ...)``.

vLLM's ``reload_weights`` (``vllm/model_executor/model_loader/reload/``) makes a new loader of the
engine's load format, sets ``model_config.model`` to the call's ``weights_path``, asks the loader
for ``get_all_weights(model_config, model)``, then puts every layer of the model back on the meta
device and runs the model's ``load_weights``: a layer is materialized, filled, post-processed and
copied into the memory the model runs on (its kernel tensors, whose ``data_ptr`` CUDA graphs hold)
when its last weight arrives; a layer that received nothing gets its kernel tensors back at the
end. Around that, fastload's loader (:meth:`FastloadModelLoader.get_all_weights`) adds:

* **what the call names is read**: ``weights_path`` (a directory or an object storage URL); with
  no path, the checkpoint the engine holds (for an engine started with the ``weights`` option, that
  URL). A path that could mean either (the model argument of a ``weights`` engine, holding weight
  files) is refused, never read as the old URL silently;
* **checked before anything moves**: every header is validated and every tensor's name, shape and
  dtype compared with the checkpoint the engine holds, in ``get_all_weights``, before vLLM puts a
  layer on meta: a checkpoint that does not fit is refused naming the tensors, the model and its
  config untouched;
* **only what changed** (the ``skip_unchanged`` option, on by default): where both checkpoints
  carry fastload digests (``save_pretrained(..., digests=True)``), a layer all of whose checkpoint
  tensors have equal digests is neither read nor copied. The unit is vLLM's layer, not the tensor:
  a fused parameter (qkv from q/k/v, gate_up from gate/up) is rebuilt from all of its inputs when
  any one changed, because vLLM re-materializes the whole layer. Which tensors feed which layer is
  seen once, at the first load (:class:`FeedWatch`);
* **each rank its slices**: under tensor parallelism a rank reads only what its weight loaders
  take, from object storage too: the tensors are handed out unread as at the first load
  (:mod:`.remote_slices`), and the log says what the rank fetched;
* **never torn**: a failure during the reload (a shard truncated or replaced, a read error, an
  error in vLLM's code) puts back every layer not yet filled, so they keep their old weights;
  where no layer had taken new bytes, the model is whole and the error says so; otherwise it
  raises :class:`~fastload.core.basics.errors.ReloadError` naming the layers that did, and the
  model's forward refuses to run (that error again) until a reload succeeds (:mod:`.reload_run`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fastload.core.store.object_store import is_url

from .adopt import CopyWatch
from .reload_run import _ACTIVE, _Reload
from .reload_state import (
    RECORDS,
    FeedWatch,
    Held,
    check_fits,
    choose_source,
    config_fields,
    describe,
    held,
    moved,
    put_back,
    sample_layers,
    unchanged,
)


def remember(
    model: nn.Module, model_config: Any, source: str, stream: Any, watch: FeedWatch
) -> None:
    """Records what the first load of ``model`` read (``stream``, the primary weights, from
    ``source``), and routes later ``load_weights`` calls through :func:`_load_weights` (a
    reload's checks and recovery; any other caller's weights make the digests stale)."""
    catalog, digests = describe(stream)
    RECORDS[model] = Held(
        model_arg=str(model_config.model),
        source=source,
        catalog=catalog,
        digests=digests,
        feeds={k: frozenset(v) for k, v in watch.feeds.items()},
        numel=watch.numel,
        config=config_fields(model_config),
    )
    if "load_weights" not in model.__dict__:
        # the class's function and a weak reference: the model keeps no cycle through itself
        method = type(model).load_weights
        ref = weakref.ref(model)

        def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
            m = ref()
            assert m is not None
            return _load_weights(m, lambda w: method(m, w), weights)

        model.load_weights = load_weights  # type: ignore[method-assign]


def _load_weights(model: nn.Module, original: Callable[..., Any], weights: Any) -> Any:
    active = _ACTIVE.get(model)
    record = RECORDS.get(model)
    if active is None or weights is not active.iterator:
        # weights from elsewhere (a reload with a weights_iterator, an RL framework's sync): the
        # digests no longer say what the model holds, so the next reload reads every tensor
        if record is not None:
            record.digests = {}
        return original(weights)
    try:
        with active.watch:
            loaded = original(weights)
        active.finish()
    except BaseException as exc:
        active.recover(exc)  # raises
    finally:
        _ACTIVE.pop(model, None)
        active.close()
    if isinstance(loaded, set):
        loaded |= active.unchanged_params()
    return loaded


def seal(model: nn.Module) -> None:
    """After the first load's post-processing: a sample of what each layer holds, to tell at
    a reload whether anything else wrote into it since (:func:`~.reload_state.moved`)."""
    record = RECORDS.get(model)
    if record is not None:
        sample_layers(model, record, {n for f in record.feeds.values() for n in f})


def open_reload(
    loader: Any, model_config: Any, model: nn.Module, record: Held, log: Any, tp_size: int = 1
) -> Any:
    """What :meth:`FastloadModelLoader.get_all_weights` returns for a reload: the new
    checkpoint opened, validated and checked against the one the engine holds, the unchanged
    tensors left out, before vLLM touches a layer (a refusal here leaves the model and its config
    as they were)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    from .remote import RemoteWeights
    from .share import share_group

    options = loader.options
    # An accelerator's weights go through the staged ring; a CPU model's are views of the files'
    # mappings, read ahead into the page cache, whose copies into vLLM's fresh layers the engine
    # makes with positioned reads (CopyWatch, every size): no page of a mapping is touched, so a
    # shard truncated during the reload is a read error naming it, never a SIGBUS.
    loader._device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    try:
        source = choose_source(str(model_config.model), record, options.weights)
        unused = getattr(model, "is_unused_checkpoint_weight", None)
        if is_url(source):
            experts = getattr(loader, "local_expert_ids", None)

            def skip(name: str) -> bool:
                return should_skip_weight(name, experts) or (unused is not None and unused(name))

            stream: Any = RemoteWeights(
                source,
                storage_options=options.storage_options,
                threads=options.threads,
                progress=loader._start_stream(),
                skip=skip,
                # as at the first load: each rank's weight loaders fetch only their slices, but
                # each as it is copied: the recovery takes a copy that returned for bytes written
                tp_size=tp_size,
                origins={},
                queue_fetches=False,
                # shared as the first load was: every peer reloads together (collective_rpc on
                # each replica), each fetching its part of the changed tensors
                group=share_group(options, source),
            )
            first: Iterator[tuple[str, torch.Tensor]] = iter(stream)
        else:
            primary = DefaultModelLoader.Source(
                source,
                model_config.revision,
                prefix="",
                fall_back_to_pt=getattr(model, "fall_back_to_pt_during_load", True),
                allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None),
                is_unused_weight=unused,
            )
            first = loader._get_weights_iterator(primary)
            stream = loader._streams[-1]
        catalog, digests = describe(stream)
        if catalog is not None and record.catalog is not None:
            check_fits(catalog, record.catalog, source, record.source)
        left_out: set[str] = set()
        if options.skip_unchanged and catalog is not None and record.catalog is not None:
            left_out = unchanged(record, catalog, digests, moved(model, record))
        if left_out and isinstance(stream, RemoteWeights):
            stream.tensors = [t for t in stream.tensors if t.name not in left_out]
        elif left_out:
            stream.leave_out(left_out)
        others = [loader._get_weights_iterator(s) for s in getattr(model, "secondary_weights", ())]
    except BaseException:
        put_back(model_config, record)
        raise

    def chained() -> Iterator[tuple[str, torch.Tensor]]:
        yield from first
        for it in others:
            yield from it

    watch = CopyWatch(
        getattr(stream, "origins", {}),
        [],
        tp_size=tp_size,
        adopt=False,  # the model's memory stays its own
        threads=options.threads,
        engine_min=0,
        remote=isinstance(stream, RemoteWeights) and stream.tp_size > 1,
    )
    reload = _Reload(
        model,
        model_config,
        record,
        stream,
        chained(),
        source=source,
        catalog=catalog,
        digests=digests,
        left_out=left_out,
        watch=watch,
        log=log,
    )
    return reload.iterator


__all__ = ["FeedWatch", "held", "open_reload", "remember", "seal"]
