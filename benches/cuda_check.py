"""CUDA load check, for a machine with an NVIDIA GPU: fastload's staged pipeline against a pinned
``tensor.copy_`` of the same bytes and against ``safetensors.torch.load_file(device="cuda")``.

Run: ``python benches/cuda_check.py [--size-gib 4]``. Prints GB/s (median of 3) for each and checks
that fastload's tensors equal safetensors' bitwise. Exits 0 with a note when no GPU is present.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

import fastload


def _timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out
        torch.cuda.empty_cache()
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=4.0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    n = int(args.size_gib * (1 << 30)) // 2 // (4096 * 4096)
    gen = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(4096, 4096, generator=gen).bfloat16() for i in range(n)}
    nbytes = sum(t.numel() * 2 for t in tensors.values())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cuda.safetensors"
        save_file(tensors, str(path))
        with open(path, "rb") as f:  # warm the page cache
            while f.read(1 << 26):
                pass
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        results = {
            "pinned tensor.copy_ (H2D floor)": _timed(lambda: pinned.to("cuda", non_blocking=True)),
            "safetensors load_file(device=cuda)": _timed(
                lambda: st_load_file(str(path), device="cuda")
            ),
            "fastload load_file(device=cuda)": _timed(
                lambda: fastload.load_file(path, device="cuda")
            ),
        }
        got = fastload.load_file(path, device="cuda")
        want = st_load_file(str(path), device="cuda")
        same = all(torch.equal(got[k], want[k]) for k in want)
    print(f"{torch.cuda.get_device_name()} | {nbytes / 1e9:.2f} GB of bf16 | median of 3")
    for name, secs in results.items():
        print(f"  {name:38s} {secs:7.3f} s  {nbytes / secs / 1e9:6.2f} GB/s")
    print(f"  fastload equals safetensors bitwise: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
