"""Save throughput: ``fastload.save_file`` against ``safetensors.torch.save_file``.

Run: ``python benches/save_bench.py [--size-gib 1] [--rounds 3] [--dir /path/on/the/disk]``.

A state dict of model-like tensors (half in 8 MiB float32 matrices, 3/8 in 2 MiB ones, 1/8 in
1 MiB bfloat16 ones) is saved once per round by each writer, in turn:

- ``safetensors.save_file``: returns when the bytes are in the page cache, not on the disk;
- ``safetensors.save_file+fsync``: the same, then ``fsync``: durable, like fastload;
- ``fastload.save_file``: parallel positioned writes, ``fsync``, rename into place;
- ``fastload.save_file threads=1``: the same with one writer thread;
- ``fastload.save_pretrained new dir``: the same tensors as a module's buffers saved as a
  checkpoint into a directory that does not exist yet (written aside, fsynced, renamed);
- ``fastload.save_pretrained replace``: the same over the previous round's checkpoint (one atomic
  directory exchange), which includes deleting the old checkpoint's data.

The disk is synced before every save so one writer's dirty pages do not slow the next; round 0 is
a warm-up (page cache, allocator) and is not counted. Prints the median GB/s (10^9 bytes) of each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file as st_save_file
from torch import nn

import fastload

MIB = 1 << 20


def _tensors(size_gib: float) -> dict[str, torch.Tensor]:
    total = int(size_gib * (1 << 30))
    torch.manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(max(1, total // 2 // (8 * MIB))):
        tensors[f"big_{i}"] = torch.randn(2048, 1024)  # 8 MiB
    for i in range(max(1, total * 3 // 8 // (2 * MIB))):
        tensors[f"mid_{i}"] = torch.randn(1024, 512)  # 2 MiB
    for i in range(max(1, total // 8 // MIB)):
        tensors[f"bf16_{i}"] = torch.randn(512, 1024).bfloat16()  # 1 MiB
    return tensors


def _as_module(tensors: dict[str, torch.Tensor]) -> nn.Module:
    module = nn.Module()
    for name, tensor in tensors.items():
        module.register_buffer(name, tensor)
    return module


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writers(
    tensors: dict[str, torch.Tensor], directory: Path
) -> list[tuple[str, Callable[[], None], Path]]:
    """(label, save, what to delete before the save, untimed)."""
    path = directory / "bench.safetensors"
    fresh, kept = directory / "fresh", directory / "kept"
    module = _as_module(tensors)

    def st_fsync() -> None:
        st_save_file(tensors, path)
        _fsync(path)

    return [
        ("safetensors.save_file", lambda: st_save_file(tensors, path), path),
        ("safetensors.save_file+fsync", st_fsync, path),
        ("fastload.save_file", lambda: fastload.save_file(tensors, path), path),
        (
            "fastload.save_file threads=1",
            lambda: fastload.save_file(tensors, path, threads=1),
            path,
        ),
        (
            "fastload.save_pretrained new dir",
            lambda: fastload.save_pretrained(module, fresh),
            fresh,
        ),
        # Kept between rounds: each save replaces the checkpoint (and deletes its old data).
        ("fastload.save_pretrained replace", lambda: fastload.save_pretrained(module, kept), None),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state dict size (GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (plus one warm-up)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: $TMPDIR)")
    args = parser.parse_args()

    tensors = _tensors(args.size_gib)
    total = sum(t.nbytes for t in tensors.values())
    directory = Path(tempfile.mkdtemp(prefix="fastload-save-bench-", dir=args.dir))
    print(f"{len(tensors)} tensors, {total / 2**30:.2f} GiB, written to {directory}", flush=True)
    writers = _writers(tensors, directory)
    times: dict[str, list[float]] = {label: [] for label, _, _ in writers}
    try:
        for rnd in range(args.rounds + 1):
            for label, save, leftover in writers:
                if leftover is not None and leftover.is_dir():
                    shutil.rmtree(leftover)
                elif leftover is not None and leftover.exists():
                    leftover.unlink()
                os.sync()
                start = time.perf_counter()
                save()
                elapsed = time.perf_counter() - start
                if rnd:
                    times[label].append(elapsed)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for label, runs in times.items():
        rate = total / statistics.median(runs) / 1e9
        shown = ", ".join(f"{t:.3f}" for t in runs)
        print(f"{label:32s} median {rate:6.2f} GB/s   runs [{shown}] s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
