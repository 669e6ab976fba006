"""``safetensors.numpy`` for the upstream tests: fastload produces torch tensors only, so every
name raises ``NotImplementedError`` and the numpy tests are listed as deliberate differences."""

from __future__ import annotations

from st_shim import _absent

load = _absent("numpy.load")
load_file = _absent("numpy.load_file")
save = _absent("numpy.save")
save_file = _absent("numpy.save_file")

__all__ = ["load", "load_file", "save", "save_file"]
