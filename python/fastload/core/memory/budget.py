"""How much memory a load may use: the one owner of that figure (:func:`memory_budget`).

A process in a container is bounded by its memory cgroup, not by the host's free memory:
cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes`` of the process's own cgroup (found
through ``/proc/self/cgroup``) and of its ancestors. Page cache counts against that limit (v1
charges a page to the cgroup of the process that first reads it, v2 likewise), so a model's pages
read ahead, and the mapped pages its views use, take the same room as anonymous memory; what the
cgroup holds in clean page cache can be reclaimed and is counted as room. The budget is

    limit - (usage - reclaimable file cache)

for the tightest level of the cgroup hierarchy, at most the host's ``MemAvailable``; without a
cgroup limit, ``MemAvailable`` (free memory plus reclaimable page cache).

Users of the figure:

* read-ahead (:class:`fastload.core.memory.sharing.WarmUp`,
  :meth:`fastload.core.memory.sharing.SharedMapping.prefetch`)
  reads ahead only what can stay resident (:meth:`MemoryBudget.read_ahead_room`);
* loads that must own their memory (``mmap="copy"``, dtype conversion, pinned staging) are
  refused before anything is allocated when it is short (:func:`check_owned`);
* ``device_map="auto"`` and accelerate's planners size ``"cpu"`` with it;
* ``reload(atomic=True)`` is refused before reading when its staged copies, plus the pages its
  commit copies out of copy-on-write views (:func:`copy_on_write_bytes`), do not fit.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from fastload.core.basics.errors import MemoryBudgetError
from fastload.core.basics.units import format_bytes

#: a cgroup limit at or above this is "no limit" (v1 writes 2**63 rounded down to a page)
_UNLIMITED = 1 << 60
#: share of the budget that read-ahead may fill: the rest is left to what the load and the first
#: forward allocate (the skeleton's buffers, activations, the allocator's caches)
READ_AHEAD_SHARE = 0.5
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class MemoryBudget:
    """The memory a load may still make resident, and where the figure came from."""

    #: bytes that may still become resident (``None``: unknown, no bound)
    available: int | None
    #: where ``available`` came from: "cgroup v2 memory.max", "cgroup v1 memory.limit_in_bytes"
    #: or "MemAvailable" (or "unknown")
    source: str
    #: the cgroup's limit (``None``: no cgroup limit applies)
    limit: int | None = None
    #: swap the process may still use besides (counts for memory a load owns, not for pages it
    #: wants resident)
    swap: int = 0

    @property
    def bounded(self) -> bool:
        return self.available is not None

    def read_ahead_room(self) -> int | None:
        """Bytes that may be read ahead and still be resident on first use (``None``: any)."""
        if self.available is None:
            return None
        return int(self.available * READ_AHEAD_SHARE)

    def fits_read_ahead(self, nbytes: int) -> bool:
        room = self.read_ahead_room()
        return room is None or nbytes <= room

    def describe(self) -> str:
        """In words: ``"1.02 GiB (cgroup v1 memory.limit_in_bytes 1.34 GiB)"``."""
        if self.available is None:
            return f"unbounded ({self.source})"
        where = self.source
        if self.limit is not None:
            where += f" {format_bytes(self.limit)}, less what the cgroup holds"
        return f"{format_bytes(self.available)} ({where})"


def memory_budget() -> MemoryBudget:
    """The budget of this process now: its cgroup's limit less what the cgroup holds
    (reclaimable page cache excepted), at most ``MemAvailable``; ``MemAvailable`` without a
    cgroup limit. Cheap (a few small reads of /proc and /sys): call it per load."""
    host = _meminfo()
    mem_available = host.get("MemAvailable")
    swap_free = host.get("SwapFree", 0)
    group = _cgroup_budget()
    if group is not None:
        available, source, limit, swap = group
        if mem_available is not None:
            available = min(available, mem_available)
        return MemoryBudget(max(0, available), source, limit, min(swap, swap_free))
    if mem_available is not None:
        return MemoryBudget(mem_available, "MemAvailable", None, swap_free)
    return MemoryBudget(None, "unknown")


def check_owned(nbytes: int, budget: MemoryBudget, what: str) -> None:
    """Raises :class:`~fastload.core.basics.errors.MemoryBudgetError` before a load allocates
    ``nbytes`` of memory it must own (``what``: why it must) when the budget cannot hold them."""
    if budget.available is None or nbytes <= budget.available + budget.swap:
        return
    swap = f" plus {format_bytes(budget.swap)} of swap" if budget.swap else ""
    raise MemoryBudgetError(
        f"this load needs {format_bytes(nbytes)} ({nbytes} bytes) of memory of its own ({what}), "
        f"but only {format_bytes(budget.available)} ({budget.available} bytes){swap} is "
        f"available: {budget.describe()}. Refused before allocating anything. What would work: "
        "load the stored dtype as views of the files (mmap='auto', the default, on a local "
        "filesystem: pages are read on use and can be reclaimed, so a model larger than memory "
        "loads), or device_map='auto' with offload_folder=... (what does not fit stays on disk)",
        nbytes,
        budget,
    )


def copy_on_write_bytes(spans: Iterable[tuple[int, int]]) -> int:
    """Bytes of new memory that writing every byte of the address ranges ``spans`` (``(start,
    stop)``) takes for copy-on-write: the pages that lie in a private, writable mapping of a file
    (the views of a load's mapping, :mod:`fastload.core.memory.sharing`) and are not yet the
    process's own (not present, or still the page cache's page: each is copied on its first write; a
    page written before, resident or swapped, costs nothing more). From ``/proc/self/maps`` and
    ``/proc/self/pagemap``; 0 where they cannot be read."""
    pages = _pages_of(spans)
    if not pages:
        return 0
    try:
        mappings = _private_file_mappings()
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return 0
    ends = [end for _, end in mappings]
    total = 0
    try:
        for start, stop in pages:
            # the mappings (sorted, disjoint) that end after the span starts and begin before it
            # stops
            i = bisect.bisect_right(ends, start)
            while i < len(mappings) and mappings[i][0] < stop:
                begin, end = mappings[i]
                i += 1
                a, b = max(start, begin), min(stop, end)
                n = (b - a) // _PAGE
                raw = os.pread(fd, 8 * n, a // _PAGE * 8)
                if len(raw) != 8 * n:
                    continue
                flags = torch.frombuffer(bytearray(raw), dtype=torch.int64)
                # bit 63 (the sign) present, 62 swapped, 61 a file page (or shared anonymous)
                present, swapped, file = flags < 0, (flags >> 62) & 1 == 1, (flags >> 61) & 1 == 1
                total += int((~swapped & (~present | file)).sum())
    except OSError:
        return 0
    finally:
        os.close(fd)
    return total * _PAGE


def _pages_of(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` widened to whole pages, sorted and merged (a page two tensors share counted
    once)."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted((a // _PAGE * _PAGE, -(-b // _PAGE) * _PAGE) for a, b in spans):
        if stop <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _private_file_mappings() -> list[tuple[int, int]]:
    """``(start, stop)`` of this process's private, writable mappings of files."""
    out = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[4] == "0" or fields[1][1:4:2] != "wp":
                continue
            begin, _, end = fields[0].partition("-")
            out.append((int(begin, 16), int(end, 16)))
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# cgroups
# ---------------------------------------------------------------------------------------------


