"""Side-by-side load benchmark: fastload against the peers and the floors, fresh process per run.

``python -m fastload.tools.bench.run`` (or ``fastload bench``) writes Llama-like checkpoints of the
chosen sizes into a work directory (safetensors via transformers' ``save_pretrained``, plus the same
weights as ``pytorch_model.bin`` for ``torch.load``), then for each mode, checkpoint dtype and
loader starts a fresh Python process ``--repeats`` times (round robin: every loader once, then
again) and records wall time and peak RSS above the process's RSS just before the load. Loaders
and floors are in :mod:`fastload.tools.bench.loaders`.

Modes: ``warm`` evicts each file and reads it once with ``read()`` before the series (the page
cache as a previous reader leaves it: the folio sizes, which decide how fast a mapping is
populated, are the same for every loader), then reads it again before every run; ``cold`` evicts
the files first (``fsync`` + ``posix_fadvise(DONTNEED)``). The floor of each mode is measured in
the same run: one copy of the bytes, a parallel read (from the page cache warm, the disk cold;
into fresh memory: a row of its own). Each row gets its ratio to its mode's floor and to
the fastest peer; fastload's default warm load (views of the mapping, no copy) also to the
zero-copy floor of mapping and touching the file. Results: ``--out/llama-<size>GiB.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from fastload.core.memory.page_cache import evict, warm
from fastload.tools.bench.loaders import (
    CONVERSIONS,
    FLOOR_OF_MODE,
    FLOORS,
    LOADERS,
    ZERO_COPY_FLOOR,
    child,
    files_read,
    is_peer,
)

GIB = 1 << 30


def compile_fastload() -> None:
    """Writes fastload's bytecode, as installing a wheel does: an editable install under
    ``PYTHONDONTWRITEBYTECODE`` would otherwise compile fastload's modules from source in every
    child, which the peers, installed with their bytecode, never do."""
    import compileall

    import fastload

    compileall.compile_dir(Path(fastload.__file__).parent, quiet=2)


# ---------------------------------------------------------------------------------------------
# Checkpoint generation
# ---------------------------------------------------------------------------------------------


def llama_config(size_bytes: int, itemsize: int) -> Any:
    """A Llama config whose weights take about ``size_bytes`` at ``itemsize`` bytes per value."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 2 * hidden * hidden + 2 * hidden * (hidden // 4) + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((size_bytes / itemsize - fixed) / per_layer))
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=vocab,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )


def make_checkpoint(directory: Path, size_gib: float, dtype: str) -> Path:
    """Writes the benchmark checkpoint (safetensors + .bin) unless it is already there."""
    import torch
    from transformers import LlamaForCausalLM

    out = directory / f"llama-{size_gib:g}GiB-{dtype}"
    if (out / "model.safetensors").exists() and (out / "pytorch_model.bin").exists():
        return out
    torch_dtype = getattr(torch, dtype)
    config = llama_config(int(size_gib * GIB), torch.tensor([], dtype=torch_dtype).element_size())
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Random values, generated in the target dtype tensor by tensor (no fp32 copy of the model).
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, p in model.state_dict().items():
        state[name] = (torch.randn(p.shape, generator=gen) * 0.02).to(torch_dtype)
    model.load_state_dict(state, assign=True)
    model.config.dtype = dtype
    # One shard, so every loader reads the same single file.
    model.save_pretrained(out, max_shard_size="100GB")
    torch.save(state, out / "pytorch_model.bin")
    return out


def data_bytes(checkpoint: Path) -> int:
    """Bytes of tensor data in the checkpoint's safetensors file."""
    from fastload.core.reads.reading import open_file

    f = open_file(checkpoint / "model.safetensors")
    return f.file_size - f.data_start


