"""Weights staged into the model's device memory ahead of vLLM's weight loaders.

Without this, a weight loader copies each checkpoint tensor from pageable host memory to the
device on its own: one small synchronous host-to-device copy per tensor, the page faults of the
mapping serialized inside it. Here the tensors of a file go to the device in batches through
fastload's staged ring (:func:`fastload.core.reads.streaming.stream_into`: reads ahead into pinned
slots, the copies to the device on a side stream as each slot completes), a helper thread filling
the next batch while the weight loaders copy out of the current one, device to device. At most two
batches are held, each at most half the ``window`` (a tensor larger than that is a batch of its
own): the device memory this takes ahead of the model is bounded by the window.

Each handed-out tensor is a device tensor of its own (not a view of a shared buffer), so a weight
loader that keeps one keeps a tensor nothing else writes; the caching allocator reuses the memory of
those it drops for the next batches. The same code runs with CPU destinations (``staged: true`` on
a CPU model), which is how it is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fastload import _core
from fastload.core.basics.dtypes import to_torch, torch_shape
from fastload.core.memory.staging import StagingPool
from fastload.core.reads.streaming import stream_into

#: (name, safetensors dtype, shape, begin, end) in file order, as ``SafetensorsFile.tensors()``
Entry = tuple[str, str, list[int], int, int]


def batches(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """``entries`` cut into consecutive batches of at most ``limit`` bytes each (a tensor larger
    than ``limit`` alone in its batch)."""
    out: list[list[Entry]] = []
    held = limit
    for e in entries:
        nbytes = e[4] - e[3]
        if not out or held + nbytes > limit:
            out.append([])
            held = 0
        out[-1].append(e)
        held += nbytes
    return out


def staged_tensors(
    file: _core.SafetensorsFile,
    entries: list[Entry],
    device: torch.device,
    *,
    window: int,
    pool: StagingPool,
    threads: int | None = None,
    stopped: Callable[[], bool] = lambda: False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for ``entries`` of ``file`` in file order, each a new tensor on
    ``device`` filled through the staged ring, the next batch filled while the caller consumes
    this one (see the module docs). ``stopped()`` true ends it early."""
    # The weight loaders' copies are queued on this thread's stream: the helper's writes into
    # memory the allocator hands out again wait for them.
    consumer = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def fill(batch: list[Entry]) -> list[tuple[str, torch.Tensor]]:
        # each sized as torch holds the bytes (a packed dtype's header counts values)
        out = [
            (
                name,
                torch.empty(torch_shape(st_dtype, shape), dtype=to_torch(st_dtype), device=device),
            )
            for name, st_dtype, shape, _b, _e in batch
        ]
        items = [(name, t, None) for name, t in out if t.numel()]
        stream_into(file, items, pool=pool, threads=threads, after=consumer)
        return out

    todo = batches(entries, max(1, window // 2))
    with ThreadPoolExecutor(1, thread_name_prefix="fastload-vllm-stage") as ex:
        ahead: Future[list[tuple[str, torch.Tensor]]] | None = (
            ex.submit(fill, todo[0]) if todo else None
        )
        for i in range(len(todo)):
            assert ahead is not None
            ready = ahead.result()  # raises the helper's error, naming the file and the tensor
            ahead = ex.submit(fill, todo[i + 1]) if i + 1 < len(todo) and not stopped() else None
            while ready:
                name, tensor = ready.pop(0)  # held by the caller alone from here on
                yield name, tensor
                del tensor
            if stopped():
                break


__all__ = ["batches", "staged_tensors"]