def cgroup_dir(version: int) -> Path | None:
    """This process's own cgroup directory: the v1 memory controller's (``version=1``) or the v2
    unified hierarchy's (``version=2``); ``None`` where there is none mounted."""
    own = _own_cgroups()
    for mountpoint, root, options, fstype in _cgroup_mounts():
        if version == 1 and fstype == "cgroup" and "memory" in options:
            path = own.get("memory")
        elif version == 2 and fstype == "cgroup2":
            path = own.get("")
        else:
            continue
        if path is None:
            continue
        rel = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
        where = Path(mountpoint) / ("" if rel == "." else rel)
        if where.is_dir():
            return where
    return None


def _cgroup_budget() -> tuple[int, str, int, int] | None:
    """``(available, source, limit, swap)`` from the tightest limited cgroup level, or ``None``."""
    v1 = cgroup_dir(1)
    if v1 is not None:
        stat = _stat(v1 / "memory.stat")
        limit = stat.get("hierarchical_memory_limit") or _int(v1 / "memory.limit_in_bytes")
        if limit is not None and limit < _UNLIMITED:
            usage = _int(v1 / "memory.usage_in_bytes") or 0
            cache = stat.get("total_inactive_file", 0) + stat.get("total_active_file", 0)
            memsw = stat.get("hierarchical_memsw_limit")
            swap = max(0, memsw - limit) if memsw is not None and memsw < _UNLIMITED else 0
            return limit - (usage - cache), "cgroup v1 memory.limit_in_bytes", limit, swap
    v2 = cgroup_dir(2)
    if v2 is None:
        return None
    best: tuple[int, str, int, int] | None = None
    level = v2
    while (level / "memory.max").exists():  # up to the root, which has no memory.max
        limit = _int(level / "memory.max")
        if limit is not None and limit < _UNLIMITED:
            usage = _int(level / "memory.current") or 0
            stat = _stat(level / "memory.stat")
            cache = stat.get("inactive_file", 0) + stat.get("active_file", 0)
            swap_max = _int(level / "memory.swap.max")
            swap = 0
            if swap_max is None or swap_max >= _UNLIMITED:
                swap = 1 << 62 if (level / "memory.swap.max").exists() else 0
            else:
                swap = max(0, swap_max - (_int(level / "memory.swap.current") or 0))
            room = limit - (usage - cache)
            if best is None or room < best[0]:
                best = (room, "cgroup v2 memory.max", limit, swap)
        level = level.parent
    return best


def _own_cgroups() -> dict[str, str]:
    """controller -> path from /proc/self/cgroup ("" for the v2 unified hierarchy)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                for controller in parts[1].split(",") if parts[1] else [""]:
                    out[controller] = parts[2]
    except OSError:
        pass
    return out


def _cgroup_mounts() -> list[tuple[str, str, set[str], str]]:
    """``(mount point, root within the hierarchy, super options, fstype)`` of the cgroup mounts."""
    mounts = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
                    continue
                options = set(tail[2].split(","))
                mounts.append((fields[4], fields[3], options, tail[0]))
    except OSError:
        pass
    return mounts


def _int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * 1024
    except (OSError, ValueError):
        pass
    if "MemAvailable" not in out:
        try:
            out["MemAvailable"] = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    return out
