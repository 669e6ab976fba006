"""Where each model tensor goes: its device, dtype and the part of the stored tensor that fills it.

:class:`Placement` is the one place that decides it (device maps, tensor-parallel slices and dtype
rules all meet here); :class:`Destination` is its answer for one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastload.core.basics.dtypes import CONVERTIBLE, to_st
from fastload.core.checkpoint.opened import StoredTensor
from fastload.core.devices.device_map import DISK, DeviceMap, Place
from fastload.core.plan.steps import TensorParallelLayout

Selection = list[int] | None


@dataclass(frozen=True)
class Destination:
    """Where one model tensor is allocated, and which part of the stored tensor fills it.

    ``selection`` is what the copy engine takes: ``None`` (the whole tensor), ``[start, stop]``
    (flat elements) or ``[dim, start, stop]`` (a slice along ``dim``, e.g. a tensor-parallel shard).
    """

    #: a device, or :data:`~fastload.core.devices.device_map.DISK` (left in the file, read when
    #: used)
    device: Place
    dtype: torch.dtype
    selection: Selection | Any = None
    #: the model family's own tensor to fill in place (never allocated or swapped in)
    tensor: torch.Tensor | None = None

    @property
    def memory(self) -> torch.device:
        """The device it is allocated on (never asked of a tensor left on disk)."""
        if not isinstance(self.device, torch.device):
            raise AssertionError("a tensor offloaded to disk is not allocated")
        return self.device


def selected_shape(shape: tuple[int, ...], selection: Selection) -> tuple[int, ...]:
    """The shape of the part of a ``shape``-d tensor that ``selection`` takes."""
    if selection is None:
        return tuple(shape)
    if len(selection) == 2:
        return (selection[1] - selection[0],)
    dim, start, stop = selection
    out = list(shape)
    out[dim] = stop - start
    return tuple(out)


class Placement:
    """Decides the :class:`Destination` of every model tensor.

    This is the single place where device, dtype and the selected part of a stored tensor are
    chosen; per-tensor placement (a device map), tensor-parallel slicing and zero-copy modes belong
    here. Rules:

    * device: ``device`` for every tensor, or with a ``device_map`` the device of the longest
      module prefix containing its name (:mod:`fastload.core.devices.device_map`);
    * selection: with a tensor-parallel layout ``tp``, the rows or columns this rank owns of a
      parameter the plan shards, taken from the model's full shape (the layout the entry's
      steps make, :class:`fastload.core.plan.steps.TensorParallelLayout`);
    * dtype ``"auto"`` (``dtype=None`` here): the stored dtype for loaded tensors, the model's for
      the others;
    * an explicit floating ``dtype``: loaded floating tensors are converted to it during the copy,
      except where the model decides otherwise: names matching ``keep_fp32`` (the family's
      modules kept in float32) become float32, and when fastload built the skeleton under that
      dtype (``skeleton_dtypes=True``) a float tensor the model created in another dtype keeps it
      (as the model asked). Tensors stored in a type the copy engine cannot convert (integers,
      float8...) keep the stored type; buffers that are not loaded keep theirs.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        dtype: torch.dtype | None,
        keep_fp32: Any | None = None,
        skeleton_dtypes: bool = False,
        device_map: DeviceMap | None = None,
        tp: TensorParallelLayout | None = None,
        provided: dict[str, Any] | None = None,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.keep_fp32 = keep_fp32  # compiled regex (search) or None
        self.skeleton_dtypes = skeleton_dtypes
        self.device_map = device_map
        self.tp = tp
        self.provided = provided or {}  # FamilyShards.tensors

    def destination(
        self,
        name: str,
        template: torch.Tensor,
        stored: StoredTensor | None,
        *,
        is_buffer: bool,
    ) -> Destination:
        """The destination of model tensor ``name`` (``template`` is the tensor the model holds
        now, possibly on meta; ``stored`` is the checkpoint tensor that fills it, if any)."""
        given = self.provided.get(name)
        if given is not None:  # the family's own tensor (a DTensor's local shard)
            local = given.tensor
            return Destination(local.device, local.dtype, given.selection, local)
        device = self.device if self.device_map is None else self.device_map.device_of(name)
        if device == DISK and is_buffer:  # only parameters are offloaded (offload_buffers=False)
            device = torch.device("cpu")
        selection = None
        if self.tp is not None and not is_buffer:
            selection = self.tp.selection(name, tuple(template.shape))
        return Destination(device, self._dtype(name, template, stored, is_buffer), selection)

    def _dtype(
        self, name: str, template: torch.Tensor, stored: StoredTensor | None, is_buffer: bool
    ) -> torch.dtype:
        if stored is not None and stored.st_dtype not in CONVERTIBLE:
            return stored.dtype
        base = stored.dtype if stored is not None else template.dtype
        if self.dtype is None or not base.is_floating_point:
            return base
        if self.keep_fp32 is not None and self.keep_fp32.search(name) is not None:
            return torch.float32
        if stored is None and (is_buffer or self.skeleton_dtypes):
            return template.dtype
        if self.skeleton_dtypes and to_st(template.dtype) in CONVERTIBLE:
            return template.dtype
        return self.dtype
