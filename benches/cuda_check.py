"""The GPU check: every CUDA test, then loads to ``cuda:0`` against the peers, in one run.

Prepared on a CPU machine and run on a GPU machine that has no package registry (the peers travel
as wheels, see ``scripts/cuda-wheels.sh``). One command does everything and writes one JSON file::

    python benches/cuda_check.py --out cuda_results.json            # 1 and 8 GiB, < 8 minutes
    python benches/cuda_check.py --plot cuda_results.json    # the PNG and .md page, anywhere

Steps:

1. ``pytest -m cuda``: every test that needs a GPU (``tests/conftest.py`` marks them), counts and
   failures recorded.
2. For each size, a Llama-like bf16 checkpoint (``config.json`` + one ``model.safetensors``) is
   written, then each loader runs in a fresh child process (``--child``): warm (file in the page
   cache) and cold (evicted with ``posix_fadvise(DONTNEED)`` before each repeat). Each timed region
   ends with ``torch.cuda.synchronize()``; each run's tensors are checked against checksums of the
   file; peak host RSS above the pre-load RSS and peak GPU memory are recorded.
3. Floors measured in the same run: the pinned host-to-device copy of the same number of bytes
   (the bound for warm loads) and a parallel ``pread`` of the evicted file (the disk's bound).

A loader whose package is missing, or that fails, is recorded with its error; a time budget
(``--budget-s``) skips what would not fit rather than running past the machine's limit.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastload.core.memory.page_cache import evict, warm

GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent

LOADERS: dict[str, str] = {
    "floor:pinned_h2d": "a pinned host buffer of the same size copied to the GPU (no file)",
    "floor:disk_read": "parallel 64 MiB preads of the file into host memory (cold runs only)",
    "fastload.load_file": "fastload.load_file(path, device='cuda:0')",
    "fastload.from_pretrained": "fastload.from_pretrained(LlamaForCausalLM, dir, device='cuda:0')",
    "safetensors.safe_open": "safetensors.safe_open(path, 'pt', device='cuda:0'), every get_tensor",
    "transformers": "AutoModelForCausalLM.from_pretrained(dir, device_map='cuda:0')",
    "fastsafetensors": "fastsafetensors.fastsafe_open([path], nogds=True, device='cuda:0')",
    "runai-model-streamer": "SafetensorsStreamer().stream_file(path, device='cuda:0')",
    "instanttensor": "instanttensor.safe_open(path, 'pt', device=0).tensors()",
}


# ---------------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------------


def llama_config(size_bytes: int) -> Any:
    """A Llama config whose bf16 weights take about ``size_bytes``."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 4096, 11008, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((size_bytes / 2 - fixed) / per_layer))
    if size_bytes < GIB // 2:  # small sizes (tests): a narrower model
        hidden, inter, vocab = 256, 688, 1000
        per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
        layers = max(1, round((size_bytes / 2 - 2 * vocab * hidden) / per_layer))
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128 if hidden >= 128 else 1,
        num_key_value_heads=hidden // 128 if hidden >= 128 else 1,
        vocab_size=vocab,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        dtype="bfloat16",
    )


