"""``fastload.from_pretrained``: the public entry of every load.

It accepts the call shapes users bring (a model id or path alone, a class or Auto class and a
path, a built module, ``None`` with ``config`` and ``state_dict``) and sends each to the layer that
serves it: Hugging Face names, classes and options to :mod:`fastload.hf` (imported only then),
anything else straight to the core loader (:func:`fastload.core.loading.load`). Either way the
entry tells the core what it serves: the model family's hooks (:mod:`fastload.core.plan.hooks`) and
the steps that :mod:`fastload.distributed` and :mod:`fastload.training` add
(:data:`LOAD_STEPS`); the core itself names none of them.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, overload

import torch
from torch import nn

from fastload.core.basics.arguments import check_bool
from fastload.core.devices.device_map import DeviceMapArg
from fastload.core.loading import load
from fastload.core.model.keys import KeyMap
from fastload.core.plan.hooks import ModelHooks
from fastload.core.plan.load_options import DEFAULTS, LoadOptions, split_load_options
from fastload.core.plan.report import LoadReport
from fastload.core.plan.steps import LoadSteps
from fastload.core.plan.target import plain_target
from fastload.core.store.object_store import is_url
from fastload.distributed.steps import RANK_STEPS
from fastload.families import is_diffusers_model, is_transformers_model
from fastload.hf.auto import is_auto_class
from fastload.hf.hub import reload_source
from fastload.hf.options import OPTIONS as TRANSFORMERS_OPTIONS
from fastload.reloading.record import Remember
from fastload.training.gradient_checkpointing import gradient_checkpointing_enable

M = TypeVar("M", bound=nn.Module)
PathArg = str | os.PathLike[str]
Missing = Literal["error", "warn", "init"]
Unexpected = Literal["error", "warn", "ignore"]
ReadMode = Literal["pread", "mmap"]
MmapMode = Literal["auto", "shared", "copy"]
DeviceMapMode = Literal["auto", "balanced", "balanced_low_0", "sequential"]

__all__ = ["from_pretrained"]

#: what fastload.distributed, fastload.training and fastload.reloading add to a load (the core
#: imports none of them): collective reads, checkpointing, the record (model ids resolved as here)
LOAD_STEPS = LoadSteps(RANK_STEPS, gradient_checkpointing_enable, Remember(reload_source))


@overload
def from_pretrained(
    model: type[M] | Callable[..., M] | M,
    path: PathArg | None = ...,
    *,
    output_loading_info: Literal[False] = ...,
    device: str | torch.device = ...,
    dtype: str | torch.dtype = ...,
    strict: bool = ...,
    missing: Missing = ...,
    unexpected: Unexpected = ...,
    ignore_mismatched_sizes: bool = ...,
    key_map: KeyMap | None = ...,
    progress: bool = ...,
    gradient_checkpointing: bool = ...,
    read_mode: ReadMode = ...,
    mmap: MmapMode = ...,
    threads: int | None = ...,
    config: Any = ...,
    state_dict: Mapping[str, torch.Tensor] | None = ...,
    device_map: DeviceMapArg | DeviceMapMode | None = ...,
    max_memory: dict[Any, int | str] | None = ...,
    no_split_module_classes: list[str] | None = ...,
    tp_plan: str | dict[str, str] | None = ...,
    process_group: Any = ...,
    allow_pickle: bool = ...,
    staging_bytes: int | str | None = ...,
    offload_folder: PathArg | None = ...,
    read_ahead: bool = ...,
    storage_options: Mapping[str, str | int | float | bool] | None = ...,
    **model_kwargs: Any,
) -> M: ...


@overload
def from_pretrained(
    model: type[M] | Callable[..., M] | M,
    path: PathArg | None = ...,
    *,
    output_loading_info: Literal[True],
    device: str | torch.device = ...,
    dtype: str | torch.dtype = ...,
    strict: bool = ...,
    missing: Missing = ...,
    unexpected: Unexpected = ...,
    ignore_mismatched_sizes: bool = ...,
    key_map: KeyMap | None = ...,
    progress: bool = ...,
    gradient_checkpointing: bool = ...,
    read_mode: ReadMode = ...,
    mmap: MmapMode = ...,
    threads: int | None = ...,
    config: Any = ...,
    state_dict: Mapping[str, torch.Tensor] | None = ...,
    device_map: DeviceMapArg | DeviceMapMode | None = ...,
    max_memory: dict[Any, int | str] | None = ...,
    no_split_module_classes: list[str] | None = ...,
    tp_plan: str | dict[str, str] | None = ...,
    process_group: Any = ...,
    allow_pickle: bool = ...,
    staging_bytes: int | str | None = ...,
    offload_folder: PathArg | None = ...,
    read_ahead: bool = ...,
    storage_options: Mapping[str, str | int | float | bool] | None = ...,
    **model_kwargs: Any,
) -> tuple[M, LoadReport]: ...


@overload
def from_pretrained(
    model: str | os.PathLike[str] | type | None,
    path: PathArg | None = ...,
    *,
    output_loading_info: Literal[False] = ...,
    device: str | torch.device = ...,
    dtype: str | torch.dtype = ...,
    strict: bool = ...,
    missing: Missing = ...,
    unexpected: Unexpected = ...,
    ignore_mismatched_sizes: bool = ...,
    key_map: KeyMap | None = ...,
    progress: bool = ...,
    gradient_checkpointing: bool = ...,
    read_mode: ReadMode = ...,
    mmap: MmapMode = ...,
    threads: int | None = ...,
    config: Any = ...,
    state_dict: Mapping[str, torch.Tensor] | None = ...,
    device_map: DeviceMapArg | DeviceMapMode | None = ...,
    max_memory: dict[Any, int | str] | None = ...,
    no_split_module_classes: list[str] | None = ...,
    tp_plan: str | dict[str, str] | None = ...,
    process_group: Any = ...,
    allow_pickle: bool = ...,
    staging_bytes: int | str | None = ...,
    offload_folder: PathArg | None = ...,
    read_ahead: bool = ...,
    storage_options: Mapping[str, str | int | float | bool] | None = ...,
    **model_kwargs: Any,
) -> nn.Module: ...


@overload
def from_pretrained(
    model: str | os.PathLike[str] | type | None,
    path: PathArg | None = ...,
    *,
    output_loading_info: Literal[True],
    device: str | torch.device = ...,
    dtype: str | torch.dtype = ...,
    strict: bool = ...,
    missing: Missing = ...,
    unexpected: Unexpected = ...,
    ignore_mismatched_sizes: bool = ...,
    key_map: KeyMap | None = ...,
    progress: bool = ...,
    gradient_checkpointing: bool = ...,
    read_mode: ReadMode = ...,
    mmap: MmapMode = ...,
    threads: int | None = ...,
    config: Any = ...,
    state_dict: Mapping[str, torch.Tensor] | None = ...,
    device_map: DeviceMapArg | DeviceMapMode | None = ...,
    max_memory: dict[Any, int | str] | None = ...,
    no_split_module_classes: list[str] | None = ...,
    tp_plan: str | dict[str, str] | None = ...,
    process_group: Any = ...,
    allow_pickle: bool = ...,
    staging_bytes: int | str | None = ...,
    offload_folder: PathArg | None = ...,
    read_ahead: bool = ...,
    storage_options: Mapping[str, str | int | float | bool] | None = ...,
    **model_kwargs: Any,
) -> tuple[nn.Module, LoadReport]: ...


def from_pretrained(
    model: Any = None,
    path: PathArg | None = None,
    *,
    output_loading_info: bool = False,
    config: Any = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    **kwargs: Any,
) -> Any:
    """Builds (or takes) a model and loads a safetensors checkpoint into it.

    Call shapes: ``from_pretrained("org/name" or path, **options)`` (the class named by
    ``config.json``'s ``architectures``), ``from_pretrained(ModelClass or AutoClass, "org/name"
    or path)``, ``from_pretrained(module, path)`` (loaded in place),
    ``from_pretrained(None, config=cfg, state_dict=sd)``.

    Args:
        model: a transformers ``PreTrainedModel`` subclass or Auto class (built from ``config``
            or the ``config.json`` next to the weights), a diffusers ``ModelMixin`` class (built
            the diffusers way: :mod:`fastload.diffusion`), any ``nn.Module`` class or factory
            (``**model_kwargs``, or ``(config, **model_kwargs)``), an already-built module (loaded
            in place, its train/eval mode kept; left unchanged if loading fails), ``None`` to use
            the transformers class ``config.json``'s ``architectures`` names (a ``PreTrainedModel``
            subclass; remote code with ``trust_remote_code=True``), or the model id / path itself.
        path: a ``.safetensors`` file, a directory with ``model.safetensors``, a sharded
            checkpoint (its directory or its ``model.safetensors.index.json``), or a Hugging Face
            model id resolved through ``huggingface_hub`` (its cache first; see
            :mod:`fastload.hf.hub`); with ``allow_pickle``, also a pickle checkpoint. Or the
            same in object storage: ``"s3://bucket/prefix/"`` (``gs://``, ``az://``,
            ``http(s)://``), read with parallel ranged GETs straight into the model's tensors
            (:mod:`fastload.core.store.object_store`; a transformers model's ``config.json`` is
            fetched from the same prefix).
        device: where every tensor is allocated.
        dtype: ``"auto"``: for a transformers model fastload builds, transformers' rule (the
            config's dtype, else the checkpoint's; ``_keep_in_fp32_modules`` honoured; see
            :mod:`fastload.hf.dtype_rules`), otherwise each tensor's stored dtype.
            ``"stored"``: each tensor's stored dtype. A floating dtype converts floating tensors
            during the copy (see :class:`fastload.core.plan.placement.Placement`).
        strict: makes both ``missing`` and ``unexpected`` ``"error"``.
        missing: model tensors absent from the checkpoint: ``"error"``, ``"warn"`` (default:
            log a warning listing them, then initialize) or ``"init"`` (initialize silently).
            Initialization is the model's own (``_init_weights`` for transformers models,
            ``reset_parameters()`` otherwise); a tensor nothing initializes is a
            ``CheckpointError``. A module passed in keeps the values of parameters it already
            has. A load where no checkpoint tensor matches the model is a ``CheckpointError``.
        unexpected: checkpoint tensors the model has no place for: ``"error"``, ``"warn"``,
            ``"ignore"``. Names the model declares as expected are never reported.
        ignore_mismatched_sizes: re-initialize tensors whose stored shape differs, instead of
            raising ``CheckpointError``.
        key_map: renames checkpoint names first: a callable, or ``{regex: replacement}``.
        output_loading_info: also return the :class:`~fastload.core.plan.report.LoadReport`.
        progress: show a progress bar over bytes for large loads or on a terminal.
        gradient_checkpointing: enable it after loading; the model is left in train mode.
        read_mode: ``"pread"`` (default, no page faults) or ``"mmap"``.
        mmap: ``"auto"`` (default): on a local filesystem, CPU tensors whose stored dtype is the
            wanted one become views of a copy-on-write mapping of the file (no copy; processes
            loading the same checkpoint share one physical copy through the page cache); on
            network and FUSE filesystems, and for pickle files and state dicts, every tensor is a
            private copy. ``"shared"``: views on any filesystem (safetensors files only: otherwise
            a ``RequestError``). ``"copy"``: every tensor is a private copy. Tensors that are
            converted, go to an accelerator or are sharded are always copies. The report's
            ``sharing`` says which way each file went; :mod:`fastload.core.memory.sharing` gives
            the rule and the SIGBUS hazard of files changed in place.
        threads: copy threads (default: at least 8; a conversion from the page cache: the CPUs).
        config: a transformers config (or a path to one) to build the model from.
        device_map: instead of ``device``: ``"auto"`` (the GPUs, most free memory first, then the
            CPU; transformer blocks kept whole), ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"`` (accelerate's planner), a device, or ``{module prefix: device}``. Each
            tensor is allocated on its device and read there directly; tied parameters share one
            tensor, on the device of the name the checkpoint stores. When several devices are
            used, each mapped module moves its inputs to its weights' device before it runs. See
            :mod:`fastload.core.devices.device_map`.
        max_memory: ``{device: bytes or "10GiB"}`` budgets for a planned ``device_map`` (alone,
            it implies ``device_map="auto"``).
        no_split_module_classes: module class names kept whole on one device by the planner
            (default: the model's ``_no_split_modules``).
        tp_plan: tensor-parallel loading over ``torch.distributed``. ``"auto"`` (and
            transformers' ``tp_size=`` / ``distributed_config=``; any plan under
            :func:`fastload.patch_transformers`): the model transformers' own
            ``from_pretrained(tp_plan="auto")`` gives, ``DTensor`` parameters with its
            placements and parallel forwards (:mod:`fastload.hf.dtensor_tp`; ``WORLD_SIZE`` in
            the environment, as under torchrun). fastload's own plans, ``{name pattern: style}``
            with styles ``"colwise"``, ``"rowwise"``, ``"replicate"``, or ``"llama"``
            (:data:`~fastload.distributed.tensor_parallel.LLAMA_TP_PLAN`): plain local shards,
            row-parallel ``nn.Linear`` layers all-reducing their output
            (:mod:`fastload.distributed.tensor_parallel`). Either way the load is collective
            (below).
        process_group: a collective load: the ranks of this ``torch.distributed`` group each
            read about 1/N of the checkpoint's bytes from storage and exchange the rest, and
            every rank ends with the model a single-process load gives (with ``tp_plan``: its
            shards). Each rank may pass its own copy of the checkpoint; their headers must
            agree. The report's ``bytes_read`` is this rank's storage bytes, ``bytes_received``
            what the others sent it. See :mod:`fastload.distributed.collective`.
        allow_pickle: also load pickle checkpoints: a ``.bin``/``.pt`` file, a directory with
            ``pytorch_model.bin``, or a sharded ``pytorch_model.bin.index.json`` (checked like the
            safetensors index). They are read only with ``torch.load(weights_only=True)``, which
            refuses a pickle naming anything but tensors and plain containers (code that would
            run) with a ``CheckpointError``; every entry must be a tensor. The tensors then load
            exactly as a safetensors file's; ``read_mode`` does not apply and the report says
            ``"torch.load(weights_only)"``. Without it such checkpoints raise
            ``PickleRefusedError``. Safetensors files next to a pickle are always preferred.
        staging_bytes: host memory for staging tensors bound for an accelerator: one ring of
            pinned slots (default 256 MiB, 16 slots; an int or ``"1GiB"``), allocated on
            first use and shared by every shard and device of the load, so host memory during a
            GPU load stays bounded by it; at most the machine's physical memory, at least 256
            bytes, in whole slots (:meth:`fastload.core.memory.staging.StagingPool.sized`).
            Unused for CPU destinations.
        read_ahead: ``False`` starts no read-ahead thread beside the skeleton build (with
            ``threads=1`` the whole load then runs on the calling thread); default ``True``.
        offload_folder: allows ``"disk"`` in ``device_map`` (and lets the planners spill to
            disk): those parameters stay in the safetensors file, on ``meta`` in the model, and
            accelerate's hooks read them onto the execution device (the map's first GPU, else
            the CPU) when their module runs (:mod:`fastload.core.reads.offload`). Needs accelerate.
        storage_options: the object store's configuration for a URL ``path``: endpoint,
            region, credentials, timeouts and the retry policy (``max_retries``,
            ``retry_timeout`` ...), as ``{"aws_endpoint": "http://127.0.0.1:9000"}``; the
            environment (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``) and the AWS profile files fill in
            the rest (:mod:`fastload.core.store.store_config`).
        state_dict: tensors to load instead of files (with ``config``).
        **model_kwargs: transformers' ``from_pretrained`` options (``revision``, ``torch_dtype``,
            ``subfolder``...: each honoured with transformers' meaning or refused with
            ``UnsupportedError``, see :mod:`fastload.hf.options`), then config overrides and
            ``__init__`` arguments, as in transformers.

    Returns:
        The model, or ``(model, report)`` with ``output_loading_info=True``.

    Raises:
        TypeError: an option of the wrong type, naming it: the flags (``strict``, ``progress``,
            ``allow_pickle``, ...; transformers' ``local_files_only``, ``trust_remote_code``...)
            take ``True`` or ``False`` only (transformers' also ``None``), never a truthy value;
            ``no_split_module_classes`` a list, tuple or set of str; ``offload_folder`` a str or
            ``os.PathLike``.
        RequestError: an option value that cannot be used, naming it (a device that does not
            exist, a size past :data:`fastload.core.basics.units.MAX_BYTES` or a ``staging_bytes``
            past the machine's memory, an ``offload_folder`` that is empty or an existing file,
            ...).
    """
    where = "from_pretrained"
    check_bool(output_loading_info, "output_loading_info", where=where)
    given, model_kwargs = split_load_options(kwargs)
    if isinstance(model, type) and is_diffusers_model(model):  # diffusers' options and rules
        from fastload.diffusion.front import load_diffusers

        module, report = load_diffusers(
            model, path, config=config, state_dict=state_dict, given=given, kwargs=model_kwargs
        )
    elif _hugging_face_call(model, path, state_dict, model_kwargs):
        from fastload.hf.front import load_hf
        from fastload.hf.options import check_option_types

        # Here, not in load_hf: under patch_transformers transformers' own values apply.
        check_option_types(model_kwargs, where=where)
        module, report = load_hf(
            model, path, config=config, state_dict=state_dict, given=given, kwargs=model_kwargs
        )
    else:
        assert path is not None  # _hugging_face_call takes every call without one
        options = LoadOptions.create(where, **given)
        target = plain_target(model, config, model_kwargs, choose_hooks=_family_hooks)
        module, report = load(target, path, options, steps=LOAD_STEPS)
    return (module, report) if output_loading_info else module


def _public_signature() -> inspect.Signature:
    """``from_pretrained``'s parameters with their defaults, for ``help()`` and editors (the code
    takes the options as ``**kwargs``, to know which the caller gave)."""
    p = inspect.Parameter
    params = [
        p("model", p.POSITIONAL_OR_KEYWORD, default=None),
        p("path", p.POSITIONAL_OR_KEYWORD, default=None),
        p("output_loading_info", p.KEYWORD_ONLY, default=False),
        p("config", p.KEYWORD_ONLY, default=None),
        p("state_dict", p.KEYWORD_ONLY, default=None),
        *(p(name, p.KEYWORD_ONLY, default=value) for name, value in DEFAULTS.items()),
        p("model_kwargs", p.VAR_KEYWORD),
    ]
    return inspect.Signature(params)


from_pretrained.__signature__ = _public_signature()  # type: ignore[attr-defined]


def _family_hooks(module: nn.Module) -> ModelHooks:
    """A plain call's hooks (:func:`fastload.hf.hooks.family_hooks` once transformers is in)."""
    if "transformers.modeling_utils" in sys.modules:
        from fastload.hf.hooks import family_hooks

        return family_hooks(module)
    return ModelHooks()


def _hugging_face_call(
    model: Any, path: Any, state_dict: Any, model_kwargs: dict[str, Any]
) -> bool:
    """Whether the call needs the Hugging Face layer: a model id or directory instead of a class,
    a transformers or Auto class or model, a model id as path, a state dict, or one of
    transformers' option names (honoured or refused there, never given to ``__init__``)."""
    if model is None or isinstance(model, (str, os.PathLike)) or path is None:
        return True
    if state_dict is not None or is_transformers_model(model) or is_auto_class(model):
        return True
    if any(name in TRANSFORMERS_OPTIONS for name in model_kwargs):
        return True
    if is_url(path):  # a plain module's checkpoint in object storage: the core reads it
        return False
    if isinstance(path, (str, os.PathLike)) and not os.path.exists(os.fspath(path)):
        return "/" in os.fspath(path) and not os.path.isabs(os.fspath(path))
    return False
