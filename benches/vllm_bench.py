"""vLLM engine starts with each load format that runs here, cold and warm, beside the floors.

    bash scripts/vllm-env.sh   # once: the vLLM environment (prints its python)
    ~/.cache/fastload/vllm-venv/bin/python benches/vllm_bench.py [--repeats 3] [--out DIR]

One bf16 Llama (random weights, several shards, made once under --workdir; 1.1 GiB by default) is
served by vLLM (CPU, ``LLM(...)`` with the engine in process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
in a fresh process per run, with each load format: vLLM's ``safetensors`` with each
``safetensors_load_strategy`` (lazy, the default; eager; prefetch), its multi-threaded iterator
(``enable_multithread_load``, 8 threads), ``fastsafetensors``, ``runai_streamer`` and
``fastload``; cold (the shards evicted from the page cache just before) and warm (read once just
before). The runs go round-robin (every format and cache state once, then again, ``--repeats``
times), so the machine's noise falls on all of them alike; the tables give medians. Per run,
measured in the serving process around vLLM's own functions:

* ``load_model_s``: the CPU model runner's whole ``load_model`` (building the model, the loader's
  ``load_weights``, vLLM's post-load processing);
* ``load_weights_s``: the loader's ``load_weights`` (every format: reading and the model's weight
  loaders), and ``vllm_weights_s``: the "Loading weights took" figure vLLM logs, where the format
  logs one;
* ``post_s``: vLLM's post-load processing (``process_weights_after_loading``: on CPU it repacks
  every linear weight for oneDNN), the same work whatever the format;
* ``engine_s``: ``LLM(...)`` from the call to a ready engine;
* memory (the OS's ``/proc/<pid>/smaps_rollup``, ``smaps`` and ``status``): RSS and PSS before and
  right after ``load_model``, the peak RSS up to its end (``VmHWM``: before the KV cache), the
  anonymous memory after it, the checkpoint's pages still mapped after it (file pages the server
  shares with the page cache and with other servers of the same files), RSS/PSS at the ready
  engine (the 1 GiB KV cache allocated), and the peak this script sees polling every 20 ms.

Floors, measured in the same run, once per repeat: reading every byte of the evicted shards (8
threads, the page cache as the destination: ``sendfile`` to /dev/null), and one ``memcpy`` of every
byte into fresh memory (torch's ``copy_`` into an untouched tensor). Ratios: the cold runs' times
to the cold-read floor, the warm runs' to the memcpy floor. With ``--serve``, each run is
followed by ``vllm serve`` of the same format and cache state, timed from process start to the
first token (benches/vllm_serve.py; the engine in its own process, as vLLM runs it), its
``load_weights`` from vLLM's log; vLLM's CPU post-processing is the engine runs' ``post_s``.
Writes ``vllm-<size>.json``, ``.md`` and a ``.png`` plot (where matplotlib is installed) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # fastload from this checkout, here and in the vLLM processes

from vllm_serve import serve_first_token  # noqa: E402

#: the suffix of the ``--serve`` runs' format names
SERVED = " (vllm serve)"

FORMATS: dict[str, dict[str, Any]] = {
    "safetensors lazy (default)": {"load_format": "safetensors"},
    "safetensors eager": {"load_format": "safetensors", "safetensors_load_strategy": "eager"},
    "safetensors prefetch": {
        "load_format": "safetensors",
        "safetensors_load_strategy": "prefetch",
    },
    "safetensors multi-thread (8)": {
        "load_format": "safetensors",
        "model_loader_extra_config": {"enable_multithread_load": True, "num_threads": 8},
    },
    "fastsafetensors": {"load_format": "fastsafetensors"},
    "runai_streamer": {"load_format": "runai_streamer"},
    "fastload": {"load_format": "fastload"},
}

#: fastload's variants, for looking into where its time goes (``--formats`` may name them)
VARIANTS: dict[str, dict[str, Any]] = {
    "fastload (share_weights=false)": {
        "load_format": "fastload",
        "model_loader_extra_config": {"share_weights": False},
    },
    "fastload (read_ahead=false)": {
        "load_format": "fastload",
        "model_loader_extra_config": {"read_ahead": False},
    },
    "fastload (mmap=copy)": {
        "load_format": "fastload",
        "model_loader_extra_config": {"mmap": "copy"},
    },
}

_CHILD = r"""
import json, os, sys, time

def smaps():
    out = {}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if parts[0] in ("Rss:", "Pss:", "Anonymous:"):
            out[parts[0][:-1].lower()] = int(parts[1]) * 1024
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):  # the kernel's high-water mark of this process's RSS
            out["hwm"] = int(line.split()[1]) * 1024
    return out

