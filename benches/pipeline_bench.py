"""A diffusers pipeline of about 2 GiB, loaded by diffusers and by diffusers under
``fastload.patch_diffusers()``, beside the read floors of the same bytes.

    python benches/pipeline_bench.py [--gib 2] [--repeats 3] [--modes warm,convert,cold] [--out DIR]

The pipeline (made once under --workdir, reused while its size matches) is a scaled-down
FLUX.1: a ``FluxTransformer2DModel`` (hidden 1024: 8 heads of 128; Flux's input widths) with as
many blocks as make about 80% of ``--gib`` GiB, saved sharded (``max_shard_size="500MB"``); an
``AutoencoderKL`` with SD's channel widths; a ``CLIPTextModel`` (hidden 768, 4 layers) and a
``T5EncoderModel`` (d_model 1024, 6 layers); a ``FlowMatchEulerDiscreteScheduler``. Every weight is
random, stored in bfloat16; the tokenizers are left out (``None`` in ``model_index.json``: there
is no hub here to fetch their vocabularies from, and they hold no weights).

Every run is a fresh process (torch, diffusers, transformers and fastload imported before the
clock), timed from ``from_pretrained`` to the last page of every weight touched (one read per
4 KiB page: a view of the file pays for its page faults there, as a first denoising step would).
Its peak RSS above the RSS before the clock (``VmHWM``, from the OS) is recorded beside it.
Methods:

* ``diffusers``: ``DiffusionPipeline.from_pretrained(folder, torch_dtype=...)``;
* ``fastload``: the same call under ``fastload.patch_diffusers()``;
* ``floor: parallel read``: 8 threads ``pread`` every weight file's data in 16 MiB blocks into
  reused buffers: the disk's floor cold, a copy out of the page cache warm;
* ``floor: read into new memory``: the same reads into newly allocated tensors of the size the
  load makes (the floor of a load into memory of its own; the kernel faults the pages in as
  written): the data's size, and in ``convert`` mode twice it (bfloat16 to float32), each block
  read into the first half of its new range and copied into the second (every page of the loaded
  size written once, every stored byte read once; no arithmetic).

Modes: ``warm`` (stored dtype, bfloat16; files read once before each run), ``convert`` (warm,
``torch_dtype=torch.float32``: every weight converted), ``cold`` (stored dtype, files evicted
before each run: ``fsync`` + ``posix_fadvise(DONTNEED)``, the fraction still resident recorded).
Runs go round robin; the table gives medians over the parallel-read floor and the new-memory
floor of the same mode, and diffusers' median over each. Writes ``pipeline-<gib>GiB.json`` and
``.md`` to --out, with the machine's load average before and after.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_this_checkout  # noqa: E402

READ = "floor: parallel read"
NEW = "floor: read into new memory"
METHODS = [READ, NEW, "diffusers", "fastload"]
MODES = ["warm", "convert", "cold"]
GIB = 1 << 30


def _flux(layers: int) -> Any:
    import diffusers

    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=layers,
        num_single_layers=2 * layers,
        attention_head_dim=128,
        num_attention_heads=8,
        joint_attention_dim=1024,
        pooled_projection_dim=768,
        axes_dims_rope=[16, 56, 56],
    )


def _layers(gib: float) -> int:
    """Flux blocks for about 80% of ``gib`` GiB of bf16 (the rest: VAE and text encoders)."""
    import torch

    def count(layers: int) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in _flux(layers).parameters())

    base, per = count(1), count(2) - count(1)
    return max(1, round((0.8 * gib * GIB / 2 - base) / per + 1))


def make_pipeline(work: Path, gib: float) -> Path:
    """The pipeline's folder, made once (reused while it is complete)."""
    import diffusers
    import torch
    import transformers

    folder = work / f"flux-{gib:g}GiB"
    if (folder / "model_index.json").exists():
        return folder
    torch.manual_seed(0)
    transformer = _flux(_layers(gib))
    vae = diffusers.AutoencoderKL(
        block_out_channels=[128, 256, 512, 512],
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=16,
        layers_per_block=2,
    )
    clip = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=4)
    )
    t5 = transformers.T5EncoderModel(
        transformers.T5Config(d_model=1024, d_ff=2816, num_layers=6, num_heads=16, d_kv=64)
    )
    models = [transformer, vae, clip, t5]
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p.normal_(0, 0.02)
            model.to(torch.bfloat16)
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=None,
        text_encoder_2=t5,
        tokenizer_2=None,
        transformer=transformer,
    )
    tmp = folder.with_suffix(".tmp")
    pipe.save_pretrained(tmp, max_shard_size="500MB")
    tmp.rename(folder)
    return folder


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.safetensors"))