def run_child(loader: str, checkpoint: Path, timeout: float) -> dict[str, Any]:
    """Starts a fresh interpreter for one run and returns its measurements."""
    cmd = [sys.executable, "-m", "fastload.tools.bench.run", "--child", loader, str(checkpoint)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{loader} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    measured: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if measured.get("imported_in_clock"):
        print(
            f"[bench] warning: {loader} imported modules inside the clock (their import time is "
            f"in its figure): {', '.join(measured['imported_in_clock'])}",
            flush=True,
        )
    return measured


# ---------------------------------------------------------------------------------------------
# The whole benchmark
# ---------------------------------------------------------------------------------------------


def run(
    size_gib: float,
    dtypes: list[str],
    modes: list[str],
    loaders: list[str],
    repeats: int,
    out: Path,
    workdir: Path,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """Runs every loader ``repeats`` times per mode and checkpoint dtype; writes
    ``llama-<size>GiB.json`` and ``.png`` to ``out`` and returns the results."""
    out.mkdir(parents=True, exist_ok=True)
    compile_fastload()
    results: dict[str, Any] = {
        "command": "fastload bench " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "size_gib": size_gib,
        "repeats": repeats,
        "touch": "one read per 4 KiB page of every parameter, inside the timed region",
        "warm_cache": "each file evicted, then read once with read() before the warm runs",
        "floors": {m: FLOOR_OF_MODE[m] for m in modes},
        "results": {},
    }
    for dtype in dtypes:
        print(f"[bench] writing the {size_gib:g} GiB {dtype} checkpoint ...", flush=True)
        ckpt = make_checkpoint(workdir, size_gib, dtype)
        nbytes = data_bytes(ckpt)
        for mode in modes:
            chosen = [n for n in loaders if n not in CONVERSIONS or dtype == "bfloat16"]
            runs: dict[str, list[dict[str, Any]]] = {n: [] for n in chosen}
            if mode == "warm":
                # The same page cache for every run: how files are read decides the size of the
                # page-cache folios, and mapping 4 KiB ones costs ~10x more than 2 MiB ones (a
                # freshly written file, or one read with posix_fadvise, has small ones). Warm here
                # means as a plain read() leaves it (mostly 2 MiB folios on this kernel).
                for path in {p for n in chosen for p in files_read(n, ckpt)}:
                    evict(path)
                    warm(path)
            # Round robin (every loader once, then again): this VM's speed drifts by up to 2x over
            # minutes, and consecutive runs of one loader would carry the drift into its median.
            for _ in range(repeats):
                for loader in chosen:
                    # Before every run: the kernel may reclaim cold page cache in between
                    # (proactive reclaim is on in some VMs), and every loader should start equal.
                    for path in files_read(loader, ckpt):
                        (warm if mode == "warm" else evict)(path)
                    runs[loader].append(run_child(loader, ckpt, timeout))
            rows: dict[str, Any] = {}
            for loader in chosen:
                secs = statistics.median(r["seconds"] for r in runs[loader])
                rss = statistics.median(r["peak_rss_over_baseline"] for r in runs[loader])
                rows[loader] = {
                    "median_seconds": secs,
                    "gb_per_s": nbytes / secs / 1e9,
                    "median_peak_rss_over_baseline_mib": rss / (1 << 20),
                    "runs": runs[loader],
                    "what": LOADERS[loader],
                }
                print(
                    f"[bench] {mode} {dtype:9s} {loader:28s} {secs:7.3f} s "
                    f"{nbytes / secs / 1e9:6.2f} GB/s  peak RSS +{rss / (1 << 20):6.0f} MiB",
                    flush=True,
                )
            _summarize(rows, mode, nbytes)
            results["results"].setdefault(mode, {})[dtype] = {
                "path": str(ckpt),
                "data_bytes": nbytes,
                "data_mib": nbytes / (1 << 20),
                "loaders": rows,
            }
    stem = f"llama-{size_gib:g}GiB"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (out / f"{stem}.md").write_text(table(results))
    plot(results, out / f"{stem}.png")
    print(table(results))
    print(f"[bench] wrote {out / stem}.json, .md and .png")
    return results


def table(results: dict[str, Any]) -> str:
    """The results as a markdown table: per mode and dtype, seconds, x floor, x fastest peer and
    peak RSS above the bytes the loader produces."""
    lines = [
        f"{results['size_gib']:g} GiB, median of {results['repeats']}: seconds "
        "(x its mode's floor, x the fastest peer), peak RSS above the bytes produced (MiB)",
        "",
    ]
    columns = [(m, d) for m, by in results["results"].items() for d in by]
    lines.append("| loader | " + " | ".join(f"{m} {d}" for m, d in columns) + " |")
    lines.append("| --- |" + " --- |" * len(columns))
    names = list(dict.fromkeys(n for m, d in columns for n in results["results"][m][d]["loaders"]))
    for name in names:
        cells = []
        for m, d in columns:
            row = results["results"][m][d]["loaders"].get(name)
            if row is None:
                cells.append("")
                continue
            ratios = f"{row['x_floor']:.2f}x" if "x_floor" in row else ""
            if "x_conversion_floor" in row:
                ratios += f", {row['x_conversion_floor']:.2f}x fresh-memory floor"
            if "x_zero_copy_floor" in row:
                ratios += f", {row['x_zero_copy_floor']:.2f}x map+touch floor"
            if "x_fastest_peer" in row:
                ratios += f", {row['x_fastest_peer']:.2f}x"
            cells.append(
                f"{row['median_seconds']:.3f} ({ratios}) {row['peak_rss_minus_produced_mib']:+.0f}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _summarize(rows: dict[str, Any], mode: str, nbytes: int) -> None:
    """Adds to every row its time over the mode's floor, over the fastest peer's and (conversions)
    over transformers' conversion, and its peak RSS minus the bytes it produces; prints them."""
    floor = rows.get(FLOOR_OF_MODE[mode])
    peers = {k: v["median_seconds"] for k, v in rows.items() if is_peer(k)}
    fastest = min(peers, key=peers.__getitem__) if peers else None
    for name, row in rows.items():
        secs = row["median_seconds"]
        if floor:
            row["x_floor"] = secs / floor["median_seconds"]
        zero_copy = rows.get(ZERO_COPY_FLOOR)
        if mode == "warm" and name == "fastload" and zero_copy:
            row["x_zero_copy_floor"] = secs / zero_copy["median_seconds"]
        if fastest is not None and name not in FLOORS:
            row["x_fastest_peer"] = secs / peers[fastest]
            row["fastest_peer"] = fastest
        if name == "fastload" and "transformers" in rows:
            row["speedup_vs_transformers"] = rows["transformers"]["median_seconds"] / secs
        theirs = rows.get("transformers(bf16->f32)")
        if name == "fastload(bf16->f32)" and theirs:
            row["speedup_vs_transformers"] = theirs["median_seconds"] / secs
        fresh = rows.get("floor(fresh f32 memory)")
        if mode == "warm" and name in CONVERSIONS and name not in FLOORS and fresh:
            row["x_conversion_floor"] = secs / fresh["median_seconds"]
        produced = 2 * nbytes if name in CONVERSIONS else nbytes
        row["peak_rss_minus_produced_mib"] = row["median_peak_rss_over_baseline_mib"] - produced / (
            1 << 20
        )
    for name, row in rows.items():
        ratios = ", ".join(
            f"{k}={v:.2f}"
            for k, v in row.items()
            if k.startswith(("x_", "speedup", "peak_rss_minus"))
        )
        print(f"[bench] {mode} {name}: {ratios}")


def _color(name: str) -> str:
    if name in FLOORS:
        return "tab:gray"
    return "tab:orange" if name.startswith("fastload") else "tab:blue"


def plot(results: dict[str, Any], path: Path) -> None:
    """Bar charts: median time (with the ratio to the floor) and peak RSS per loader, one row per
    mode and checkpoint dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, d, data) for m, by in results["results"].items() for d, data in by.items()]
    fig, axes = plt.subplots(len(panels), 2, figsize=(14, 4.6 * len(panels)), squeeze=False)
    for row, (mode, dtype, data) in enumerate(panels):
        names = list(data["loaders"])
        rows = [data["loaders"][n] for n in names]
        secs = [r["median_seconds"] for r in rows]
        rss = [r["median_peak_rss_over_baseline_mib"] for r in rows]
        colors = [_color(n) for n in names]
        ax_t, ax_m = axes[row]
        ax_t.barh(names, secs, color=colors)
        ax_t.set_xlabel("median wall seconds, load + touch (lower is better)")
        ax_t.set_title(f"{mode} cache, {dtype} checkpoint, {data['data_mib']:.0f} MiB")
        for i, (s, r) in enumerate(zip(secs, rows, strict=True)):
            label = f" {s:.2f}s" + (f" ({r['x_floor']:.2f}x floor)" if "x_floor" in r else "")
            ax_t.text(s, i, label, va="center", fontsize=8)
        ax_m.barh(names, rss, color=colors)
        ax_m.axvline(data["data_mib"], color="k", ls="--", lw=1, label="checkpoint size")
        ax_m.set_xlabel("peak RSS above baseline, MiB (lower is better)")
        ax_m.set_title("peak memory")
        ax_m.legend(loc="lower right", fontsize=8)
        for ax in (ax_t, ax_m):
            ax.invert_yaxis()
    fig.suptitle(
        f"fastload bench, {results['size_gib']:g} GiB: {results['machine']['cpus']} CPUs, "
        f"median of {results['repeats']}, fresh process per run"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``python -m fastload.tools.bench.run``, ``fastload bench``);
    ``--low-ram CHECKPOINT_DIR ...`` runs the low-RAM mode (:mod:`fastload.tools.bench.lowram`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--low-ram"]:
        from fastload.tools.bench.lowram import main as low_ram

        return low_ram(argv[1:])
    p = argparse.ArgumentParser(prog="fastload bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", default="1", help="comma-separated checkpoint sizes in GiB (default 1; try 1,4)"
    )
    p.add_argument("--size-gib", type=float, default=None, help=argparse.SUPPRESS)  # old spelling
    p.add_argument(
        "--dtypes",
        default="bfloat16,float32",
        help="comma-separated checkpoint dtypes (default bfloat16,float32)",
    )
    p.add_argument("--modes", default="warm,cold", help="warm, cold or both (default warm,cold)")
    p.add_argument(
        "--loaders",
        default=",".join(LOADERS),
        help=f"comma-separated subset of: {', '.join(LOADERS)}",
    )
    p.add_argument("--repeats", type=int, default=3, help="fresh-process runs per loader")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where to write results")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where checkpoints are written and kept (default: a temporary directory)",
    )
    p.add_argument(
        "--low-ram",
        action="store_true",
        help="first argument: the low-RAM mode instead (load + first forward in a memory cgroup "
        "of 0.7x the model; see --low-ram --help)",
    )
    p.add_argument("--child", nargs=2, metavar=("LOADER", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.low_ram:
        p.error("--low-ram must come first: fastload bench --low-ram CHECKPOINT_DIR [--make] ...")
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return 0
    loaders = [s for s in args.loaders.split(",") if s]
    unknown = [s for s in loaders if s not in LOADERS]
    if unknown:
        p.error(f"unknown loader(s) {unknown}; choose from {list(LOADERS)}")
    modes = [s for s in args.modes.split(",") if s]
    if any(m not in FLOOR_OF_MODE for m in modes):
        p.error(f"--modes: choose from {list(FLOOR_OF_MODE)}")
    dtypes = [s for s in args.dtypes.split(",") if s]
    sizes = [args.size_gib] if args.size_gib else [float(s) for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="fastload-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for size in sizes:
            run(size, dtypes, modes, loaders, args.repeats, args.out, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
