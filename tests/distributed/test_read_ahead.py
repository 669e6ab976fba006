"""The read-ahead of a collective read with fills that overlap (``ReadAhead.overlap``, as the
owner of chunks from object storage runs it on the CPU): the next fill starts while the last one
is still fetching, the exchange gets the chunks in their order whatever fill ends first, a
failure reaches it after the chunks before it and nothing after it, and a fill that ends while
the helper thread waits for a buffer is handed on at once (the exchange gives buffers back only
once it has its chunks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fastload.distributed.read_ahead import ReadAhead

WAIT = 10.0  # seconds a fill waits for another before it gives up (a failure, never a hang)


class Scripted(ReadAhead):
    """Chunk ``i`` is filled by ``script[i]()`` (given the reader), returning ``i``."""

    overlap = 2

    def __init__(self, script: list[Callable[[Scripted], None]], depth: int) -> None:
        super().__init__(len(script), 0, depth, torch.device("cpu"))
        self.script = script
        self.started = [threading.Event() for _ in script]

    def _fill(self, index: int, buffer: torch.Tensor, session: Any) -> Any:
        self.started[index].set()
        self.script[index](self)
        return (index, buffer)


def _take(reader: ReadAhead, count: int) -> list[Any]:
    """What the exchange gets, ``count`` chunks, each buffer given back once taken; from a
    thread, so that a read-ahead that never hands one on fails here instead of hanging."""
    got: list[Any] = []

    def exchange() -> None:
        for _ in range(count):
            try:
                index, buffer = reader.next()
            except Exception as e:
                got.append(e)
                return
            got.append(index)
            reader.release(buffer)

    thread = threading.Thread(target=exchange, daemon=True)
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive(), f"the exchange waited for a chunk never handed on (got {got})"
    return got


def test_the_next_fill_starts_before_the_last_ends_and_chunks_come_in_order() -> None:
    saw: list[bool] = []

    def first(reader: Scripted) -> None:  # ends only once the second fill has begun
        saw.append(reader.started[1].wait(WAIT))

    quick: Callable[[Scripted], None] = lambda reader: None  # noqa: E731
    with Scripted([first, quick, quick, quick], depth=3) as reader:
        assert _take(reader, 4) == [0, 1, 2, 3]
    assert saw == [True], "the second fill did not start while the first was fetching"


def test_a_failed_fill_reaches_the_exchange_after_the_chunks_before_it_and_nothing_after() -> None:
    def slow(reader: Scripted) -> None:
        reader.started[2].wait(WAIT)  # the fills after the failing one run meanwhile

    def failing(reader: Scripted) -> None:
        raise OSError("fetching chunk 1 failed")

    quick: Callable[[Scripted], None] = lambda reader: None  # noqa: E731
    with Scripted([slow, failing, quick, quick], depth=3) as reader:
        got = _take(reader, 2)
        assert got[0] == 0
        assert isinstance(got[1], OSError) and "chunk 1" in str(got[1])
        time.sleep(0.2)  # any fill still going ends
        assert reader.ready.empty(), "chunks after the failed one were handed on"


@pytest.mark.parametrize("depth", [1, 2])
def test_a_fill_ending_while_the_helper_waits_for_a_buffer_is_handed_on_at_once(
    depth: int,
) -> None:
    # with every buffer out, the helper waits for one; the exchange gives one back only once it
    # has the chunk that buffer holds: that chunk must come from the fill's end, not the helper
    def slow(reader: Scripted) -> None:
        time.sleep(0.2)

    with Scripted([slow] * 5, depth=depth) as reader:
        assert _take(reader, 5) == [0, 1, 2, 3, 4]


def test_leaving_early_stops_the_helper_and_its_fills() -> None:
    release = threading.Event()

    def held(reader: Scripted) -> None:
        release.wait(WAIT)

    reader = Scripted([held] * 6, depth=3)
    with reader:
        assert reader.started[0].wait(WAIT) and reader.started[1].wait(WAIT)
        release.set()  # as a cancel would: the fills under way end, nothing more starts
    assert not reader.thread.is_alive()
    assert not any(e.is_set() for e in reader.started[3:])
