"""The names the upstream tests import from ``safetensors``, mapped onto fastload.

fastload has no raw-pointer serialization API (``TensorSpec``, ``serialize``, ``serialize_file``,
``deserialize``): those names raise ``NotImplementedError`` here, so the tests that use them fail
(and are listed as deliberate differences) instead of passing on an unrelated error.
"""

from __future__ import annotations

from typing import Any

from fastload import SafetensorError, safe_open


def _absent(name: str) -> Any:
    def absent(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"fastload has no safetensors.{name}")

    absent.__name__ = name
    return absent


TensorSpec = _absent("TensorSpec")
serialize = _absent("serialize")
serialize_file = _absent("serialize_file")
deserialize = _absent("deserialize")

__all__ = [
    "SafetensorError",
    "safe_open",
    "TensorSpec",
    "serialize",
    "serialize_file",
    "deserialize",
]