def mapped(folder):
    # resident bytes of this process's mappings of the checkpoint's files
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            parts = line.split()
            inside = len(parts) >= 6 and parts[5].startswith(folder)
        elif inside and first == "Rss:":
            total += int(line.split()[1]) * 1024
    return total

def main():
    model, kwargs = sys.argv[1], json.loads(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader import base_loader
    from vllm.v1.worker import cpu_model_runner

    times = {}

    def timed(key, function):
        def run(*args, **kw):
            start = time.perf_counter()
            try:
                return function(*args, **kw)
            finally:
                times[key] = times.get(key, 0.0) + time.perf_counter() - start
        return run

    base_loader.process_weights_after_loading = timed(
        "post_s", base_loader.process_weights_after_loading
    )
    get_loader = model_loader.get_model_loader

    def get_model_loader(config):
        loader = get_loader(config)
        loader.load_weights = timed("load_weights_s", loader.load_weights)
        return loader

    model_loader.get_model_loader = get_model_loader
    load_model = cpu_model_runner.CPUModelRunner.load_model

    def timed_load_model(self, *args, **kw):
        before = smaps()
        start = time.perf_counter()
        result = load_model(self, *args, **kw)
        seconds = time.perf_counter() - start
        after = smaps()
        print("LOAD_MODEL " + json.dumps({
            "load_model_s": seconds, **times,
            "rss_before_load": before["rss"], "pss_before_load": before["pss"],
            "rss_after_load": after["rss"], "pss_after_load": after["pss"],
            "anon_after_load": after["anonymous"], "peak_rss_load": after["hwm"],
            "checkpoint_mapped_after_load": mapped(model),
        }), flush=True)
        return result

    cpu_model_runner.CPUModelRunner.load_model = timed_load_model
    start = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=128,
              max_num_seqs=4, seed=0, **kwargs)
    print("READY " + json.dumps({"engine_s": time.perf_counter() - start}), flush=True)
    sys.stdin.readline()
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8))
    print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)

if __name__ == "__main__":
    main()
"""


def _smaps(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            parts = line.split()
            if parts and parts[0] in ("Rss:", "Pss:"):
                out[parts[0][:-1].lower()] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def _shards(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def _set_cache(model: Path, mode: str) -> None:
    from fastload.core.memory.page_cache import evict, warm

    for f in _shards(model):
        (evict if mode == "cold" else warm)(f)


#: seconds between two reads of the engine's memory (for the peak PSS this script sees)
POLL_SECONDS = 0.25


def run_format(
    model: Path | str,
    name: str,
    kwargs: dict[str, Any],
    mode: str,
    timeout: float = 1800,
    set_cache: bool = True,
    poll: bool = True,
) -> dict[str, Any]:
    """One engine start with load format ``name`` from a ``mode`` ("cold"/"warm") page cache
    (set here unless ``set_cache`` is false: the caller did, e.g. an object store's files).
    ``poll`` false: the engine's memory is not read while it runs (``peak_rss``/``peak_pss``
    then absent; the peak in the load is the kernel's high-water mark either way)."""
    script = Path(tempfile.mkdtemp()) / "serve.py"
    script.write_text(_CHILD)
    env = os.environ.copy()
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if set_cache:
        _set_cache(Path(model), mode)
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model), json.dumps(kwargs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    peak = {"rss": 0, "pss": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            m = _smaps(proc.pid)
            for k in peak:
                peak[k] = max(peak[k], m.get(k, 0))
            # seldom: reading smaps_rollup walks the engine's page tables under its mmap lock,
            # which its page faults wait on (every 20 ms slowed a load from object storage by
            # 15-25% against floors measured without it); the peak RSS is the kernel's VmHWM
            time.sleep(POLL_SECONDS)

    poller = threading.Thread(target=watch, daemon=True)
    if poll:
        poller.start()
    result: dict[str, Any] = {"format": name, "mode": mode}
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    assert proc.stdout is not None and proc.stdin is not None
    try:
        for line in proc.stdout:
            took = re.search(r"Loading weights took ([0-9.]+) seconds", line)
            if took:
                result["vllm_weights_s"] = float(took.group(1))
            word, _, rest = line.strip().partition(" ")
            if word == "LOAD_MODEL":
                result.update(json.loads(rest))
            elif word == "READY":
                result.update(json.loads(rest))
                m = _smaps(proc.pid)
                result["rss_ready"], result["pss_ready"] = m.get("rss"), m.get("pss")
                proc.stdin.write("\n")
                proc.stdin.flush()
            elif word == "TOKENS":
                result["tokens"] = json.loads(rest)
                break
    finally:
        timer.cancel()
        done.set()
        if poll:
            poller.join()
        proc.kill()
        proc.wait()
    if poll:
        result["peak_rss"], result["peak_pss"] = peak["rss"], peak["pss"]
    if "tokens" not in result:
        log.seek(0)
        text = log.read()
        errors = [ln for ln in text.splitlines() if re.search(r"\w+(Error|Exception)\b", ln)]
        result["error"] = (errors[-1] if errors else text[-500:]).strip()[-400:]
    return result


def floor_cold_read(model: Path, threads: int = 8) -> float:
    """Seconds to read every byte of the evicted shards into the page cache (8 parallel streams,
    ``sendfile`` to /dev/null: no copy to user memory)."""
    _set_cache(model, "cold")
    chunk = 64 << 20
    jobs = [
        (f, off, min(chunk, f.stat().st_size - off))
        for f in _shards(model)
        for off in range(0, f.stat().st_size, chunk)
    ]

    def read(job: tuple[Path, int, int]) -> None:
        f, off, n = job
        with open(f, "rb") as src, open(os.devnull, "wb") as null:
            while n > 0:
                sent = os.sendfile(null.fileno(), src.fileno(), off, n)
                if sent <= 0:
                    break
                off, n = off + sent, n - sent

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, jobs))
    return time.perf_counter() - start


