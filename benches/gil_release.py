"""Concurrent loads versus loads in a row: a figure, not a pass/fail test.

The suite checks that copies release the GIL by what that guarantees (another thread watches a
copy's progress and cancels it mid-way, ``tests/core/test_concurrency.py``). How much faster two
threads load than one is a property of the machine and its load, so it is measured here:

    python benches/gil_release.py [--mib 256] [--rounds 5]

prints one JSON line: the best-of-rounds seconds of one load, of two loads in two threads, their
ratio (about 1.0 with two free cores, 2.0 if the GIL were held), and the same for sha256 (work
known to release the GIL) as the machine's own reference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

import fastload


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _both(work: Callable[[Path], object], paths: list[Path]) -> None:
    threads = [threading.Thread(target=work, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _warm(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def measure(work: Callable[[Path], object], paths: list[Path], rounds: int) -> dict[str, float]:
    """Best-of-``rounds`` seconds of one run (half of two in a row) and of two concurrent runs."""
    one, two = [], []
    for _ in range(rounds):
        _warm(paths)
        one.append(_timed(lambda: [work(p) for p in paths]) / 2)
        _warm(paths)
        two.append(_timed(lambda: _both(work, paths)))
    best_one, best_two = min(one), min(two)
    return {"one_s": best_one, "two_threads_s": best_two, "ratio": best_two / best_one}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of each of the two files")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i in range(2):
            path = Path(tmp) / f"big{i}.safetensors"
            save_file({"w": torch.full((args.mib << 18,), float(i))}, str(path))
            paths.append(path)
        data = bytes(args.mib << 20)
        result = {
            "mib_per_file": args.mib,
            "sha256": measure(lambda _: hashlib.sha256(data).digest(), paths, args.rounds),
            "load_file_threads_1": measure(
                lambda p: fastload.load_file(p, threads=1), paths, args.rounds
            ),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
