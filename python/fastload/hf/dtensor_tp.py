"""Tensor parallelism exactly as transformers' ``from_pretrained(tp_plan=...)`` does it, with the
reading left to fastload: the sharding side of issue 26.

What transformers 5.25 does (``PreTrainedModel.from_pretrained``, ``transformers/distributed/``)
-------------------------------------------------------------------------------------------------
1. Options. ``tp_plan``/``tp_size`` (deprecated standalone) become ``DistributedConfig(tp_plan,
   tp_size)``; passing them with ``distributed_config=`` is a ``ValueError``. A ``tp_size`` left
   ``None`` with a plan is ``WORLD_SIZE // (dp_replicate * fsdp * pp)``, read from the
   *environment* (torchrun sets it; a process spawned without it gets ``tp_size=1``: no TP).
   ``device_mesh=`` is popped and then ignored: with a distributed config it is overwritten by the
   mesh transformers builds, without one nothing shards.
2. Mesh. ``prepare_distribute_model`` -> ``initialize_distributed_mesh``: ``init_process_group``
   from ``RANK``/``WORLD_SIZE`` if needed (gloo on CPU, nccl on CUDA), ``init_device_mesh`` of
   shape ``(pp, dp_replicate, fsdp, tp)`` named so, and an expert mesh, both in a
   ``TransformersDeviceMesh``; the device is ``cpu`` or ``<accelerator>:LOCAL_RANK`` and becomes
   the device map (so ``device_map=`` with ``tp_size > 1`` is a ``ValueError``). All sizes 1: no
   mesh, nothing shards. ``config.distributed_config`` is set.
3. Model. Built on ``meta`` under ``init.no_tie_weights()`` (so tied parameters are separate).
4. Sharding, before any weight is read: ``maybe_distribute_model`` sets ``_mesh_manager``,
   ``_device_mesh`` (the ``(pp, fsdp, tp)`` sub-mesh), ``_tp_size``, ``_fsdp_size``,
   ``_is_distributed_loading_by_transformers`` and ``config.distributed_config``; resolves the
   plans (``_resolve_parallel_plans``: ``_tp_plan`` = class plan + ``base_model_tp_plan``,
   ``embed_tokens`` -> ``embedding_rowwise``, a dict ``tp_plan`` overrides rules; expanded to one
   entry per parameter and per module); then ``apply_tensor_parallelism(model, mesh["tp"], plan)``:
   for a parameter entry the style's ``shard_param`` replaces it by a ``DTensor`` on meta
   (``distribute_tensor(meta, mesh, [placement], src_data_rank=None)``: colwise ``Shard(0)``,
   rowwise weight ``Shard(-1)`` and bias ``Replicate()``, embedding ``Shard(0|1)``, packed styles
   ``_StridedShard(d, split_factor)``, unit styles ``[Shard(d), Replicate()]`` on a 2-D unit mesh);
   for a module entry ``install_forward`` replaces ``module.forward`` by a closure (input/output
   redistribution, all-reduce) or adds a forward pre-hook; every planned module gets
   ``_is_hooked = True``. Parameters outside the plan (norms) stay plain tensors.
5. Reading: for each DTensor parameter ``DtensorShardOperation(param).shard_tensor(slice)`` reads
   this rank's part of the full checkpoint tensor (``Shard``: the contiguous chunk of
   ``Shard.local_shard_size_and_offset``, i.e. ``ceil(n / world)`` rows per rank, the last ranks
   shorter or empty when uneven; ``_StridedShard``: one chunk of each of ``split_factor`` groups,
   concatenated), then ``set_param_for_module`` wraps it with ``DTensor.from_local(..., shape,
   stride)`` into a new ``Parameter`` flagged ``_is_hf_initialized``.
6. Finishing: missing keys and non-persistent buffers are moved off meta (empty) and initialized
   (``initialize_weights`` skips flagged tensors), tied weights are tied (a DTensor shared by two
   modules), ``eval()``.

What this module reproduces
---------------------------
:func:`resolve_tp_options` is step 1-2 (transformers' own ``DistributedConfig``,
``prepare_distribute_model`` and mesh). :func:`shard_like_transformers` is step 4 on a skeleton
(transformers' own ``maybe_distribute_model``, so the same plan, placements, hooks and attributes),
then step 5 without the bytes: every parameter (and persistent buffer) is replaced by what
``set_param_for_module`` would put there, holding an *empty* local tensor on the rank's device, and
the rank's part of the stored tensor is described by a :class:`Selection` computed by transformers'
own ``DtensorShardOperation`` (run on a recorder, so no byte is read). The loader fills
``LocalShard.tensor`` with those bytes (:meth:`LocalShard.fill_from` from a full tensor, or its own
reads of ``Selection.ranges``). :func:`finish_like_transformers` is step 6.

Not covered (refused with ``UnsupportedError`` where detectable): pipeline, FSDP and expert
parallelism (``pp_size``/``fsdp_size``/``dp_replicate_size``/``ep_size`` > 1), quantized models,
and checkpoints whose tensors transformers converts on load (MoE experts stored one per expert,
fused renames): a selection describes the *model parameter's* full tensor, which is the stored one
only when the key maps 1:1. Packed (``_StridedShard``) and uneven shards are covered by the
selection (several ranges; empty or shorter ranges) but only the dense Llama plan is tested.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import RequestError, UnsupportedError

__all__ = [
    "LocalShard",
    "Selection",
    "TpSetup",
    "finish_like_transformers",
    "resolve_tp_options",
    "shard_like_transformers",
]


@dataclass(frozen=True)
class TpSetup:
    """transformers' TP options resolved: its ``DistributedConfig``, its ``TransformersDeviceMesh``
    and the device the rank's local shards live on (transformers' device map under TP)."""

    distributed_config: Any
    mesh_manager: Any
    device: torch.device

    @property
    def tp_mesh(self) -> Any:
        """The 1-D ``tp`` mesh the styles shard over."""
        return self.mesh_manager.get_mesh("tp")

    @property
    def device_mesh(self) -> Any:
        """The ``(pp, fsdp, tp)`` mesh transformers stores as ``model._device_mesh``."""
        return self.mesh_manager.get_mesh(("pp", "fsdp", "tp"))


def resolve_tp_options(
    *,
    tp_plan: str | dict[str, str] | None = None,
    tp_size: int | None = None,
    device_mesh: Any = None,
    distributed_config: Any = None,
    device_map: Any = None,
) -> TpSetup | None:
    """transformers' ``from_pretrained`` TP options -> a :class:`TpSetup`, or ``None`` when they
    ask for no parallelism (nothing given, or every size 1).

    Same rules and errors as transformers 5.25: standalone ``tp_plan``/``tp_size`` with
    ``distributed_config`` is a ``ValueError``; a dict ``distributed_config`` is read with
    ``DistributedConfig.from_dict``; ``tp_size=None`` is derived from ``WORLD_SIZE``; the process
    group is initialized from the environment if it is not yet. ``device_mesh`` is accepted and
    ignored, as transformers 5.25 ignores it (it builds its own mesh over the whole world).
    Pipeline, FSDP and expert parallelism raise ``UnsupportedError``.
    """
    del device_mesh  # transformers 5.25 pops it and never uses it (see the module docstring)
    from transformers import PreTrainedModel
    from transformers.distributed import DistributedConfig

    if distributed_config is not None and (tp_plan is not None or tp_size is not None):
        raise ValueError(
            "Pass either `distributed_config` or the standalone `tp_plan`/`tp_size` arguments, "
            "not both. Set tensor-parallel options on `DistributedConfig` when using it."
        )
    if tp_plan is not None or tp_size is not None:
        distributed_config = DistributedConfig(tp_plan=tp_plan, tp_size=tp_size)
    if distributed_config is None:
        return None
    if isinstance(distributed_config, Mapping):
        distributed_config = DistributedConfig.from_dict(dict(distributed_config))
    others = {
        "pp_size": distributed_config.pp_size,
        "fsdp_size": distributed_config.fsdp_size,
        "dp_replicate_size": distributed_config.dp_replicate_size,
        "ep_size": distributed_config.ep_size,
    }
    if any(size > 1 for size in others.values()):
        given = ", ".join(f"{k}={v}" for k, v in others.items() if v > 1)
        raise UnsupportedError(f"fastload shards for tensor parallelism only, not {given}")
    config, device, mesh_manager = PreTrainedModel.prepare_distribute_model(
        distributed_config, device_map=device_map
    )
    if mesh_manager is None:
        return None
    return TpSetup(config, mesh_manager, torch.device(device))


@dataclass(frozen=True)
class Selection:
    """The part of a full stored tensor that a rank's local shard holds: along dimension ``dim``
    (of the full tensor, non-negative), the indices ``[start, stop)`` of each of ``ranges``,
    concatenated in order; every other dimension whole.

    One range for ``Shard`` placements (possibly shorter than the others, or empty, when the size
    does not divide); several for packed styles (``_StridedShard``: one per packed group).
    """

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def span(self) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` when the selection is one contiguous range, else ``None``."""
        if len(self.ranges) != 1:
            return None
        return (self.dim, *self.ranges[0])

    @property
    def length(self) -> int:
        """The local shard's size along :attr:`dim`."""
        return sum(stop - start for start, stop in self.ranges)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The selected part of ``full`` (views when one range; a new tensor otherwise)."""
        parts = [full.narrow(self.dim, start, stop - start) for start, stop in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class LocalShard:
    """One tensor of the model as the loader must fill it: ``tensor`` (the rank's local tensor,
    allocated empty on the rank's device; for a DTensor parameter, its ``_local_tensor``) receives
    ``selection`` of the stored tensor ``name`` (``None``: the whole tensor)."""

    name: str
    tensor: torch.Tensor
    selection: Selection | None
    full_shape: tuple[int, ...]

    def fill_from(self, full: torch.Tensor) -> None:
        """Copies this rank's part of ``full`` (the whole stored tensor) into :attr:`tensor`."""
        if tuple(full.shape) != self.full_shape:
            raise RequestError(
                f"{self.name}: stored shape {tuple(full.shape)} != model's {self.full_shape}"
            )
        part = full if self.selection is None else self.selection.take(full)
        with torch.no_grad():
            self.tensor.copy_(part)


class _Recorder:
    """Stands for a stored tensor in ``DtensorShardOperation.shard_tensor``: records each index
    it is read with and answers with a meta tensor of the indexed shape (no byte read)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.reads: list[tuple[slice, ...]] = []

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is Ellipsis:
            index = ()
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        self.reads.append(index)
        sizes = [len(range(*s.indices(n))) for s, n in zip(index, self.shape, strict=True)]
        return torch.empty(sizes, device="meta")


def dtensor_selection(name: str, param: Any) -> Selection | None:
    """The part of the full tensor that transformers reads into the local shard of the DTensor
    ``param`` on this rank: ``DtensorShardOperation``'s own arithmetic, recorded."""
    from transformers.distributed.sharding_utils import DtensorShardOperation

    shape = tuple(param.shape)
    recorder = _Recorder(shape)
    local = DtensorShardOperation(param).shard_tensor(recorder)
    expected = tuple(param._local_tensor.shape)
    if tuple(local.shape) != expected:
        raise UnsupportedError(
            f"{name}: transformers reads a {tuple(local.shape)} shard for a {expected} local tensor"
        )
    sliced: set[int] = set()
    for read in recorder.reads:
        for dim, (s, n) in enumerate(zip(read, shape, strict=True)):
            if s.indices(n)[:2] != (0, n):
                sliced.add(dim)
    if not sliced:
        return None
    if len(sliced) > 1:
        raise UnsupportedError(f"{name}: a shard sliced along dims {sorted(sliced)}")
    dim = sliced.pop()
    ranges = tuple(read[dim].indices(shape[dim])[:2] for read in recorder.reads)
    return Selection(dim, ranges)


def _tied_targets(model: nn.Module) -> dict[str, str]:
    tied = getattr(model, "all_tied_weights_keys", None)
    return dict(tied) if isinstance(tied, Mapping) else {}


def _untie(model: nn.Module, targets: Iterable[str]) -> None:
    """Gives each tied target a parameter of its own on meta, as transformers' skeleton has
    (``init.no_tie_weights()``); :func:`finish_like_transformers` ties them again."""
    for name in targets:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        current = owner._parameters.get(attr)
        if current is not None:
            fresh = torch.empty_like(current, device="meta")
            owner._parameters[attr] = nn.Parameter(fresh, requires_grad=current.requires_grad)


def _on_meta(model: nn.Module) -> None:
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.device.type != "meta":
            raise RequestError(
                f"{name} is on {tensor.device}: shard a skeleton (parameters on meta)"
            )


def shard_like_transformers(
    model: nn.Module,
    setup: TpSetup,
    *,
    allocate: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] | None = None,
) -> dict[str, LocalShard]:
    """Makes the skeleton ``model`` (a transformers model, every tensor on ``meta``) what
    transformers' TP loading makes it, minus the values; returns what to read into it.

    After the call the model has transformers' ``_tp_plan``, ``_device_mesh``, ``_mesh_manager``,
    ``_tp_size``, ``config.distributed_config`` and the styles' forwards/hooks (its own
    ``maybe_distribute_model``); each planned parameter is a ``DTensor`` ``Parameter`` with
    transformers' placements whose local tensor is allocated (``torch.empty`` on
    ``setup.device``, or ``allocate(shape, dtype, device)``) but not filled; every other parameter
    and persistent buffer is a plain tensor allocated the same way. Parameters tied to another one
    (``all_tied_weights_keys``) are left out: :func:`finish_like_transformers` ties them.

    Returns, by state-dict name, the :class:`LocalShard` to fill. Every tensor is flagged
    ``_is_hf_initialized``, as transformers flags what it loads: a name the loader does not fill
    must be passed to :func:`finish_like_transformers` as missing.
    """
    from torch.distributed.tensor import DTensor
    from transformers.distributed.sharding_utils import _dtensor_from_local_like
    from transformers.distributed.tensor_parallel import verify_tp_plan

    if getattr(model, "hf_quantizer", None) is not None:
        raise UnsupportedError("tensor-parallel sharding of a quantized model")
    _on_meta(model)
    tied = _tied_targets(model)
    _untie(model, tied)
    model = type(model).maybe_distribute_model(model, setup.distributed_config, setup.mesh_manager)
    verify_tp_plan(list(model.state_dict().keys()), getattr(model, "_tp_plan", None))

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if allocate is None:
            return torch.empty(shape, dtype=dtype, device=setup.device)
        return allocate(shape, dtype, setup.device)

    shards: dict[str, LocalShard] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, ref in model.state_dict(keep_vars=True).items():
        if name in tied:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        full_shape = tuple(ref.shape)
        if isinstance(ref, DTensor):
            local = empty(tuple(ref._local_tensor.shape), ref.dtype)
            wrapped = _dtensor_from_local_like(local, ref)
            value: torch.Tensor = nn.Parameter(
                wrapped, requires_grad=ref.requires_grad and wrapped.is_floating_point()
            )
            selection = dtensor_selection(name, ref)
            local = value._local_tensor  # type: ignore[attr-defined]
        else:
            local = empty(full_shape, ref.dtype)
            is_param = name in params
            value = (
                nn.Parameter(local, requires_grad=local.is_floating_point()) if is_param else local
            )
            selection = None
        value._is_hf_initialized = True  # type: ignore[attr-defined]
        setattr(owner, attr, value)
        shards[name] = LocalShard(name, local, selection, full_shape)
    return shards


def finish_like_transformers(
    model: nn.Module, setup: TpSetup, *, missing: Iterable[str] = ()
) -> None:
    """What transformers does after reading the weights of a TP model (``_finalize_model_loading``):
    the ``missing`` names (not filled by the loader) and the non-persistent buffers are moved off
    meta to the rank's device and initialized by the model's own ``initialize_weights``, tied
    weights are tied (to the source's DTensor), and the model is put in eval mode."""
    missing_keys = set(missing)
    tied = _tied_targets(model)
    for target in tied:
        model.get_parameter(target)._is_hf_initialized = True  # type: ignore[attr-defined]
    for name in missing_keys:
        with contextlib.suppress(AttributeError):
            delattr(model.get_parameter_or_buffer(name), "_is_hf_initialized")
    device_map = {"": setup.device}
    model._move_missing_keys_from_meta_to_device(  # type: ignore[operator]
        missing_keys, device_map, setup.device_mesh, None
    )
    model._initialize_missing_keys(False)  # type: ignore[operator]
    model.tie_weights(missing_keys=missing_keys | set(tied), recompute_mapping=False)  # type: ignore[operator]
    model.eval()
