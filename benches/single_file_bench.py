"""ComfyUI-style single files: the ``get_tensor`` loop with ``safetensors.safe_open`` against the
same loop with ``fastload.safe_open``, beside the read floors of the same bytes.

    python benches/single_file_bench.py [--gib 1] [--repeats 3] [--modes warm,cold] [--out DIR]

The file (made once under --workdir, reused while its size matches) is a Flux transformer single
file in diffusers' names: the tensors of a ``FluxTransformer2DModel`` (hidden 1024: 8 heads of
128, Flux's input widths: 64 channels, text 4096, pooled 768) with as many double and single
blocks as make ``--gib`` GiB of bf16, random values, saved whole by ``safetensors.torch.save_file``.

Every run is a fresh process (torch, safetensors and fastload's ``safe_open`` imported before the
clock). Methods, timed from ``safe_open`` to the last page touched:

* ``safetensors``: ``with safetensors.safe_open(path, "pt") as f: sd = {k: f.get_tensor(k) for k in
  f.keys()}`` (its tensors are views of a private mapping of the file);
* ``fastload``: the same loop with ``fastload.safe_open`` (each tensor read into its own memory);
* ``floor: parallel read``: 8 threads ``pread`` the file's data in 16 MiB blocks into reused
  buffers (``fastload.tools.bench.loaders.parallel_read``): the disk's floor cold, a copy out of
  the page cache warm;
* ``floor: read into new memory``: the same reads into one newly allocated tensor of the data's
  size: the floor of a loader that returns tensors in their own memory (the kernel faults the new
  pages in as they are written);
* ``floor: map+touch``: map the file and read one byte per 4 KiB page of its data: the floor of a
  loader that hands out views of the mapping, warm.

Every timed region ends with one read per 4 KiB page of every tensor (a view of the mapping pays
for its page faults there, as a first use would). ``warm``: the file is evicted and read once
before the series, then read again before each run; ``cold``: evicted before each run (``fsync``
+ ``posix_fadvise(DONTNEED)``, no root needed; the fraction still resident is recorded). Runs go
round robin (every mode and method once, then again, ``--repeats`` times); the table gives
medians, each over the parallel-read floor and over safetensors in the same mode. Writes
``single-file-<gib>GiB.json`` and ``.md`` to --out, with the machine's load average before and
after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_this_checkout  # noqa: E402

METHODS = [
    "floor: parallel read",
    "floor: read into new memory",
    "floor: map+touch",
    "safetensors",
    "fastload",
]
MODES = ["warm", "cold"]
FLOOR = "floor: parallel read"
GIB = 1 << 30


def flux_shapes(gib: float) -> dict[str, tuple[list[int], int]]:
    """Names and shapes of a Flux transformer with as many blocks as make ``gib`` GiB of bf16
    (names -> (shape, element count)); diffusers builds it on the meta device."""
    import diffusers
    import torch

    def build(layers: int) -> dict[str, tuple[list[int], int]]:
        with torch.device("meta"):
            model = diffusers.FluxTransformer2DModel(
                patch_size=1,
                in_channels=64,
                num_layers=layers,
                num_single_layers=2 * layers,
                attention_head_dim=128,
                num_attention_heads=8,
                joint_attention_dim=4096,
                pooled_projection_dim=768,
                axes_dims_rope=[16, 56, 56],
            )
        return {k: (list(t.shape), t.numel()) for k, t in model.state_dict().items()}

    one, two = build(1), build(2)
    base = sum(n for _, n in one.values())
    per = sum(n for _, n in two.values()) - base
    layers = max(1, round((gib * GIB / 2 - base) / per + 1))
    return build(layers)


def make_file(work: Path, gib: float) -> Path:
    """The single file, made once (reused while its tensors and size match)."""
    import torch
    from safetensors.torch import save_file

    path = work / f"flux-single-{gib:g}GiB.safetensors"
    if path.exists():
        return path
    work.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    state = {
        name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        for name, (shape, _) in flux_shapes(gib).items()
    }
    tmp = path.with_suffix(".tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    tmp.rename(path)
    return path


def run_one(method: str, path: Path) -> dict[str, Any]:
    """One run in this (fresh) process; what it uses imported before the clock."""
    import torch  # noqa: F401 - imported before the clock on purpose

    import fastload.core.reads.reading  # noqa: F401 - the floors' header parse
    import safetensors
    from fastload.safetensors.files import safe_open as fastload_safe_open
    from fastload.tools.bench.loaders import _map_and_touch, _touch, parallel_read

    opener = {"safetensors": safetensors.safe_open, "fastload": fastload_safe_open}.get(method)
    out: dict[str, Any] = {}
    before = set(sys.modules)
    t0 = time.perf_counter()
    if opener is not None:
        with opener(path, "pt") as f:
            sd = {k: f.get_tensor(k) for k in f.keys()}
        _touch(sd.values())
        out["tensors"] = len(sd)
    elif method == "floor: parallel read":
        parallel_read(path)
    elif method == "floor: read into new memory":
        _touch([read_into_new_memory(path)])
    elif method == "floor: map+touch":
        _touch(_map_and_touch(path))
    else:
        raise SystemExit(f"unknown method {method!r}")
    out["seconds"] = time.perf_counter() - t0
    out["imported_in_clock"] = sorted(set(sys.modules) - before)
    return out


def read_into_new_memory(path: Path, threads: int = 8, block: int = 16 << 20) -> Any:
    """``parallel_read``'s reads, into one new uint8 tensor of the file's data size."""
    import torch

    from fastload.core.reads.reading import open_file
    from fastload.tools.bench.loaders import parallel_read

    opened = open_file(path)
    out = torch.empty(opened.file_size - opened.data_start, dtype=torch.uint8)
    parallel_read(path, threads, block, into=memoryview(out.numpy()))
    return out


def run_child(method: str, path: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--run", method, "--file", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode:
        raise SystemExit(f"{method} on {path}: exit {done.returncode}\n{done.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if row["imported_in_clock"]:
        print(f"[single-file-bench] warning: {method} imported {row['imported_in_clock']}")
    return row


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """mode -> method -> median, min, max seconds, x floor (median / the parallel-read floor's),
    x safetensors (safetensors' median / this median: above 1, faster than safetensors)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        times: dict[str, list[float]] = {}
        for r in runs:
            if r["mode"] == mode:
                times.setdefault(r["method"], []).append(r["seconds"])
        med = {m: statistics.median(t) for m, t in times.items()}
        out[mode] = {
            m: {
                "median_seconds": med[m],
                "min_seconds": min(t),
                "max_seconds": max(t),
                "x floor": med[m] / med[FLOOR] if FLOOR in med else float("nan"),
                "x safetensors": (
                    med["safetensors"] / med[m] if "safetensors" in med else float("nan")
                ),
            }
            for m, t in times.items()
        }
    return out


def table(results: dict[str, Any]) -> str:
    gib = results["bytes"] / GIB
    lines = [
        f"Single file: {results['tensors']} tensors, {gib:.2f} GiB of bf16 data; "
        f"{results['repeats']} runs per cell, fresh processes, round robin. Time: median "
        "(min-max), seconds, from `safe_open` to the last page touched. `x floor`: median / the "
        "parallel-read floor's median in the same mode (1.00: at the floor). `x safetensors`: "
        "safetensors' median / this median (above 1: faster than safetensors).",
        "",
        "| cache | method | time s | GiB/s | x floor | x safetensors |",
        "|---|---|---|---|---|---|",
    ]
    for mode, cells in results["summary"].items():
        for method in [m for m in METHODS if m in cells]:
            c = cells[method]
            lines.append(
                f"| {mode} | {method} | {c['median_seconds']:.3f} "
                f"({c['min_seconds']:.3f}-{c['max_seconds']:.3f}) | "
                f"{gib / c['median_seconds']:.2f} | {c['x floor']:.2f} | "
                f"{c['x safetensors']:.2f} |"
            )
    load = results["machine"]
    lines += [
        "",
        f"Machine: {load['cpus']} CPUs, {load['platform']}, Python {load['python']}, torch "
        f"{load['torch']}, safetensors {load['safetensors']}; load average (1, 5, 15 min) "
        f"before {load['load_before']}, after {load['load_after']}. Cold runs: largest resident "
        f"fraction after eviction {results['max_resident_after_evict']:.3f}.",
        "",
        f"Command: `{results['command']}`",
    ]
    return "\n".join(lines) + "\n"


def run(
    gib: float, modes: list[str], methods: list[str], repeats: int, work: Path, out: Path | None
) -> dict[str, Any]:
    """Every method ``repeats`` times per mode, round robin; writes the results to ``out``."""
    import torch

    import safetensors
    from fastload.core.memory.page_cache import evict, resident_fraction, warm
    from fastload.core.reads.reading import open_file
    from fastload.tools.bench.run import compile_fastload

    compile_fastload()
    path = make_file(work, gib)
    opened = open_file(path)
    results: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "safetensors": safetensors.__version__,
            "load_before": [round(x, 2) for x in os.getloadavg()],
        },
        "file": str(path),
        "bytes": opened.file_size - opened.data_start,
        "tensors": len(opened.keys()),
        "repeats": repeats,
        "runs": [],
        "max_resident_after_evict": 0.0,
    }
    if "warm" in modes:
        evict(path)
        warm(path)
    for rep in range(repeats):
        for mode in modes:
            for method in methods:
                if mode == "warm":
                    warm(path)
                else:
                    evict(path)
                    left = resident_fraction(path)
                    results["max_resident_after_evict"] = max(
                        results["max_resident_after_evict"], left
                    )
                row = run_child(method, path, 600.0)
                row |= {"mode": mode, "method": method, "repeat": rep}
                results["runs"].append(row)
                print(f"[single-file-bench] {rep} {mode} {method:22} {row['seconds']:.3f} s")
    results["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    results["summary"] = summarize(results["runs"])
    results["table"] = table(results)
    print(results["table"])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"single-file-{gib:g}GiB"
        stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        stem.with_suffix(".md").write_text(
            f"# ComfyUI-style single file, {gib:g} GiB\n\n{results['table']}"
        )
    return results


def main() -> None:
    use_this_checkout()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="warm,cold")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fastload-single-file-bench"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, args.file)))
        return
    run(
        args.gib,
        [m for m in args.modes.split(",") if m],
        [m for m in args.methods.split(",") if m],
        args.repeats,
        args.workdir,
        args.out,
    )


if __name__ == "__main__":
    main()
