"""A Hugging Face load, from a name to the core loader.

1. transformers' options are sorted out (:mod:`fastload.hf.options`): hub arguments, core options
   they map onto, config settings; an option fastload cannot honour is refused here, before
   anything is read;
2. the name (a model id or a path) is resolved to local files (:mod:`fastload.hf.hub`);
3. the class and config are decided (:mod:`fastload.hf.auto`) and the skeleton is built the way
   transformers builds it;
4. the core loader (:func:`fastload.core.loading.load`) does the rest, with transformers' hooks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import (
    CheckpointError,
    FastloadError,
    FastloadFileNotFoundError,
    RequestError,
    UnsupportedError,
    also_as,
)
from fastload.core.basics.redaction import redact
from fastload.core.checkpoint.files import resolve as resolve_files
from fastload.core.devices.resolution import single_device
from fastload.core.loading import load
from fastload.core.model.skeleton import build_skeleton
from fastload.core.plan.load_options import LoadOptions
from fastload.core.plan.report import LoadReport
from fastload.core.plan.steps import LoadSteps
from fastload.core.plan.target import Target, plain_target
from fastload.core.store.object_store import is_url
from fastload.core.store.side_directory import side_files_directory
from fastload.distributed.group import on_every_rank, tell_every_rank
from fastload.distributed.steps import RANK_STEPS
from fastload.families import is_transformers_model
from fastload.hf import hub as hubmod
from fastload.hf.auto import is_auto_class, resolve_class
from fastload.hf.hooks import TransformersHooks, family_hooks
from fastload.hf.initialize import build_contexts
from fastload.hf.options import split_options
from fastload.hf.quantized import Quantization, quantization_for, read_method
from fastload.hf.remote_folders import lookup as lookup_remote
from fastload.reloading.record import Remember
from fastload.training.gradient_checkpointing import (
    drop_legacy_config_key,
    gradient_checkpointing_enable,
)

logger = logging.getLogger("fastload")

#: what fastload.distributed, fastload.training and fastload.reloading add to a load (the core
#: imports none of them): collective reads, checkpointing, the record (model ids resolved as here)
LOAD_STEPS = LoadSteps(RANK_STEPS, gradient_checkpointing_enable, Remember(hubmod.reload_source))


def load_hf(
    model: Any,
    path: str | os.PathLike[str] | None,
    *,
    config: Any,
    state_dict: Mapping[str, torch.Tensor] | None,
    given: dict[str, Any],
    kwargs: dict[str, Any],
    contract: bool = False,
) -> tuple[nn.Module, LoadReport]:
    """Loads a model named the Hugging Face way; ``given`` are the core loader's options the
    caller passed (:class:`~fastload.core.plan.load_options.LoadOptions`), and ``kwargs``
    transformers' options and config / ``__init__`` arguments. ``contract``: under the patch, what
    loads at all is transformers' rule (:class:`TransformersHooks`)."""
    start = time.perf_counter()
    kwargs = dict(kwargs)
    opts = split_options(kwargs)
    # transformers' spelling of a core option (torch_dtype, key_mapping, disable_mmap) fills in
    # what the caller's own options leave out: fastload's spelling wins when both are given, as
    # dtype wins over torch_dtype in transformers
    options = LoadOptions.create("from_pretrained", **given).with_defaults(**opts.core)

    # Call shapes: (None|class|Auto|module, path), ("org/name" or dir), legacy (arch dir, weights).
    if isinstance(model, (str, os.PathLike)):
        if path is None:
            model, path = None, model
        else:  # a directory (or its config.json) naming the architecture, weights elsewhere
            arch = Path(os.fspath(model))
            arch = arch.parent if arch.name == "config.json" else arch
            if config is None:
                config = arch
            model = None
    if state_dict is not None:
        if path is not None:
            raise RequestError("pass either a checkpoint path or state_dict=, not both")
        if config is None:
            raise RequestError("state_dict= needs config= to build the model from")
    elif path is None:
        raise RequestError("from_pretrained needs a model id or path (or config= and state_dict=)")

    # a folder of a pipeline read from object storage stands for its URL
    # (fastload.hf.remote_folders)
    remote = lookup_remote(path)
    if remote is not None:
        path = remote.url
        if options.storage_options is None:
            options = dataclasses.replace(options, storage_options=remote.storage_options)
        if remote.process_group is not None and not options.collective:
            # the pipeline's collective load: each rank fetches about 1/N of this component
            options = dataclasses.replace(options, process_group=remote.process_group)
    resolved = None
    # a checkpoint in object storage: its config files are fetched into a directory of their
    # own, removed once the load is over (its generation config is read at the end)
    side_files: tempfile.TemporaryDirectory[str] | None = None
    if path is not None and is_url(path):
        assert isinstance(path, str)
        side_files = side_files_directory()
        resolved = on_every_rank(
            options,
            lambda: hubmod.resolve_remote(
                path,
                Path(side_files.name),
                hub=opts.hub,
                subfolder=opts.subfolder,
                variant=opts.variant,
                use_safetensors=opts.use_safetensors,
                storage_options=options.storage_options,
            ),
        )
    elif path is not None:
        try:
            resolved = hubmod.resolve_checkpoint(
                path,
                hub=opts.hub,
                subfolder=opts.subfolder,
                variant=opts.variant,
                use_safetensors=opts.use_safetensors,
                allow_pickle=options.allow_pickle,
                remote_code=opts.trust_remote_code,
            )
        except Exception as e:
            tell_every_rank(options, e)  # in a collective load, every rank hears of it
            raise
    loading = False  # a failure before the load is told to the other ranks here, not in it
    try:
        hooks = TransformersHooks(generation_config=opts.generation_config, contract=contract)
        if side_files is not None and resolved is not None:
            hooks.directory = resolved.directory
        options = _tensor_parallel(options, opts.tp, hooks, contract=contract)

        if isinstance(model, nn.Module):
            target = plain_target(model, config, kwargs)
            target.hooks = hooks
        elif model is None or is_auto_class(model) or is_transformers_model(model):
            source = resolved.directory if resolved is not None else config
            if side_files is not None and config is None and not (source / "config.json").is_file():
                raise FastloadFileNotFoundError(
                    f"{path}: no config.json beside the weights: a transformers model is "
                    "built from it (or pass config=)"
                )
            cls, cfg, init_kwargs = resolve_class(
                model,
                config,
                source,
                kwargs,
                trust_remote_code=opts.trust_remote_code,
                code_revision=opts.code_revision,
            )
            # a quantized checkpoint is read into the modules transformers' quantizer makes, or
            # refused; never loaded as an unquantized model (fastload.hf.quantized)
            source_name = path if path is not None else cls.__name__
            quant = None
            method = read_method(cfg, source_name)
            if method is not None:
                asked = options.device_map
                options = _one_device(options, hooks, method, source_name)
                quant = quantization_for(
                    cfg,
                    source_name,
                    files=lambda: _local_files(resolved),
                    device_map=_quantizer_map(asked, options.device),
                )
            if quant is not None and quant.operation and options.device.type != "cpu":
                raise UnsupportedError(
                    f"{path}: quant_method={quant.method!r} loads here through transformers' "
                    f"load operation on the CPU; fastload runs it onto the CPU only, not "
                    f"{options.device}: load it with transformers"
                )
            if quant is not None and not contract and not {"missing", "strict"} & set(given):
                # a scale or packed weight absent from the file has no value its method gives
                # it (integer ones have no NaN to be found by): refused from the plan, by name
                options = dataclasses.replace(options, missing="error")
            _prepare_config(cfg, opts.config_attrs, init_kwargs, source)
            cfg.name_or_path = os.fspath(path) if path is not None else cfg.name_or_path
            hooks.config = cfg  # dtype="auto" reads the config's dtype
            hooks.quantization = quant
            target = Target(build=_builder(cls, cfg, init_kwargs, quant), hooks=hooks)
        else:  # any nn.Module class or factory, its checkpoint found by model id
            target = plain_target(model, config, kwargs, choose_hooks=family_hooks)

        checkpoint: Any = state_dict if resolved is None else resolved.weights
        seconds = {"resolve": time.perf_counter() - start}
        loading = True
        return load(target, checkpoint, options, steps=LOAD_STEPS, seconds=seconds)
    except Exception as e:
        if isinstance(e, FastloadError) and side_files is not None and resolved is not None:
            _name_the_url(e, side_files.name, resolved.weights)
        if not loading:  # the other ranks of a collective load wait in its opening
            tell_every_rank(options, e)
        raise
    finally:
        if side_files is not None:
            side_files.cleanup()