def floor_memcpy(nbytes: int) -> float:
    """Seconds of one ``copy_`` of ``nbytes`` resident bytes into fresh (untouched) memory."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def make_model(workdir: Path, layers: int) -> Path:
    from vllm_models import make_llama

    model = workdir / f"llama-bench-{layers}l"
    if not (model / "model.safetensors.index.json").exists():
        make_llama(
            model,
            hidden=2048,
            intermediate=5632,
            layers=layers,
            vocab=4096,
            heads=16,
            kv_heads=8,
            shards=4,
        )
    return model


#: the figures summarized per (format, cache state): their medians over the repeats
FIGURES = (
    "load_model_s",
    "load_weights_s",
    "vllm_weights_s",
    "post_s",
    "engine_s",
    "rss_before_load",
    "rss_after_load",
    "pss_after_load",
    "anon_after_load",
    "peak_rss_load",
    "checkpoint_mapped_after_load",
    "rss_ready",
    "pss_ready",
    "peak_rss",
    "peak_pss",
    "serve_s",
    "serve_weights_s",
)


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (format, cache state) in the order first run: the medians of :data:`FIGURES`, the
    runs counted, the errors seen."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results["runs"]:
        row = rows.setdefault(
            (r["format"], r["mode"]), {"format": r["format"], "mode": r["mode"], "runs": []}
        )
        row["runs"].append(r)
    out = []
    for row in rows.values():
        ok = [r for r in row["runs"] if "error" not in r]
        summary: dict[str, Any] = {"format": row["format"], "mode": row["mode"], "ok": len(ok)}
        summary["failed"] = len(row["runs"]) - len(ok)
        if summary["failed"]:
            summary["error"] = next(r["error"] for r in row["runs"] if "error" in r)
        for key in FIGURES:
            values = [r[key] for r in ok if r.get(key) is not None]
            summary[key] = statistics.median(values) if values else None
        out.append(summary)
    return out


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def _s(n: float | None) -> str:
    return "-" if n is None else f"{n:.2f}"


def _x(n: float | None, floor: float | None) -> str:
    return "-" if n is None or floor is None else f"{n / floor:.2f}"


def markdown(results: dict[str, Any]) -> str:
    size = results["model_bytes"]
    floors = results["floors"]
    cold, warm = floors["cold_read_s"], floors["memcpy_s"]
    lines = [
        f"vLLM {results['vllm']} (CPU, {results['cpus']} cores), {results['model']}: bf16 Llama, "
        f"{_gib(size)} GiB in {results['shards']} shards; engine in process "
        "(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), a fresh process per run; runs round-robin over "
        f"formats and cache states, {results['repeats']} repeats, medians.",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Floors (same run, medians of {len(floors['cold_read_all'])}): cold read of every byte "
        f"{cold:.2f} s (runs: {', '.join(f'{v:.2f}' for v in floors['cold_read_all'])}); one "
        f"memcpy of every byte into fresh memory {warm:.2f} s (runs: "
        f"{', '.join(f'{v:.2f}' for v in floors['memcpy_all'])}). Ratios (x floor): cold runs to "
        "the cold read, warm runs to the memcpy.",
        "",
        "Times (seconds): `load_weights` is the loader's (reading + the model's weight loaders), "
        "`post` vLLM's post-load processing (oneDNN repacking, the same for every format), "
        "`load_model` the CPU model runner's whole load.",
        "",
        "| format | cache | load_weights s | x floor | vLLM's log s | post s | load_model s | "
        "engine start s | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    everything = summarize(results)
    summary = [r for r in everything if not r["format"].endswith(SERVED)]
    for r in summary:
        floor = cold if r["mode"] == "cold" else warm
        if not r["ok"]:
            lines.append(f"| {r['format']} | {r['mode']} | failed: {r['error'][:160]} |")
            continue
        lines.append(
            f"| {r['format']} | {r['mode']} | {_s(r['load_weights_s'])} | "
            f"{_x(r['load_weights_s'], floor)} | {_s(r['vllm_weights_s'])} | {_s(r['post_s'])} | "
            f"{_s(r['load_model_s'])} | {_s(r['engine_s'])} | {r['ok']}"
            + (f" ({r['failed']} failed)" if r["failed"] else "")
            + " |"
        )
    lines += [
        "",
        "Memory (GiB; the server process, from the OS): RSS before `load_model`, the peak RSS "
        "up to its end (the kernel's high-water mark, VmHWM), RSS, PSS and anonymous (not "
        "file-backed) memory after it, the checkpoint's file pages still mapped after it "
        "(shared with the page cache and with other servers of the same files), RSS and PSS at "
        "the ready engine (the 1 GiB KV cache allocated) and the peak PSS this script saw.",
        "",
        "| format | cache | RSS before load | peak RSS in load | RSS after load | PSS after "
        "load | anonymous after load | checkpoint mapped after load | RSS ready | PSS ready | "
        "peak PSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        if not r["ok"]:
            continue
        lines.append(
            f"| {r['format']} | {r['mode']} | {_gib(r['rss_before_load'])} | "
            f"{_gib(r['peak_rss_load'])} | {_gib(r['rss_after_load'])} | "
            f"{_gib(r['pss_after_load'])} | {_gib(r['anon_after_load'])} | "
            f"{_gib(r['checkpoint_mapped_after_load'])} | {_gib(r['rss_ready'])} | "
            f"{_gib(r['pss_ready'])} | {_gib(r['peak_pss'])} |"
        )
    lines += serve_table([r for r in everything if r["format"].endswith(SERVED)], cold, warm)
    tokens = token_sets(results["runs"])
    same = "the same in every run" if len(tokens) == 1 else f"DIFFER: {sorted(tokens)}"
    lines += ["", f"Greedy tokens: {same}."]
    return "\n".join(lines) + "\n"


def token_sets(runs: list[dict[str, Any]]) -> set[str]:
    """The distinct greedy tokens of the successful runs; a ``--serve`` run asked for one token,
    compared with the first of the others' (one set: every run agrees)."""
    full = [r["tokens"] for r in runs if "tokens" in r and not r["format"].endswith(SERVED)]
    served = [r["tokens"] for r in runs if "tokens" in r and r["format"].endswith(SERVED)]
    out = {json.dumps(t) for t in full}
    width = min((len(t) for t in served), default=0)
    out |= {
        json.dumps(t[:width])
        for t in served
        if json.dumps(t[:width]) not in {json.dumps(f[:width]) for f in full}
    }
    return out


