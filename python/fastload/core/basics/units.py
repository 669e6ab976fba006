"""Byte sizes: parsing ``"5GB"`` / ``"2GiB"`` style arguments and printing sizes for people."""

from __future__ import annotations

import re
from decimal import Decimal

from fastload.core.basics.errors import RequestError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
# Decimal units as the usual max_shard_size spelling ("5GB" = 5 * 10**9), binary with "i".
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

#: The largest size any argument may give: 4 PiB (2**52 bytes), the most physical memory a 64-bit
#: CPU can address (x86-64 and arm64 use at most 52 physical address bits), so beyond any memory
#: budget, staging pool or shard a machine can hold. A larger value is a typo or an overflow
#: (``2**70``), refused before it reaches an allocation.
MAX_BYTES = 2**52


def parse_bytes(
    size: int | str,
    *,
    where: str,
    positive: bool = False,
    maximum: int = MAX_BYTES,
    bound: str = "the largest size fastload accepts (more than a 64-bit machine can address)",
) -> int:
    """Bytes in ``size``: an int, ``"10GB"`` (powers of 1000) or ``"10GiB"`` (powers of 1024).

    ``where`` names the argument in the ``RequestError`` raised for anything else (negative sizes,
    zero when ``positive``, more than ``maximum``, by default :data:`MAX_BYTES`; ``bound`` says
    what the maximum is)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value: int | Decimal = size
    elif isinstance(size, str) and (m := _SIZE_RE.match(size)):
        value = _number(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]
    else:
        raise RequestError(
            f"{where}: {_shown(size)} is not a size; give bytes or a string like '5GB', '500MB', "
            "'2GiB'"
        )
    if value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise RequestError(f"{where}: size must be {kind}, got {_shown(size)}")
    if value > maximum:
        raise RequestError(
            f"{where}: {_shown(size)} is more than {format_bytes(maximum)} ({maximum} bytes), "
            f"{bound}"
        )
    return int(value)


def _number(digits: str) -> Decimal:
    """The number ``digits`` spells, exactly (a float would overflow to infinity past 309 digits,
    and ``int`` refuses more than 4300): anything past :data:`MAX_BYTES` compares as larger."""
    whole = digits.partition(".")[0].lstrip("0")
    if len(whole) > len(str(MAX_BYTES)):
        return Decimal(10) ** len(str(MAX_BYTES))  # past every bound: refused as too large
    return Decimal(digits)


def _shown(size: object) -> str:
    """``size`` for a message: a repr cut short (a size string may be hundreds of digits)."""
    if isinstance(size, int) and size.bit_length() > 128:
        return f"an int of {size.bit_length()} bits"  # repr refuses more than 4300 digits
    text = repr(size)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-12:]} ({len(text)} characters)"


def format_bytes(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; plain bytes below 1 KiB."""
    value, unit = float(nbytes), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
