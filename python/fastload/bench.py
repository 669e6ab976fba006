"""Side-by-side load benchmark: fastload against the peers, one fresh process per run.

``python -m fastload.bench`` (or ``fastload bench``) writes a Llama-like checkpoint of the chosen
size into a temporary directory (safetensors via transformers' ``save_pretrained``, plus the same
weights as ``pytorch_model.bin`` for ``torch.load``), warms the page cache, then for each loader
starts a fresh Python process ``--repeats`` times and records wall time, GB/s and peak RSS above
the process's RSS just before the load (peak RSS, ``VmHWM``, after minus RSS before).

Every loader's timed region ends with a *touch*: one read per 4 KiB page of every parameter, so a
loader that returns lazily mapped tensors pays for the page faults it deferred, as its first
forward pass would. Results go to ``results.json`` and ``results.png`` in ``--out``.
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
import time
from pathlib import Path
from typing import Any

LOADERS: dict[str, str] = {
    "memcpy_floor": "copy of the checkpoint's bytes from a mapped file into fresh memory",
    "safetensors+load_state_dict": "model built normally, safetensors load_file, load_state_dict",
    "safetensors+meta+assign": "meta skeleton, safetensors load_file, load_state_dict(assign=True)",
    "transformers": "transformers AutoModelForCausalLM.from_pretrained (its default path)",
    "torch.load(mmap)+assign": "meta skeleton, torch.load(.bin, mmap=True, weights_only=True), "
    "load_state_dict(assign=True)",
    "fastload": "fastload.from_pretrained, stored dtype",
    "fastload(bf16->f32)": "fastload.from_pretrained(dtype=torch.float32) of the bf16 checkpoint",
    "fastload(mmap=shared)": "fastload.from_pretrained(mmap='shared'): copy-on-write views of the "
    "file, no copy",
}

GIB = 1 << 30


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
    from fastload.reader import open_file

    f = open_file(checkpoint / "model.safetensors")
    return f.file_size - f.data_start


def warm(path: Path) -> None:
    """Reads a file once so every loader starts from a warm page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


# ---------------------------------------------------------------------------------------------
# One run, in a fresh child process
# ---------------------------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def _peak_rss_bytes() -> int:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork+exec from the parent (the runner,
    # which wrote the checkpoint), while VmHWM belongs to this process's address space alone.
    return _status_bytes("VmHWM")