def serve_table(rows: list[dict[str, Any]], cold: float | None, warm: float | None) -> list[str]:
    """The ``--serve`` runs' table (none without them): process start to first token, and the
    loader's part of it (vLLM's "Loading weights took") as a ratio to the floor of its cache
    state; vLLM's CPU post-processing is the engine runs' ``post s`` above."""
    if not rows:
        return []
    lines = [
        "",
        "`vllm serve` (the engine in its own process, as vLLM runs it), from process start to "
        "the answer to a one-token completions request; `load_weights` from vLLM's log.",
        "",
        "| format | cache | first token s | load_weights s | x floor | runs |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['format']} | {r['mode']} | failed: {r['error'][:160]} |")
            continue
        floor = cold if r["mode"] == "cold" else warm
        lines.append(
            f"| {r['format']} | {r['mode']} | {_s(r['serve_s'])} | {_s(r['serve_weights_s'])} | "
            f"{_x(r['serve_weights_s'], floor)} | {r['ok']} |"
        )
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    """The plot, where matplotlib is installed (the tables and the JSON are written before it:
    without it the run still ends with its results, saying the plot was left out)."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot ({path} left out): matplotlib is not installed", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [r for r in summarize(results) if r["ok"] and not r["format"].endswith(SERVED)]
    names = list(dict.fromkeys(r["format"] for r in summary))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    floors = results["floors"]
    for ax, mode, floor, label in (
        (axes[0], "cold", floors["cold_read_s"], "cold read of every byte"),
        (axes[1], "warm", floors["memcpy_s"], "one memcpy of every byte"),
    ):
        rows = {r["format"]: r for r in summary if r["mode"] == mode}
        weights = [rows[n]["load_weights_s"] if n in rows else 0 for n in names]
        rest = [
            rows[n]["load_model_s"] - rows[n]["load_weights_s"] if n in rows else 0 for n in names
        ]
        ys = range(len(names))
        ax.barh(ys, weights, label="loader's load_weights")
        ax.barh(ys, rest, left=weights, color="lightgray", label="rest of load_model (vLLM's)")
        ax.axvline(floor, linestyle="--", color="black", label=f"floor: {label}")
        ax.set_title(f"{mode} page cache")
        ax.set_xlabel("seconds (median)")
        ax.legend(fontsize=8)
    axes[0].set_yticks(list(range(len(names))), names)
    fig.suptitle(
        f"vLLM {results['vllm']} CPU, {_gib(results['model_bytes'])} GiB bf16 Llama: "
        "the CPU model runner's load_model"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def describe(model: Path, repeats: int, script: str) -> dict[str, Any]:
    """The head of a result file: vLLM's version, the model, this machine, the command run."""
    import vllm

    return {
        "vllm": vllm.__version__,
        "model": model.name,
        "model_bytes": sum(f.stat().st_size for f in _shards(model)),
        "shards": len(_shards(model)),
        "cpus": os.cpu_count(),
        "repeats": repeats,
        "command": f"python benches/{script} " + shlex.join(sys.argv[1:]),
    }


