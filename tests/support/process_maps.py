"""What this process has mapped, from ``/proc/self/maps``: where a tensor's memory comes from."""

from __future__ import annotations

from pathlib import Path

__all__ = ["mapped_file"]


def mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process; None if the memory there is anonymous."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, stop = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < stop:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None