def _one_device(
    options: LoadOptions, hooks: TransformersHooks, method: str, source: Any
) -> LoadOptions:
    """The options of a quantized load: onto one device. A ``device_map`` that places the
    whole model on one device (``"cpu"``, ``{"": "cpu"}``, ``"auto"`` on a machine without an
    accelerator: :func:`~fastload.core.devices.resolution.single_device`) becomes that device, as
    transformers loads it there; a map over several devices or disk, ``max_memory``, or a
    ``tp_plan`` is refused naming what was asked."""
    one = None
    if options.device_map is not None:
        one = single_device(
            options.device_map,
            max_memory=options.max_memory,
            disk=options.offload_folder is not None,
        )
    tp = hooks.tp is not None or options.tp_plan is not None
    if tp or (options.device_map is not None and one is None):
        what = "a tp_plan" if tp else f"device_map={options.device_map!r}"
        if not tp and options.max_memory is not None:
            what += f" and max_memory={options.max_memory!r}"
        raise UnsupportedError(
            f"{source}: quant_method={method!r} with {what}: fastload reads a quantized "
            "checkpoint onto one device (a device_map placing everything on one device, such "
            "as 'cpu' or, on a machine without a GPU, 'auto', is that device); load it with "
            "transformers"
        )
    if one is None:
        return options
    return dataclasses.replace(options, device=one, device_map=None, max_memory=None)


