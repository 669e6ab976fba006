"""The staged path of GPU loads, measured on CPU: the same code with CPU destinations, beside the
floors measured in the same run.

    python benches/staged_bench.py [--sizes 1,4] [--repeats 3] [--out benches/results]

One bf16 file per size (Llama-like: tensors of 4096 x 4096, random values, made once under
--workdir). Every run is a fresh process; before it the file is evicted from the page cache
(``fsync`` + ``posix_fadvise(DONTNEED)``: cold) or read once (warm). Destinations are allocated and
touched before the clock. Runs go round robin (every method and cache state once, then again,
``--repeats`` times); the tables give medians. Methods:

* ``floor: pread``: ``--threads`` threads (8) reading the whole file in 64 MiB ``pread`` calls, each
  into a buffer of its own (no destination): the storage's floor cold, the page cache's warm.
* ``floor: pread direct``: the same reads with ``O_DIRECT`` (past the page cache, into aligned
  buffers): the storage's floor for the staged path, which reads cold ranges that way.
* ``floor: memcpy``: one parallel copy (torch's ``copy_``, every core) of the same bytes from memory
  into the destinations: what the slots' copy costs when the bytes are already in memory.
* ``staged``: ``fastload.core.reads.streaming.stream_into`` into the CPU destinations, the default
pool:
  what a GPU load runs, with the host-to-device copy a CPU copy here.
* ``staged: slots only``: the same ring with a consumer that takes and releases each slot without
  copying out of it: how fast the slots fill, the part a GPU's copy engine overlaps.
* ``staged (baseline)``: with ``--baseline DIR``, another checkout's staged path (its
  ``python/`` folder with its extension built in it), for a before/after in the same run.
* ``engine copy``: the engine's direct copy into the CPU destinations
  (``fastload.core.reads.reading.fill``), the CPU path of a load, for reference.

Also per run: the fraction of the file left in the page cache afterwards (``mincore``), and the
bytes the ring read past the page cache. Writes ``staged-cpu.json`` and ``staged-cpu.md`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

METHODS = [
    "floor: pread",
    "floor: pread direct",
    "floor: memcpy",
    "staged",
    "staged: slots only",
    "engine copy",
]
MODES = ["cold", "warm"]
READ = 64 << 20


def make_file(path: Path, gib: int) -> None:
    import torch
    from safetensors.torch import save_file

    if path.exists():
        return
    gen = torch.Generator().manual_seed(0)
    n = gib * 32  # 32 MiB tensors of 4096 x 4096 bf16
    state = {
        f"layers.{i}.weight": torch.randn(4096, 4096, generator=gen).bfloat16() for i in range(n)
    }
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, path)


def run_one(method: str, path: Path, threads: int) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    import torch

    from fastload.core.memory.page_cache import resident_fraction
    from fastload.core.reads.reading import allocate_all, fill, open_file
    from fastload.core.reads.streaming import stream_into

    if method != "staged (baseline)":
        from fastload.core.memory.staging import StagingPool

    file = open_file(path)
    size = path.stat().st_size
    out: dict[str, Any] = {}
    dest = allocate_all(file, torch.device("cpu"), None)
    for t in dest.values():
        t.view(torch.uint8).fill_(1)  # touched: page faults are not part of any method
    items = [(k, t, None) for k, t in dest.items()]
    if method == "floor: pread":
        fd = os.open(path, os.O_RDONLY)
        offsets = list(range(0, size, READ))
        bufs = [bytearray(READ) for _ in range(threads)]

        def reader(i: int) -> None:
            view = memoryview(bufs[i])
            for off in offsets[i::threads]:
                os.preadv(fd, [view[: min(READ, size - off)]], off)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(reader, range(threads)))
        seconds = time.perf_counter() - t0
        os.close(fd)
    elif method == "floor: pread direct":
        import mmap

        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        offsets = list(range(0, size, READ))
        bufs = [mmap.mmap(-1, READ) for _ in range(threads)]  # page-aligned

        def direct_reader(i: int) -> None:
            for off in offsets[i::threads]:
                os.preadv(fd, [bufs[i]], off)  # the last read is short at the end of the file

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(direct_reader, range(threads)))
        seconds = time.perf_counter() - t0
        os.close(fd)
    elif method == "floor: memcpy":
        src = {k: torch.empty_like(t) for k, t in dest.items()}
        for t in src.values():
            t.view(torch.uint8).fill_(2)
        t0 = time.perf_counter()
        for k, t in dest.items():
            t.copy_(src[k])
        seconds = time.perf_counter() - t0
    elif method == "staged":
        pool = StagingPool()
        pool.slab(pinned=False)  # the slab is made once per process on a GPU (pinned): not timed
        t0 = time.perf_counter()
        stream_into(file, items, pool=pool)
        seconds = time.perf_counter() - t0
        out["direct_bytes"], out["cached_bytes"] = pool.direct_bytes, pool.cached_bytes
    elif method == "staged (baseline)":
        # another checkout's staged path (--baseline), its buffers made before the clock too
        from fastload.core.reads.streaming import StagingPool as BaselinePool  # type: ignore[attr-defined]

        pool = BaselinePool()
        for _ in range(pool.num_buffers):
            pool.next_buffer(False)
        t0 = time.perf_counter()
        stream_into(file, items, pool=pool)
        seconds = time.perf_counter() - t0
    elif method == "staged: slots only":
        from fastload import _core

        pool = StagingPool()
        addresses = pool.slot_addresses(pinned=False)
        t0 = time.perf_counter()
        ring = _core.StagedRead(file, [(k, None) for k in dest], addresses, pool.slot_bytes)
        for k in range(len(ring.fills())):
            ring.wait(k)
            ring.release(k)
        out["direct_bytes"], out["cached_bytes"] = ring.finish()
        seconds = time.perf_counter() - t0
    elif method == "engine copy":
        t0 = time.perf_counter()
        fill(file, items)
        seconds = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown method {method!r}")
    out["seconds"] = seconds
    out["gib_per_s"] = size / seconds / 2**30
    out["resident_after"] = resident_fraction(path)  # from the kernel, not from fastload
    return out


def prepare(path: Path, mode: str) -> None:
    from fastload.core.memory.page_cache import evict, warm

    (evict if mode == "cold" else warm)(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4", help="GiB per file, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="threads of the pread floor")
    ap.add_argument("--workdir", default="/tmp/fastload-staged-bench")
    ap.add_argument("--out", default=None, help="folder for staged-cpu.json/.md (none: print)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--baseline",
        help="the python/ folder of another checkout (its extension built in it): adds the method "
        "'staged (baseline)', that checkout's staged path, to the round robin",
    )
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, Path(args.file), args.threads)))
        return
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")
    if args.baseline:
        methods.insert(
            methods.index("staged") + 1 if "staged" in methods else 0, "staged (baseline)"
        )
    results: dict[str, Any] = {"command": " ".join(sys.argv), "runs": []}
    for gib in (int(s) for s in args.sizes.split(",")):
        path = work / f"llama-{gib}GiB.safetensors"
        make_file(path, gib)
        for rep in range(args.repeats):
            for mode in MODES:
                for method in methods:
                    prepare(path, mode)
                    cmd = [sys.executable, __file__, "--run", method, "--file", str(path)]
                    cmd += ["--threads", str(args.threads)]
                    env = dict(os.environ)
                    if method == "staged (baseline)":
                        env["PYTHONPATH"] = args.baseline
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
                    if done.returncode:
                        raise SystemExit(f"{method} {mode}: {done.stderr[-2000:]}")
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    row |= {"gib": gib, "mode": mode, "method": method, "repeat": rep}
                    results["runs"].append(row)
                    print(
                        f"{gib} GiB {mode:4} {method:20} {row['seconds']:.3f} s "
                        f"({row['gib_per_s']:.2f} GiB/s) "
                        f"resident after {row['resident_after']:.2f}",
                        flush=True,
                    )
    table = summarize(results["runs"])
    results["table"] = table
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "staged-cpu.json").write_text(json.dumps(results, indent=1))
        (out / "staged-cpu.md").write_text(f"`{results['command']}`\n\n{table}\n")


def summarize(runs: list[dict[str, Any]]) -> str:
    """Medians per size, mode and method, as ratios to the floors of the same run (floor time /
    method time: 1.0 is at the floor, below it slower)."""
    floors = {"pread": "floor: pread", "direct": "floor: pread direct", "memcpy": "floor: memcpy"}
    lines = [
        "| size | cache | method | median s | GiB/s | x pread floor | x direct-read floor "
        "| x memcpy floor | left cached |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["gib"], r["mode"]) for r in runs}, key=lambda k: (k[0], MODES.index(k[1])))
    for gib, mode in keys:
        rows = [r for r in runs if (r["gib"], r["mode"]) == (gib, mode)]
        med = {
            m: statistics.median(r["seconds"] for r in rows if r["method"] == m)
            for m in dict.fromkeys(r["method"] for r in rows)
        }
        cached = {
            m: statistics.median(r["resident_after"] for r in rows if r["method"] == m) for m in med
        }
        for m, s in med.items():
            ratios = [med.get(f, float("nan")) / s for f in floors.values()]
            cells = " | ".join(f"{x:.2f}" for x in ratios)
            head = f"| {gib} GiB | {mode} | {m} | {s:.3f} | {gib / s:.2f}"
            lines.append(f"{head} | {cells} | {cached[m]:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