def _ranges(files: list[Path]) -> list[tuple[Path, int, int]]:
    from fastload.core.reads.reading import open_file

    out = []
    for path in files:
        opened = open_file(path)
        out.append((path, opened.data_start, opened.file_size))
    return out


def read_floor(
    ranges: list[tuple[Path, int, int]],
    new_memory: bool,
    threads: int = 8,
    block: int = 16 << 20,
    grow: int = 1,
) -> Any:
    """Every file's data section read by ``threads`` positioned reads of ``block`` bytes, one
    pool over all the files: into reused buffers, or into new tensors of ``grow`` times the
    data's size (each block read into the first part of its range, then copied over the rest)."""
    import torch

    jobs = []
    targets = []
    files = [path for path, _, _ in ranges]
    for path, start, size in ranges:
        into = torch.empty((size - start) * grow, dtype=torch.uint8) if new_memory else None
        targets.append(into)
        jobs += [
            (path, off, min(block, size - off), start, into) for off in range(start, size, block)
        ]
    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    buffers = [bytearray(block) for _ in range(threads)]
    try:

        def worker(i: int) -> int:
            done = 0
            for path, off, n, start, into in jobs[i::threads]:
                if into is None:
                    done += os.preadv(fds[path], [memoryview(buffers[i])[:n]], off)
                    continue
                at = (off - start) * grow
                done += os.preadv(fds[path], [memoryview(into[at : at + n].numpy())], off)
                for k in range(1, grow):  # torch's copy runs without the GIL
                    into[at + k * n : at + (k + 1) * n].copy_(into[at : at + n])
            return done

        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(worker, range(threads)))
    finally:
        for fd in fds.values():
            os.close(fd)
    if total != sum(size - start for _, start, size in ranges):
        raise RuntimeError("short read")
    return [t for t in targets if t is not None]