def _touch(tensors: Any) -> float:
    """One read per 4 KiB page of each tensor: faults in whatever a loader mapped lazily."""
    total = 0.0
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.numel():
            total += float(flat[:: max(1, 4096 // flat.element_size())].float().sum())
    return total


def _skeleton(checkpoint: Path) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def child(loader: str, checkpoint: Path) -> dict[str, float]:
    """Runs one load; imports happen before the RSS baseline so only the load is measured."""
    import torch  # noqa: F401 - imported before the baseline on purpose
    import transformers  # noqa: F401
    from safetensors.torch import load_file  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401 - the model code every loader needs

    import fastload
    import fastload.loading  # noqa: F401 - as the peers' code, imported before the baseline

    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    st_path = checkpoint / "model.safetensors"
    if loader == "memcpy_floor":
        import torch

        nbytes = st_path.stat().st_size
        storage = torch.UntypedStorage.from_file(str(st_path), False, nbytes)
        src = torch.empty(0, dtype=torch.uint8).set_(storage)
        out = torch.empty(nbytes, dtype=torch.uint8)
        out.copy_(src)
        tensors = [out]
    elif loader == "safetensors+load_state_dict":
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
        model.load_state_dict(load_file(st_path), strict=False)
        tensors = list(model.parameters())
    elif loader == "safetensors+meta+assign":
        from safetensors.torch import load_file

        model = _skeleton(checkpoint)
        model.load_state_dict(load_file(st_path), strict=False, assign=True)
        tensors = list(model.parameters())
    elif loader == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        tensors = list(model.parameters())
    elif loader == "torch.load(mmap)+assign":
        import torch

        model = _skeleton(checkpoint)
        state = torch.load(checkpoint / "pytorch_model.bin", mmap=True, weights_only=True)
        model.load_state_dict(state, strict=False, assign=True)
        tensors = list(model.parameters())
    elif loader == "fastload":
        model = fastload.from_pretrained(None, checkpoint, progress=False)
        tensors = list(model.parameters())
    elif loader == "fastload(bf16->f32)":
        import torch

        model = fastload.from_pretrained(None, checkpoint, dtype=torch.float32, progress=False)
        tensors = list(model.parameters())
    elif loader == "fastload(mmap=shared)":
        model = fastload.from_pretrained(None, checkpoint, mmap="shared", progress=False)
        tensors = list(model.parameters())
    else:
        raise SystemExit(f"unknown loader {loader!r}")
    _touch(tensors)
    seconds = time.perf_counter() - t0
    peak = _peak_rss_bytes()
    return {"seconds": seconds, "peak_rss_over_baseline": max(0, peak - rss0)}


def run_child(loader: str, checkpoint: Path, timeout: float) -> dict[str, float]:
    """Starts a fresh interpreter for one run and returns its measurements."""
    cmd = [sys.executable, "-m", "fastload.bench", "--child", loader, str(checkpoint)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{loader} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# The whole benchmark
# ---------------------------------------------------------------------------------------------


def run(
    size_gib: float,
    dtypes: list[str],
    loaders: list[str],
    repeats: int,
    out: Path,
    workdir: Path,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Runs every loader ``repeats`` times per checkpoint dtype; writes JSON and PNG to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "size_gib": size_gib,
        "repeats": repeats,
        "touch": "one read per 4 KiB page of every parameter, inside the timed region",
        "checkpoints": {},
    }
    for dtype in dtypes:
        print(f"[bench] writing the {size_gib:g} GiB {dtype} checkpoint ...", flush=True)
        ckpt = make_checkpoint(workdir, size_gib, dtype)
        nbytes = data_bytes(ckpt)
        rows: dict[str, Any] = {}
        for loader in loaders:
            if loader == "fastload(bf16->f32)" and dtype != "bfloat16":
                continue
            runs = []
            for _ in range(repeats):
                # Re-warm before every run: the kernel may reclaim cold page cache in between
                # (proactive reclaim is on in some VMs), and every loader should start equal.
                warm(
                    ckpt / ("pytorch_model.bin" if "torch.load" in loader else "model.safetensors")
                )
                runs.append(run_child(loader, ckpt, timeout))
            secs = statistics.median(r["seconds"] for r in runs)
            rss = statistics.median(r["peak_rss_over_baseline"] for r in runs)
            rows[loader] = {
                "median_seconds": secs,
                "gb_per_s": nbytes / secs / 1e9,
                "median_peak_rss_over_baseline_mib": rss / (1 << 20),
                "runs": runs,
                "what": LOADERS[loader],
            }
            print(
                f"[bench] {dtype:9s} {loader:30s} {secs:7.3f} s  {nbytes / secs / 1e9:6.2f} GB/s"
                f"  peak RSS +{rss / (1 << 20):7.0f} MiB",
                flush=True,
            )
        _summarize(rows, nbytes)
        results["checkpoints"][dtype] = {
            "path": str(ckpt),
            "data_bytes": nbytes,
            "data_mib": nbytes / (1 << 20),
            "loaders": rows,
        }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "results.png")
    print(f"[bench] wrote {out / 'results.json'} and {out / 'results.png'}")
    return results


def _summarize(rows: dict[str, Any], nbytes: int) -> None:
    """Adds the ratios the targets are stated in to each fastload row, and prints them."""
    floor = rows.get("memcpy_floor")
    peers = [
        v["median_seconds"]
        for k, v in rows.items()
        if not k.startswith("fastload") and k != "memcpy_floor"
    ]
    for name, row in rows.items():
        if not name.startswith("fastload"):
            continue
        if floor:
            row["x_memcpy_floor"] = row["median_seconds"] / floor["median_seconds"]
        if peers:
            row["speedup_vs_fastest_peer"] = min(peers) / row["median_seconds"]
        row["peak_rss_minus_checkpoint_mib"] = row["median_peak_rss_over_baseline_mib"] - nbytes / (
            1 << 20
        )
        ratios = ", ".join(
            f"{k}={v:.2f}"
            for k, v in row.items()
            if k.startswith(("x_", "speedup", "peak_rss_minus"))
        )
        print(f"[bench] {name}: {ratios}")


def plot(results: dict[str, Any], path: Path) -> None:
    """Bar chart: median time and peak RSS per loader, one row per checkpoint dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ckpts = results["checkpoints"]
    fig, axes = plt.subplots(len(ckpts), 2, figsize=(13, 4.2 * len(ckpts)), squeeze=False)
    for row, (dtype, data) in enumerate(ckpts.items()):
        names = list(data["loaders"])
        secs = [data["loaders"][n]["median_seconds"] for n in names]
        rss = [data["loaders"][n]["median_peak_rss_over_baseline_mib"] for n in names]
        colors = [
            "tab:orange"
            if n.startswith("fastload")
            else "tab:gray"
            if n == "memcpy_floor"
            else "tab:blue"
            for n in names
        ]
        ax_t, ax_m = axes[row]
        ax_t.barh(names, secs, color=colors)
        ax_t.set_xlabel("median wall seconds (lower is better)")
        ax_t.set_title(f"{dtype} checkpoint, {data['data_mib']:.0f} MiB: load time")
        for i, s in enumerate(secs):
            ax_t.text(s, i, f" {s:.2f}s", va="center", fontsize=8)
        ax_m.barh(names, rss, color=colors)
        ax_m.axvline(data["data_mib"], color="k", ls="--", lw=1, label="checkpoint size")
        ax_m.set_xlabel("peak RSS above baseline, MiB (lower is better)")
        ax_m.set_title("peak memory")
        ax_m.legend(loc="lower right", fontsize=8)
        for ax in (ax_t, ax_m):
            ax.invert_yaxis()
    fig.suptitle(
        f"fastload bench: {results['machine']['cpus']} CPUs, median of {results['repeats']}, "
        "warm page cache, fresh process per run"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``python -m fastload.bench``, ``fastload bench``)."""
    p = argparse.ArgumentParser(prog="fastload bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size (default 1; try 4)")
    p.add_argument(
        "--dtypes",
        default="bfloat16,float32",
        help="comma-separated checkpoint dtypes (default bfloat16,float32)",
    )
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
        help="where checkpoints are written (default: a temporary directory)",
    )
    p.add_argument("--child", nargs=2, metavar=("LOADER", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return 0
    loaders = [s for s in args.loaders.split(",") if s]
    unknown = [s for s in loaders if s not in LOADERS]
    if unknown:
        p.error(f"unknown loader(s) {unknown}; choose from {list(LOADERS)}")
    dtypes = [s for s in args.dtypes.split(",") if s]
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        run(args.size_gib, dtypes, loaders, args.repeats, args.out, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="fastload-bench-") as tmp:
            run(args.size_gib, dtypes, loaders, args.repeats, args.out, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