def rotated(names: list[str], repeat: int) -> list[str]:
    """``names`` for round ``repeat``: each round starts with another one, so the machine's
    noise falls on all of them alike."""
    turn = repeat % len(names)
    return names[turn:] + names[:turn]


def save(out: Path, stem: str, results: dict[str, Any], text: str) -> Path:
    """``results`` as ``out/<stem>.json`` and ``text`` as ``out/<stem>.md`` (also printed).
    (Not ``Path.with_suffix``: ".1GiB" would be taken for a suffix.)"""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(text)
    print(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--workdir", default="/tmp/fastload-vllm-bench")
    parser.add_argument("--out", default="benches/results")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--modes", default="cold,warm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default=None, help="file name stem (default: vllm-<size>)")
    parser.add_argument(
        "--serve", action="store_true", help="also time `vllm serve` to the first token"
    )
    args = parser.parse_args()

    known = {**FORMATS, **VARIANTS}
    names = args.formats.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown formats {unknown}; known: {list(known)}")
    model = make_model(Path(args.workdir), args.layers)
    results = describe(model, args.repeats, "vllm_bench.py")
    size = results["model_bytes"]
    results.update(floors={"cold_read_all": [], "memcpy_all": []}, runs=[])
    for repeat in range(args.repeats):
        results["floors"]["cold_read_all"].append(floor_cold_read(model))
        results["floors"]["memcpy_all"].append(floor_memcpy(size))
        print(json.dumps({"repeat": repeat, **results["floors"]}), flush=True)
        for name in rotated(names, repeat):
            for mode in args.modes.split(","):
                r = run_format(model, name, known[name], mode)
                r["repeat"] = repeat
                print(json.dumps(r), flush=True)
                results["runs"].append(r)
                if args.serve:
                    _set_cache(model, mode)
                    r = serve_first_token(str(model), name, known[name], mode)
                    r["repeat"] = repeat
                    print(json.dumps(r), flush=True)
                    results["runs"].append(r)
    floors = results["floors"]
    floors["cold_read_s"] = statistics.median(floors["cold_read_all"])
    floors["memcpy_s"] = statistics.median(floors["memcpy_all"])
    results["summary"] = summarize(results)
    stem = args.name or f"vllm-{size / (1 << 30):.1f}GiB"
    out = save(Path(args.out), stem, results, markdown(results))
    plot(results, out / f"{stem}.png")


if __name__ == "__main__":
    main()