def _status(field: str) -> int:
    """A size from /proc/self/status, in bytes (``VmHWM``: the peak RSS of this process image;
    ``ru_maxrss`` is not used, as it keeps the parent's peak across ``fork`` and ``exec``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_one(method: str, mode: str, folder: Path) -> dict[str, Any]:
    """One run in this (fresh) process; what it uses imported before the clock."""
    import diffusers
    import torch
    import transformers  # noqa: F401 - imported before the clock on purpose
    from diffusers import (  # noqa: F401 - the pipeline's classes, imported before the clock
        AutoencoderKL,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextModel, T5EncoderModel  # noqa: F401

    import fastload
    import fastload.core.loading  # noqa: F401 - the loader, imported before the clock
    import fastload.diffusion.front  # noqa: F401
    import fastload.diffusion.patch  # noqa: F401
    import fastload.hf.front  # noqa: F401
    import fastload.hf.patch  # noqa: F401
    from fastload.tools.bench.loaders import _touch

    dtype = torch.float32 if mode == "convert" else torch.bfloat16
    files = weight_files(folder)
    ranges = _ranges(files)  # the floors' header parse, before the clock
    # the tokenizers are None in model_index.json: passed as None (no vocabularies here)
    kwargs = {"dtype": dtype, "tokenizer": None, "tokenizer_2": None}
    out: dict[str, Any] = {}
    rss0 = _status("VmRSS")
    before = set(sys.modules)
    t0 = time.perf_counter()
    if method in (READ, NEW):
        grow = 2 if mode == "convert" and method == NEW else 1  # bfloat16 -> float32
        _touch(read_floor(ranges, new_memory=method == NEW, grow=grow))
    else:
        if method == "fastload":
            with fastload.patch_diffusers():
                pipe = diffusers.DiffusionPipeline.from_pretrained(folder, **kwargs)
        else:
            pipe = diffusers.DiffusionPipeline.from_pretrained(folder, **kwargs)
        tensors = [
            t
            for c in pipe.components.values()
            if isinstance(c, torch.nn.Module)
            for t in c.state_dict().values()
        ]
        _touch(tensors)
        out["dtypes"] = sorted({str(t.dtype) for t in tensors})
        out["tensors"] = len(tensors)
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_above_start"] = _status("VmHWM") - rss0
    out["imported_in_clock"] = sorted(
        m for m in set(sys.modules) - before if not m.startswith(("diffusers.", "transformers."))
    )
    return out


def run_child(method: str, mode: str, folder: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--run", method, "--mode", mode, "--folder", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode:
        raise SystemExit(f"{method} ({mode}): exit {done.returncode}\n{done.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if row["imported_in_clock"]:
        print(
            f"[pipeline-bench] note: {method} imported {row['imported_in_clock'][:8]} in the clock"
        )
    return row


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """mode -> method -> median/min/max seconds, median peak RSS, x read floor, x new-memory
    floor, x diffusers (diffusers' median / this median: above 1, faster than diffusers)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rows = [r for r in runs if r["mode"] == mode]
        times: dict[str, list[float]] = {}
        rss: dict[str, list[int]] = {}
        for r in rows:
            times.setdefault(r["method"], []).append(r["seconds"])
            rss.setdefault(r["method"], []).append(r["peak_rss_above_start"])
        med = {m: statistics.median(t) for m, t in times.items()}
        nan = float("nan")
        out[mode] = {
            m: {
                "median_seconds": med[m],
                "min_seconds": min(t),
                "max_seconds": max(t),
                "median_peak_rss": statistics.median(rss[m]),
                "x read floor": med[m] / med[READ] if READ in med else nan,
                "x new-memory floor": med[m] / med[NEW] if NEW in med else nan,
                "x diffusers": med["diffusers"] / med[m] if "diffusers" in med else nan,
            }
            for m, t in times.items()
        }
    return out


def table(results: dict[str, Any]) -> str:
    gib = results["bytes"] / GIB
    lines = [
        f"Pipeline: {results['files']} weight files, {gib:.2f} GiB of bf16 weights "
        f"({results['components']}); {results['repeats']} runs per cell, fresh processes, round "
        "robin. Time: median (min-max) seconds from `from_pretrained` to the last page of every "
        "weight touched. Peak RSS: median of the runs' peak above the RSS before the clock "
        "(`VmHWM` - `VmRSS`). `x read` / `x new mem`: median over the parallel-read / new-memory "
        "floor's median in the same mode. `x diffusers`: diffusers' median / this one (above 1: "
        "faster than diffusers).",
        "",
        "| mode | method | time s | peak RSS GiB | x read | x new mem | x diffusers |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, cells in results["summary"].items():
        for method in [m for m in METHODS if m in cells]:
            c = cells[method]
            lines.append(
                f"| {mode} | {method} | {c['median_seconds']:.3f} "
                f"({c['min_seconds']:.3f}-{c['max_seconds']:.3f}) | "
                f"{c['median_peak_rss'] / GIB:.2f} | {c['x read floor']:.2f} | "
                f"{c['x new-memory floor']:.2f} | {c['x diffusers']:.2f} |"
            )
    m = results["machine"]
    lines += [
        "",
        f"Machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, torch {m['torch']}, "
        f"diffusers {m['diffusers']}, transformers {m['transformers']}; load average (1, 5, 15 "
        f"min) before {m['load_before']}, after {m['load_after']}. Cold runs: largest resident "
        f"fraction after eviction {results['max_resident_after_evict']:.3f}.",
        "",
        f"Command: `{results['command']}`",
    ]
    return "\n".join(lines) + "\n"


def run(
    gib: float, modes: list[str], methods: list[str], repeats: int, work: Path, out: Path | None
) -> dict[str, Any]:
    """Every method ``repeats`` times per mode, round robin; writes the results to ``out``."""
    import diffusers
    import torch
    import transformers

    from fastload.core.memory.page_cache import evict, resident_fraction, warm
    from fastload.tools.bench.run import compile_fastload

    compile_fastload()
    folder = make_pipeline(work, gib)
    files = weight_files(folder)
    results: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "load_before": [round(x, 2) for x in os.getloadavg()],
        },
        "folder": str(folder),
        "files": len(files),
        "components": ", ".join(sorted({p.parent.name for p in files})),
        "bytes": sum(size - start for _, start, size in _ranges(files)),
        "repeats": repeats,
        "runs": [],
        "max_resident_after_evict": 0.0,
    }
    for rep in range(repeats):
        for mode in modes:
            for method in methods:
                for path in files:
                    if mode == "cold":
                        evict(path)
                        left = resident_fraction(path)
                        results["max_resident_after_evict"] = max(
                            results["max_resident_after_evict"], left
                        )
                    else:
                        warm(path)
                row = run_child(method, mode, folder, 900.0)
                row |= {"mode": mode, "method": method, "repeat": rep}
                results["runs"].append(row)
                print(
                    f"[pipeline-bench] {rep} {mode:7} {method:28} {row['seconds']:.3f} s, "
                    f"peak {row['peak_rss_above_start'] / GIB:.2f} GiB",
                    flush=True,
                )
    results["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    results["summary"] = summarize(results["runs"])
    results["table"] = table(results)
    print(results["table"])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"pipeline-{gib:g}GiB"
        stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        stem.with_suffix(".md").write_text(
            f"# A diffusers pipeline, {gib:g} GiB\n\n{results['table']}"
        )
    return results


def main() -> None:
    use_this_checkout()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fastload-pipeline-bench"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, args.mode, args.folder)))
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