def _quantizer_map(asked: Any, device: torch.device) -> Any:
    """The device map transformers' quantizer is given: the user's, as transformers gives it;
    without one, the device the load goes to (as transformers makes ``{"": device}`` of an
    ambient device), but for the CPU, where transformers gives none."""
    if asked is not None:
        return asked
    return None if device.type == "cpu" else {"": device}


def _name_the_url(error: FastloadError, side_files: str, weights: str) -> None:
    """``error`` naming the object storage prefix where it named the temporary directory the
    prefix's side files (``config.json`` ...) were fetched into: that directory is gone once the
    error is seen."""
    prefix = weights if weights.endswith("/") else weights.rsplit("/", 1)[0] + "/"
    # the URL as given may carry secrets: the text is redacted again once it names it
    if error.args and isinstance(error.args[0], str) and side_files in error.args[0]:
        text = error.args[0].replace(side_files.rstrip("/") + "/", prefix)
        error.args = (redact(text.replace(side_files, prefix.rstrip("/"))), *error.args[1:])
    filename = getattr(error, "filename", None)
    if isinstance(filename, str) and side_files in filename:
        error.filename = redact(filename.replace(side_files.rstrip("/") + "/", prefix))


def _tensor_parallel(
    options: LoadOptions, tp: dict[str, Any], hooks: TransformersHooks, *, contract: bool
) -> LoadOptions:
    """transformers' tensor parallelism (:mod:`fastload.hf.dtensor_tp`) when its call shape
    asks for it: ``tp_plan="auto"``, ``tp_size``, ``distributed_config``, or under the patch any
    ``tp_plan``. fastload's own plans (a dict of its patterns, ``"llama"``) keep fastload's plain
    shards. The load is then collective over the world group, on transformers' device."""
    plan = options.tp_plan
    if not tp and plan != "auto" and not (contract and plan is not None):
        return options
    from fastload.hf.dtensor_tp import resolve_tp_options

    setup = resolve_tp_options(
        tp_plan=plan,
        tp_size=tp.get("tp_size"),
        device_mesh=tp.get("device_mesh"),
        distributed_config=tp.get("distributed_config"),
        device_map=options.device_map,
    )
    if setup is None:  # every size 1: transformers shards nothing
        return dataclasses.replace(options, tp_plan=None)
    hooks.tp = setup
    return dataclasses.replace(options, tp_plan=plan or "auto", device=setup.device)


def _prepare_config(
    cfg: Any, attrs: dict[str, Any], init_kwargs: dict[str, Any], source: Any
) -> None:
    for name in ("attn_implementation", "experts_implementation"):
        if name in init_kwargs:  # passed to a config that did not take it as an attribute
            attrs[f"_{name}"] = init_kwargs.pop(name)
    for name, value in attrs.items():
        setattr(cfg, name, value)
    # A legacy config key; transformers would switch checkpointing on from it. fastload never
    # does: checkpointing is a run-time choice (gradient_checkpointing=True).
    if drop_legacy_config_key(cfg):
        logger.warning(
            "%s: the config's legacy 'gradient_checkpointing' key is ignored; pass "
            "gradient_checkpointing=True to enable it",
            Path(os.fspath(source)) / "config.json",
        )


def _local_files(resolved: Any) -> list[str]:
    """The checkpoint's local files (for a quantizer's ``preprocess_model``); none for a state
    dict or object storage."""
    weights = getattr(resolved, "weights", None)
    if weights is None or is_url(weights):
        return []
    return [os.fspath(f) for f in resolve_files(weights, allow_pickle=True).files]


def _builder(
    cls: type, cfg: Any, init_kwargs: dict[str, Any], quant: Quantization | None = None
) -> Any:
    def make() -> nn.Module:
        model = cls(cfg, **init_kwargs)
        if quant is not None:  # transformers' module swaps, on the skeleton as it is built
            quant.preprocess(model, cfg.dtype)
        return model

    def build(dtype: torch.dtype | None) -> nn.Module:
        if quant is not None and dtype is not None:
            dtype = quant.update_dtype(dtype)
        if dtype is not None:
            # As transformers records it: the dtype the model was built in, sub-configs included.
            cfg.dtype = dtype
            for key in getattr(cfg, "sub_configs", None) or {}:
                sub = getattr(cfg, key, None)
                if sub is not None:
                    sub.dtype = dtype
        try:
            return build_skeleton(make, dtype=dtype, contexts=build_contexts())
        except FastloadError:
            raise
        except TypeError:
            if init_kwargs:  # the caller's own keyword arguments: a wrong argument
                raise
            raise _bad_config(cls, cfg) from None
        except Exception:  # a config from a file that the model cannot be built from
            raise _bad_config(cls, cfg) from None

    return build


def _bad_config(cls: type, cfg: Any) -> CheckpointError:
    """The error for a model that cannot be built from its config: a ``CheckpointError`` that
    is also the error the model's code raised (transformers' ``from_pretrained`` lets that one
    through, so code catching it keeps working)."""
    import sys

    error = sys.exc_info()[1]
    assert error is not None
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    error_class = also_as(CheckpointError, error)
    return error_class(
        f"{cfg.name_or_path or 'config'}: {cls.__name__} cannot be built from this config "
        f"({type(error).__name__}: {text})"
    )
