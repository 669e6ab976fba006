"""``--load-format fastload``: vLLM's loader contract, with fastload doing the reading.

:class:`FastloadModelLoader` is vLLM's ``DefaultModelLoader`` with its weight stream replaced:

* which files are read is decided exactly as vLLM's default (``--load-format auto``) decides it:
  revision, ``--download-dir``, the safetensors index (files it does not list are left out),
  ``.bin``/``.pt`` checkpoints when there is no safetensors file, ``--ignore-patterns``, Mistral's
  ``consolidated`` files, secondary weight sources, the expert-parallel and encoder-only filters,
  vLLM's check that every parameter was loaded;
* the weights still go through the model's own ``load_weights`` (fused qkv/gate_up, tensor-parallel
  narrowing, expert mapping, tied embeddings), so every architecture vLLM serves loads;
* what is read, and how, is fastload's: every file validated before the first tensor
  (:class:`~fastload.integrations.vllm.weights.CheckpointWeights`), tensors handed out as views of
  the file mapping, the files read into the page cache ahead of the weight loaders, the weight
  loaders' copies made by the engine, parameters kept as stored adopted as those views,
  tensor-parallel ranks reading only their slices (:class:`~fastload.integrations.vllm.adopt.
  CopyWatch`); any failure inside ``load_weights`` names the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Generator
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight
from vllm.model_executor.model_loader.weight_utils import (
    enable_tqdm,
    filter_mm_encoder_only_safetensors_files,
    filter_safetensors_files_by_weight_name,
    get_quant_config,
)

from fastload.core.basics import redaction
from fastload.core.basics.errors import FastloadError, ModelMismatchError, UnsupportedError
from fastload.core.basics.units import format_bytes

from . import reload
from .adopt import CopyWatch
from .options import LOAD_FORMAT, VllmLoadOptions, parse_options
from .release import MappingRecord, release_unused
from .remote import RemoteWeights
from .remote_fetches import Fetches
from .share import share_group
from .weights import CheckpointWeights, check_index

logger = init_logger("vllm.model_executor.model_loader.fastload")
# vLLM's logger, which has no redaction of its own: URLs' user-info and queries hidden there too
redaction.install(logger)

#: the index files vLLM's default loader reads (Hugging Face's, Mistral's consolidated one)
_INDEX_FILES = ("model.safetensors.index.json", "consolidated.safetensors.index.json")


def _tp_size() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except (AssertionError, RuntimeError, ImportError):  # no model-parallel group: one rank
        return 1


class FastloadModelLoader(DefaultModelLoader):
    """vLLM's default loader with fastload's weight stream (see the module docstring)."""

    def __init__(self, load_config: LoadConfig) -> None:
        #: the options of ``--model-loader-extra-config``, checked
        self.options: VllmLoadOptions = parse_options(
            load_config.model_loader_extra_config, load_config.safetensors_load_strategy
        )
        #: the configuration as the user gave it (``self.load_config`` is the default loader's)
        self.fastload_load_config = load_config
        extra: dict[str, Any] = {}
        if self.options.enable_weights_track is not None:
            extra["enable_weights_track"] = self.options.enable_weights_track
        # vLLM's default loader picks files for "auto" exactly as vLLM's own default load does.
        super().__init__(
            dataclasses.replace(load_config, load_format="auto", model_loader_extra_config=extra)
        )
        self._origins: dict[int, Any] = {}
        self._streams: list[CheckpointWeights | RemoteWeights] = []
        #: the model argument of the load (the primary source; its weights may be remote)
        self._primary: str | None = None
        self._mappings: list[MappingRecord] = []
        #: the device of the model's parameters (set by load_weights)
        self._device: torch.device | None = None
        #: the engine's copies queued behind the weight loaders during load_weights (CopyWatch)
        self._deferred: Fetches | None = None

    # -- which files -----------------------------------------------------------------------------

    def _prepare_weights(
        self,
        model_name_or_path: str,
        subfolder: str | None,
        revision: str | None,
        fall_back_to_pt: bool,
        allow_patterns_overrides: list[str] | None,
    ) -> tuple[str, list[str], bool, str]:
        if os.path.isdir(model_name_or_path):
            folder = os.path.join(model_name_or_path, subfolder or "")
            for name in _INDEX_FILES:
                if os.path.isfile(os.path.join(folder, name)):
                    check_index(os.path.join(folder, name), folder)
        return super()._prepare_weights(
            model_name_or_path, subfolder, revision, fall_back_to_pt, allow_patterns_overrides
        )

    def download_model(self, model_config: ModelConfig) -> None:
        if self.options.weights is None:  # else the weights stay in the store until read
            super().download_model(model_config)

    def _get_weights_iterator(
        self, source: DefaultModelLoader.Source
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        if self.options.weights is not None and source.model_or_path == self._primary:
            return self._remote_weights(source)
        hf_folder, files, use_safetensors, index_file = self._prepare_weights(
            source.model_or_path,
            source.subfolder,
            source.revision,
            source.fall_back_to_pt,
            source.allow_patterns_overrides,
        )
        # the same filters as vLLM's default loader, where it applies them
        if self._encoder_only_lm_prefixes is not None and use_safetensors and files:
            files = filter_mm_encoder_only_safetensors_files(
                files,
                hf_folder,
                index_file,
                self._encoder_only_lm_prefixes,
                weights_mapper=self._encoder_only_weights_mapper,
            )
            if not files:
                raise RuntimeError(
                    "mm-encoder-only shard filter removed all weight files for "
                    f"`{source.model_or_path}`"
                )
        if source.is_unused_weight is not None and use_safetensors:
            files = filter_safetensors_files_by_weight_name(files, source.is_unused_weight)
        index = os.path.join(hf_folder, index_file)
        stream = CheckpointWeights(
            files,
            self.options,
            tp_size=_tp_size(),
            progress=self._start_stream(),
            index=index if use_safetensors and os.path.isfile(index) else None,
            origins=self._origins,
            device=self._device,
            deferred=self._deferred,
        )
        self._streams.append(stream)
        self._mappings += [MappingRecord.of(m) for m in stream.mappings]
        return (
            (source.prefix + name, tensor)
            for name, tensor in stream
            if not should_skip_weight(name, self.local_expert_ids)
        )

    def _start_stream(self) -> bool:
        """Starts vLLM's clock for "Loading weights took" before a stream opens its files
        (validating them is part of loading; vLLM's default loader starts it before reading
        them); whether the stream draws a progress bar."""
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        if self.options.progress is not None:
            return self.options.progress
        return bool(enable_tqdm(self.load_config.use_tqdm_on_load))

    def _remote_weights(
        self, source: DefaultModelLoader.Source
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The primary weights from the object store of the ``weights`` option: every file
        opened and validated here, the tensors read in batches ahead of the weight loaders."""
        assert self.options.weights is not None
        unused = source.is_unused_weight

        def skip(name: str) -> bool:  # what vLLM's default loader leaves unread or skips
            return should_skip_weight(name, self.local_expert_ids) or (
                unused is not None and unused(name)
            )

        stream = RemoteWeights(
            self.options.weights,
            storage_options=self.options.storage_options,
            threads=self.options.threads,
            progress=self._start_stream(),
            skip=skip,
            tp_size=_tp_size(),
            origins=self._origins,
            # into CPU parameters, the weight loaders' copies are fetched straight into them
            unread=_tp_size() > 1 or self._device is None or self._device.type == "cpu",
            group=share_group(self.options, self.options.weights),
        )
        self._streams.append(stream)
        return ((source.prefix + name, tensor) for name, tensor in stream)

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Any:
        """The model's weights; for a reload (``collective_rpc("reload_weights")``: a model
        this loader's format loaded before) opened, checked against what the engine holds and
        the unchanged layers left out here, before vLLM touches a layer
        (:mod:`fastload.integrations.vllm.reload`)."""
        record = reload.held(model)
        if record is None:
            return super().get_all_weights(model_config, model)
        return reload.open_reload(self, model_config, model, record, logger, _tp_size())

    # -- loading ---------------------------------------------------------------------------------

    def load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> nn.Module:
        model = super().load_model(
            vllm_config=vllm_config, model_config=model_config, prefix=prefix
        )
        reload.seal(model)  # what a later reload_weights compares with
        if self._mappings:
            # after vLLM's post-load processing, which repacks or replaces most parameters
            tensors = [*model.parameters(), *model.buffers()]
            dropped = release_unused(self._mappings, tensors)
            self._mappings.clear()
            logger.info(
                "fastload: unmapped %s of checkpoint pages no parameter uses after vLLM's "
                "post-load processing (they stay in the page cache)",
                format_bytes(dropped),
            )
        return model

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        if model_config.quantization == "torchao":
            quant_config = get_quant_config(model_config, self.load_config)
            if getattr(quant_config, "is_checkpoint_torchao_serialized", False):
                raise UnsupportedError(
                    f"{model_config.model}: a torchao-serialized checkpoint stores tensor "
                    "subclasses that vLLM rebuilds with torchao's own reader; --load-format "
                    f"{LOAD_FORMAT} does not read them: serve it with --load-format auto"
                )
        self._primary = model_config.model
        tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        # where the weight loaders copy to: an accelerator's weights are staged there
        self._device = next((t.device for _, t in tensors if t.device.type != "meta"), None)
        watch = CopyWatch(
            self._origins,
            tensors,
            tp_size=_tp_size(),
            adopt=self.options.share_weights and self.options.mmap != "copy",
            threads=self.options.threads,
            remote=self.options.weights is not None,
            defer=True,
        )
        streams = self._streams
        self._deferred = watch.deferred

        def current() -> str | None:  # the checkpoint tensor the weight loaders are copying
            where = streams[-1].current if streams else None
            return where[1] if where else None

        feeds = reload.FeedWatch(model, current)
        start = time.perf_counter()
        try:
            with watch, feeds:  # feeds inside: it sees each copy before the watch takes it
                super().load_weights(model, model_config)
            if streams:
                reload.remember(
                    model,
                    model_config,
                    self.options.weights or model_config.model,
                    streams[0],
                    feeds,
                )
        except FastloadError:
            raise
        except Exception as e:
            where = next((s.current for s in reversed(self._streams) if s.current), None)
            if where is None:
                raise
            path, name = where
            raise ModelMismatchError(
                f"{path}: tensor {name!r}: the model's load_weights failed on it "
                f"({type(e).__name__}: {e})"
            ) from e
        finally:
            self._deferred = None
            for stream in self._streams:
                stream.close()
        seconds = time.perf_counter() - start
        total = sum(s.bytes for s in self._streams)
        logger.info(
            "fastload: %s of weights from %d file(s) in %.2f s; %d parameter(s) (%s) kept as "
            "views of the checkpoint's page cache, %s copied by the weight loaders (%s of it "
            "by the engine)%s",
            format_bytes(total),
            sum(len(s.paths) for s in self._streams),
            seconds,
            watch.adopted,
            format_bytes(watch.adopted_bytes),
            format_bytes(watch.copied_bytes),
            format_bytes(watch.engine_bytes),
            f", {watch.slices_read} tensor-parallel slice(s) read alone"
            if watch.slices_read
            else "",
        )
        for stream in self._streams:
            if isinstance(stream, RemoteWeights) and stream.group is not None:
                logger.info(
                    "fastload: share_fetch: peer %d of %d fetched %s from the store and received "
                    "%s from its peers",
                    stream.group.rank,
                    stream.group.world_size,
                    format_bytes(stream.fetched_bytes),
                    format_bytes(stream.received_bytes),
                )
        # The loader keeps nothing: views handed out live on only as the model's parameters.
        self._streams.clear()
        self._origins.clear()


__all__ = ["FastloadModelLoader"]
