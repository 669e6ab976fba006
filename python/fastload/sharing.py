"""Zero-copy shared mode: CPU tensors that are views of a private mapping of the checkpoint.

With ``from_pretrained(..., mmap="shared")`` each parameter whose stored dtype is the wanted dtype
and whose file offset is aligned for it becomes a view of a ``MAP_PRIVATE`` mapping of the file.
Until a page is written it *is* the page-cache page, so N worker processes that load the same
checkpoint share one physical copy (their private memory stays small); a write copies just that
page (copy-on-write) and never reaches the file. Tensors that need a dtype conversion or are
misaligned are copied as usual.

Hazard: a file truncated or rewritten in place while mapped makes access to the lost pages raise
SIGBUS and kill the process. Replace checkpoints by writing a new file and renaming it (as
``fastload.save_pretrained`` does), never in place. The default mode copies and has no such hazard.
"""

from __future__ import annotations

import os

import torch

from fastload import _core
from fastload.dtypes import to_torch
from fastload.errors import CheckpointError


class SharedMapping:
    """A private (copy-on-write) mapping of one safetensors file, handing out tensor views."""

    def __init__(self, file: _core.SafetensorsFile) -> None:
        self.file = file
        self.path = file.path
        # torch maps by path. On Linux the path of the open file descriptor names exactly the file
        # whose header Rust validated, even if the checkpoint was replaced (or deleted) since.
        # Elsewhere the path must still name that file (a checkpoint replaced by rename would
        # otherwise mix two files), before and after.
        fd = file.fileno()
        by_fd = f"/proc/self/fd/{fd}" if fd is not None else None
        # shared=False maps the file MAP_PRIVATE: reads share the page cache, writes stay private.
        if by_fd is not None and os.path.exists(by_fd):
            self.storage = torch.UntypedStorage.from_file(by_fd, False, file.file_size)
        else:
            self._check_same_file()
            self.storage = torch.UntypedStorage.from_file(self.path, False, file.file_size)
            self._check_same_file()
        self._info = {name: (dt, shape, begin) for name, dt, shape, begin, _ in file.tensors()}

    def _check_same_file(self) -> None:
        st = os.stat(self.path)
        if (st.st_dev, st.st_ino) != self.file.identity() or st.st_size != self.file.file_size:
            raise CheckpointError(
                f"{self.path}: [file-changed] the path no longer names the file that was opened "
                f"and validated ({self.file.file_size} bytes); it was replaced or resized while "
                f"loading (now {st.st_size} bytes)"
            )

    def view(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """A view of tensor ``name`` if it can be shared as ``dtype``; ``None`` if it must be copied
        (different dtype, or an offset not aligned for the element size)."""
        st_dtype, shape, begin = self._info[name]
        stored = to_torch(st_dtype, where=f"{self.path}: tensor {name!r}")
        if stored != dtype:
            return None
        offset = self.file.data_start + begin
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            return None
        out = torch.empty(0, dtype=dtype)
        out.set_(self.storage, offset // itemsize, tuple(shape))
        return out