def make_checkpoint(directory: Path, size_gib: float, device: str) -> Path:
    """Writes ``config.json`` + ``model.safetensors`` of random bf16 weights (unless present)
    and ``checksums.json``: per tensor, the float64 sum of its values."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    out = directory / f"llama-{size_gib:g}GiB-bf16"
    if (out / "checksums.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = llama_config(int(size_gib * GIB))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    gen_device = device if device.startswith("cuda") else "cpu"
    gen = torch.Generator(gen_device).manual_seed(0)
    state, sums = {}, {}
    for name, p in model.state_dict().items():
        t = (torch.randn(p.shape, generator=gen, device=gen_device) * 0.02).to(torch.bfloat16)
        sums[name] = float(t.double().sum())
        state[name] = t.cpu()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    (out / "checksums.json").write_text(json.dumps(sums))
    return out


# ---------------------------------------------------------------------------------------------
# One loader's runs, in a fresh child process
# ---------------------------------------------------------------------------------------------


def _reset_peak_rss() -> bool:
    """Restarts the kernel's peak-RSS count (VmHWM) from the current RSS (Linux 4.0+), so a
    run's peak is its own, not one left by the imports; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def resident_fraction(path: Path) -> float | None:
    """The share of ``path``'s pages in the page cache, from the kernel (``mincore(2)`` on a
    fresh mapping, as util-linux's ``fincore`` reads it); None where that fails."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    if size == 0:
        return None
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(addr, size, vec) != 0:
            return None
        return sum(b & 1 for b in vec.raw) / pages
    finally:
        libc.munmap(addr, size)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _disk_read(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    chunk = 64 << 20
    fd = os.open(path, os.O_RDONLY)
    try:

        def read(offset: int) -> int:
            return len(os.pread(fd, min(chunk, size - offset), offset))

        with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
            total = sum(pool.map(read, range(0, size, chunk)))
    finally:
        os.close(fd)
    return {"bytes": total}


# What each loader imports, done before any clock starts: a load is timed, not an import.
_IMPORTS: dict[str, list[str]] = {
    "fastload.load_file": ["fastload.safetensors.files"],
    "fastload.from_pretrained": [
        "fastload.core.loading",
        "transformers.models.llama.modeling_llama",
    ],
    "safetensors.safe_open": ["safetensors"],
    "transformers": ["transformers.models.llama.modeling_llama"],
    "fastsafetensors": ["fastsafetensors"],
    "runai-model-streamer": ["runai_model_streamer"],
    "instanttensor": ["instanttensor"],
}


def _load(loader: str, ckpt: Path, device: str, nbytes: int) -> dict[str, Any]:
    """Runs one load; returns {name: tensor on the device}."""
    import torch

    path = ckpt / "model.safetensors"
    if loader == "floor:pinned_h2d":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
        # Allocation and pinning are outside the floor: only the copy counts.
        start = time.perf_counter()
        out = host.to(device, non_blocking=True) if device != "cpu" else host.clone()
        return {"__floor__": out, "__start__": start}
    if loader == "fastload.load_file":
        import fastload

        return fastload.load_file(path, device=device)
    if loader == "fastload.from_pretrained":
        from transformers import LlamaForCausalLM

        import fastload

        model = fastload.from_pretrained(LlamaForCausalLM, ckpt, device=device, progress=False)
        return dict(model.state_dict())
    if loader == "safetensors.safe_open":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device=device) as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open API
    if loader == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(ckpt), device_map=device)
        return dict(model.state_dict())
    if loader == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        with fastsafe_open(filenames=[str(path)], nogds=True, device=device) as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if loader == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_file(str(path), device=device)
            return dict(streamer.get_tensors())
    if loader == "instanttensor":
        from instanttensor import safe_open as it_open

        index = int(device.split(":")[1]) if ":" in device else 0
        with it_open(str(path), framework="pt", device=index) as f:
            return dict(f.tensors())
    raise SystemExit(f"unknown loader {loader!r}")


def child(loader: str, ckpt: Path, device: str, mode: str, repeats: int) -> dict[str, Any]:
    """``repeats`` timed runs of ``loader`` in this process (the caller made it fresh)."""
    import importlib

    import torch

    for module in _IMPORTS.get(loader, []):
        importlib.import_module(module)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=device)  # the context exists before any clock starts
    path = ckpt / "model.safetensors"
    nbytes = path.stat().st_size
    sums = json.loads((ckpt / "checksums.json").read_text())
    runs = []
    for _ in range(repeats):
        resident = None
        if mode == "cold":
            evict(path)
            resident = resident_fraction(path)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        hwm_reset = _reset_peak_rss()
        rss_before = _status_bytes("VmRSS")
        start = time.perf_counter()
        if loader == "floor:disk_read":
            out: dict[str, Any] = _disk_read(path)
        else:
            out = _load(loader, ckpt, device, nbytes)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - out.pop("__start__", start)
        run: dict[str, Any] = {
            "seconds": seconds,
            "peak_rss_over_baseline": _status_bytes("VmHWM") - rss_before,
            "peak_rss_reset": hwm_reset,
        }
        if resident is not None:
            run["resident_after_evict"] = resident
        if cuda:
            run["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        if not loader.startswith("floor:"):
            bad = [k for k, v in sums.items() if k not in out or float(out[k].double().sum()) != v]
            run["correct"] = not bad
            if bad:
                run["wrong_tensors"] = bad[:5]
        runs.append(run)
        del out
        if cuda:
            torch.cuda.empty_cache()
    return {"runs": runs}


#: the settings ``--tune`` tries for fastload.load_file on the warm file: pool size, copy
#: threads, read path (the first of each is the default)
TUNE_STAGING = ("128MiB", "512MiB", "1GiB")
TUNE_THREADS = (None, 8, 32)
TUNE_READ_MODES = ("pread", "mmap")


def tune_child(ckpt: Path, device: str, repeats: int) -> dict[str, Any]:
    """fastload.load_file to ``device`` with each setting of the tuning grid, ``repeats`` times
    each, round-robin (so drift hits every setting alike); median seconds per setting."""
    import itertools

    import torch

    import fastload

    cuda = device.startswith("cuda")
    torch.empty(1, device=device)
    path = ckpt / "model.safetensors"
    grid = list(itertools.product(TUNE_STAGING, TUNE_THREADS, TUNE_READ_MODES))
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for staging, threads, read_mode in grid:
            start = time.perf_counter()
            out = fastload.load_file(
                path, device=device, staging_bytes=staging, threads=threads, read_mode=read_mode
            )
            if cuda:
                torch.cuda.synchronize(device)
            key = f"staging={staging} threads={threads or 'default'} read_mode={read_mode}"
            times.setdefault(key, []).append(time.perf_counter() - start)
            del out
    return {"settings": {k: statistics.median(v) for k, v in times.items()}}


def run_child(
    loader: str, ckpt: Path, device: str, mode: str, repeats: int, timeout: float
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", loader, "--ckpt", str(ckpt)]
    cmd += ["--device", device, "--mode", mode, "--repeats", str(repeats)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), *sys.path]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result = json.loads(lines[-1])
    if "runs" in result:
        result["median_seconds"] = statistics.median(r["seconds"] for r in result["runs"])
    return result


# ---------------------------------------------------------------------------------------------
# The whole check
# ---------------------------------------------------------------------------------------------


def run_tests(
    timeout: float, tests: Path = ROOT / "tests", log: Path | None = None
) -> dict[str, Any]:
    """``pytest -m cuda`` on ``tests``; counts from its JUnit XML; pytest's whole output to
    ``log`` if given."""
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={xml}", str(tests)]
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        out: dict[str, Any] = {"exit_code": proc.returncode, "tail": proc.stdout[-3000:]}
        if log is not None:
            log.write_text(proc.stdout + proc.stderr)
        if xml.exists():
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite[0]
            for key in ("tests", "failures", "errors", "skipped"):
                out[key] = int(suite.get(key, 0))
            out["failed"] = [
                f"{case.get('classname')}::{case.get('name')}"
                for case in suite.iter("testcase")
                if case.find("failure") is not None or case.find("error") is not None
            ]
        return out


def environment(device: str) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    from fastload.core.memory.staging import DEFAULT_STAGING_BYTES

    env: dict[str, Any] = {
        "staging_bytes": DEFAULT_STAGING_BYTES,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device)
    for package in ("transformers", "safetensors", "fastsafetensors", "runai-model-streamer"):
        try:
            env[package] = md.version(package)
        except md.PackageNotFoundError:
            env[package] = None
    try:
        env["instanttensor"] = md.version("instanttensor")
    except md.PackageNotFoundError:
        env["instanttensor"] = None
    return env


def summarize(results: dict[str, Any]) -> None:
    """Adds, per size and mode, each loader's ratio to the floor and to the fastest peer.

    The floor of a warm load is the pinned host-to-device copy of its bytes; of a cold load, the
    slower of that copy and the parallel read of the evicted file (a load does both)."""
    for size in results["sizes"].values():
        h2d = size["modes"].get("warm", {}).get("floor:pinned_h2d", {}).get("median_seconds")
        for mode, loaders in size["modes"].items():
            disk = loaders.get("floor:disk_read", {}).get("median_seconds")
            floors = [h2d] if mode == "warm" else [disk, h2d]
            floor = max((f for f in floors if f), default=None)
            if floor:
                size.setdefault("floor_seconds", {})[mode] = floor
            peers = [
                v["median_seconds"]
                for k, v in loaders.items()
                if not k.startswith(("floor:", "fastload")) and "median_seconds" in v
            ]
            fastest_peer = min(peers) if peers else None
            for name, entry in loaders.items():
                secs = entry.get("median_seconds")
                if secs is None:
                    continue
                entry["gb_per_s"] = size["bytes"] / secs / 1e9
                if floor:
                    entry["floor_over_time"] = floor / secs  # 1.0 = at the floor
                if fastest_peer and not name.startswith("floor:"):
                    entry["speedup_vs_fastest_peer"] = fastest_peer / secs


def check(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    begin = time.monotonic()
    device = args.device
    results: dict[str, Any] = {"environment": environment(device), "sizes": {}}
    if device.startswith("cuda") and not torch.cuda.is_available():
        results["skipped"] = "no CUDA device"
        return results
    if not args.no_tests:
        log = args.out.with_suffix(".pytest.txt") if args.out else None
        results["tests"] = run_tests(timeout=args.tests_timeout, log=log)
        print(f"tests: {json.dumps({k: v for k, v in results['tests'].items() if k != 'tail'})}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="cuda-check-"))
    for size_gib in args.sizes:
        ckpt = make_checkpoint(work, size_gib, device)
        path = ckpt / "model.safetensors"
        entry: dict[str, Any] = {"bytes": path.stat().st_size, "modes": {}}
        results["sizes"][f"{size_gib:g}GiB"] = entry
        for mode in args.modes:
            loaders = entry["modes"].setdefault(mode, {})
            for loader in args.loaders:
                if (loader, mode) in (("floor:disk_read", "warm"), ("floor:pinned_h2d", "cold")):
                    continue
                left = args.budget_s - (time.monotonic() - begin)
                if left < 20:
                    loaders[loader] = {"error": "skipped: time budget spent"}
                    continue
                if mode == "warm":
                    warm(path)
                repeats = args.repeats if mode == "warm" else args.cold_repeats
                loaders[loader] = run_child(
                    loader, ckpt, device, mode, repeats, timeout=min(args.child_timeout, left)
                )
                shown = loaders[loader].get("median_seconds", loaders[loader].get("error"))
                print(f"{size_gib:g} GiB {mode:4s} {loader:28s} {shown}", flush=True)
        if args.tune and "tuning" not in results:
            warm(path)
            left = args.budget_s - (time.monotonic() - begin)
            results["tuning"] = {"size": f"{size_gib:g}GiB"} | run_child(
                "tune", ckpt, device, "warm", args.repeats, timeout=min(args.child_timeout, left)
            )
            print(f"tuning: {json.dumps(results['tuning'])}", flush=True)
        if not args.keep:
            path.unlink()
            (ckpt / "checksums.json").unlink()
    summarize(results)
    results["wall_seconds"] = time.monotonic() - begin
    return results


def markdown(results: dict[str, Any], command: str) -> str:
    """The results as a Markdown page: the machine, the command, a table per size and mode
    (median seconds, GB/s, share of the floor, speed-up over the fastest peer, peak host RSS
    above the pre-load RSS, tensors checked), the tuning grid and the tests."""
    env = results.get("environment", {})
    mib = 1 << 20
    lines = [
        f"# Loads to {env.get('device')} on {env.get('gpu', '?')}",
        "",
        f"Measured with `{command}` (each loader in a fresh process per mode; medians).",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None),
        "",
        "floor = the pinned host-to-device copy of the same bytes (warm); the slower of that and "
        "parallel 64 MiB preads of the evicted file (cold). `x floor` = floor time / load time "
        "(1.0 = at the floor); `x peer` = fastest peer's time / this time.",
    ]
    for size, entry in results.get("sizes", {}).items():
        for mode, loaders in entry["modes"].items():
            floor = entry.get("floor_seconds", {}).get(mode)
            lines += [
                "",
                f"## {size} bf16, {mode} page cache" + (f" (floor {floor:.3f} s)" if floor else ""),
                "",
                "| loader | median s | GB/s | x floor | x peer | peak RSS MiB | correct |",
                "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
            ]
            for name, v in loaders.items():
                if "median_seconds" not in v:
                    lines.append(f"| {name} | {v.get('error', '?')} | | | | | |")
                    continue
                peak = max(r["peak_rss_over_baseline"] for r in v["runs"]) / mib
                ok = {r.get("correct") for r in v["runs"]}
                cells = [
                    f"{v['median_seconds']:.3f}",
                    f"{v['gb_per_s']:.1f}",
                    f"{v['floor_over_time']:.2f}" if "floor_over_time" in v else "",
                    f"{v['speedup_vs_fastest_peer']:.2f}" if "speedup_vs_fastest_peer" in v else "",
                    f"{peak:.0f}",
                    "" if ok == {None} else ("yes" if ok == {True} else "NO"),
                ]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    tuning = results.get("tuning", {})
    if "settings" in tuning:
        lines += ["", f"## fastload.load_file settings, {tuning['size']} warm", ""]
        lines += ["| setting | median s |", "| --- | ---: |"]
        for k, v in sorted(tuning["settings"].items(), key=lambda kv: kv[1]):
            lines.append(f"| {k} | {v:.4f} |")
    tests = results.get("tests")
    if tests:
        counts = {k: tests.get(k) for k in ("tests", "failures", "errors", "skipped")}
        lines += ["", "## pytest -m cuda", "", ", ".join(f"{k}: {v}" for k, v in counts.items())]
        lines += [f"- failed: {name}" for name in tests.get("failed", [])]
    return "\n".join(lines) + "\n"


def plot(results_path: Path, png: Path) -> None:
    """Bar chart of GB/s per loader, one panel per size and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(results_path.read_text())
    panels = [
        (size, mode, loaders)
        for size, entry in results["sizes"].items()
        for mode, loaders in entry["modes"].items()
    ]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4.5))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (size, mode, loaders) in zip(axes, panels, strict=False):
        names = [n for n, v in loaders.items() if "gb_per_s" in v]
        ax.barh(names, [loaders[n]["gb_per_s"] for n in names])
        ax.set_title(f"{size}, {mode} cache")
        ax.set_xlabel("GB/s to cuda:0 (higher is better)")
    env = results.get("environment", {})
    fig.suptitle(f"{env.get('gpu', env.get('device'))}, torch {env.get('torch')}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: $OUT or .)")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 8.0], help="GiB")
    p.add_argument("--modes", nargs="+", default=["warm", "cold"], choices=["warm", "cold"])
    p.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=list(LOADERS))
    p.add_argument("--repeats", type=int, default=3, help="warm runs per loader")
    p.add_argument("--cold-repeats", type=int, default=2)
    p.add_argument("--device", default="cuda:0", help="'cpu' exercises the plumbing anywhere")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting loaders after")
    p.add_argument("--child-timeout", type=float, default=120.0)
    p.add_argument("--tests-timeout", type=float, default=180.0)
    p.add_argument("--no-tests", action="store_true", help="skip pytest -m cuda")
    p.add_argument(
        "--tune", action="store_true", help="also time load_file's settings on the first size"
    )
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument(
        "--plot", type=Path, default=None, help="only write RESULTS.json as a PNG and a .md page"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="warm", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child == "tune":
        print(json.dumps(tune_child(args.ckpt, args.device, args.repeats)))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.ckpt, args.device, args.mode, args.repeats)))
        return 0
    if args.plot:
        plot(args.plot, args.plot.with_suffix(".png"))
        results = json.loads(args.plot.read_text())
        command = results.get("command", "python benches/cuda_check.py")
        args.plot.with_suffix(".md").write_text(markdown(results, command))
        return 0
    out = args.out = args.out or Path(os.environ.get("OUT", ".")) / "cuda_results.json"
    results = check(args)
    results["command"] = "python benches/cuda_check.py " + " ".join(argv or sys.argv[1:])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    failed = results.get("tests", {}).get("failures", 0) + results.get("tests", {}).get("errors", 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
