"""vLLM engine starts with each load format that runs here, cold and warm, beside the floors.

    bash scripts/vllm-env.sh   # once: the vLLM environment (prints its python)
    ~/.cache/fastload/vllm-venv/bin/python benches/vllm_bench.py [--layers 12] [--out DIR]

One bf16 Llama (random weights, several shards, made once under --workdir; 1.1 GiB by default) is
served by vLLM (CPU, ``LLM(...)`` with the engine in process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
in a fresh process per run, with each load format: vLLM's ``safetensors`` with each
``safetensors_load_strategy`` (lazy, the default; eager; prefetch), its multi-threaded iterator
(``enable_multithread_load``, 8 threads), ``fastsafetensors``, ``runai_streamer`` and
``fastload``; cold (the shards evicted from the page cache just before) and warm (read once just
before). Per run:

* ``load_model_s``: the CPU model runner's whole ``load_model`` (building the model, reading,
  post-processing), timed around it;
* ``weights_s``: the "Loading weights took" figure vLLM logs, where the format logs one;
* ``engine_s``: ``LLM(...)`` from the call to a ready engine;
* ``rss``/``pss`` after loading (the OS's ``/proc/<pid>/smaps_rollup`` read right after
  ``load_model``), at the ready engine (read by this script, from outside), and the peak seen by
  this script polling every 20 ms (the 1 GiB KV cache is in the last two, for every format).

Floors, measured in the same run: reading every byte of the evicted shards (8 threads, the page
cache as the destination: ``sendfile`` to /dev/null), and one ``memcpy`` of every byte into fresh
memory (torch's ``copy_`` into an untouched tensor). Writes ``vllm-<size>.json``, ``.md`` and a
``.png`` plot to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

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

_CHILD = r"""
import json, sys, time

def smaps():
    out = {}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if parts[0] in ("Rss:", "Pss:"):
            out[parts[0][:-1].lower()] = int(parts[1]) * 1024
    return out

def main():
    kwargs = json.loads(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.v1.worker import cpu_model_runner

    original = cpu_model_runner.CPUModelRunner.load_model

    def timed(self, *args, **kw):
        start = time.perf_counter()
        result = original(self, *args, **kw)
        seconds = time.perf_counter() - start
        print("LOAD_MODEL " + json.dumps({"seconds": seconds, **smaps()}), flush=True)
        return result

    cpu_model_runner.CPUModelRunner.load_model = timed
    start = time.perf_counter()
    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=128,
              max_num_seqs=4, seed=0, **kwargs)
    print("READY " + json.dumps({"seconds": time.perf_counter() - start}), flush=True)
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
    from fastload.core.page_cache import evict, warm

    for f in _shards(model):
        (evict if mode == "cold" else warm)(f)


def run_format(model: Path, name: str, mode: str, timeout: float = 900) -> dict[str, Any]:
    """One engine start with load format ``name`` from a ``mode`` ("cold"/"warm") page cache."""
    kwargs = FORMATS[name]
    script = Path(tempfile.mkdtemp()) / "serve.py"
    script.write_text(_CHILD)
    env = os.environ.copy()
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    _set_cache(model, mode)
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

    def poll() -> None:
        while not done.is_set():
            m = _smaps(proc.pid)
            for k in peak:
                peak[k] = max(peak[k], m.get(k, 0))
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    result: dict[str, Any] = {"format": name, "mode": mode}
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None and proc.stdin is not None
    try:
        for line in proc.stdout:
            took = re.search(r"Loading weights took ([0-9.]+) seconds", line)
            if took:
                result["weights_s"] = float(took.group(1))
            word, _, rest = line.strip().partition(" ")
            if word == "LOAD_MODEL":
                m = json.loads(rest)
                result["load_model_s"] = m["seconds"]
                result["rss_after_load"], result["pss_after_load"] = m["rss"], m["pss"]
            elif word == "READY":
                result["engine_s"] = json.loads(rest)["seconds"]
                m = _smaps(proc.pid)
                result["rss_ready"], result["pss_ready"] = m.get("rss"), m.get("pss")
                proc.stdin.write("\n")
                proc.stdin.flush()
            elif word == "TOKENS":
                result["tokens"] = json.loads(rest)
                break
            if time.monotonic() > deadline:
                break
    finally:
        done.set()
        poller.join()
        proc.kill()
        proc.wait()
    result["peak_rss"], result["peak_pss"] = peak["rss"], peak["pss"]
    log.seek(0)
    text = log.read()
    took = re.search(r"Loading weights took ([0-9.]+) seconds", text)
    if took and "weights_s" not in result:
        result["weights_s"] = float(took.group(1))
    if "tokens" not in result:
        errors = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln]
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


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def _s(n: float | None) -> str:
    return "-" if n is None else f"{n:.2f}"


def markdown(results: dict[str, Any]) -> str:
    size = results["model_bytes"]
    floors = results["floors"]
    lines = [
        f"vLLM {results['vllm']} (CPU), {results['model']}: bf16 Llama, {_gib(size)} GiB in "
        f"{results['shards']} shards; engine in process; `python benches/vllm_bench.py`.",
        "",
        f"Floors (same run): cold read of every byte {floors['cold_read_s']:.2f} s; one memcpy of "
        f"every byte into fresh memory {floors['memcpy_s']:.2f} s.",
        "",
        "| format | cache | load_model s | x floor | weights s (vLLM's log) | engine start s | "
        "RSS after load GiB | PSS after load GiB | peak RSS GiB | peak PSS GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        floor = floors["cold_read_s"] if r["mode"] == "cold" else floors["memcpy_s"]
        if "error" in r:
            lines.append(f"| {r['format']} | {r['mode']} | failed: {r['error'][:120]} |")
            continue
        lines.append(
            f"| {r['format']} | {r['mode']} | {_s(r.get('load_model_s'))} | "
            f"{r['load_model_s'] / floor:.2f} | {_s(r.get('weights_s'))} | "
            f"{_s(r.get('engine_s'))} | {_gib(r.get('rss_after_load'))} | "
            f"{_gib(r.get('pss_after_load'))} | {_gib(r['peak_rss'])} | {_gib(r['peak_pss'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if "error" not in r]
    names = list(dict.fromkeys(r["format"] for r in runs))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.4
    for i, mode in enumerate(("cold", "warm")):
        values = [
            next((r["load_model_s"] for r in runs if r["format"] == n and r["mode"] == mode), 0)
            for n in names
        ]
        ax.barh([y + i * width for y in range(len(names))], values, width, label=mode)
    for mode, key, style in (("cold", "cold_read_s", "--"), ("warm", "memcpy_s", ":")):
        ax.axvline(results["floors"][key], linestyle=style, color="gray", label=f"{mode} floor")
    ax.set_yticks([y + width / 2 for y in range(len(names))], names)
    ax.set_xlabel("seconds: the CPU model runner's load_model (lower is better)")
    ax.set_title(f"vLLM {results['vllm']} CPU, {_gib(results['model_bytes'])} GiB bf16 Llama")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--workdir", default="/tmp/fastload-vllm-bench")
    parser.add_argument("--out", default="benches/results")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--modes", default="cold,warm")
    args = parser.parse_args()
    import vllm

    model = make_model(Path(args.workdir), args.layers)
    size = sum(f.stat().st_size for f in _shards(model))
    results: dict[str, Any] = {
        "vllm": vllm.__version__,
        "model": model.name,
        "model_bytes": size,
        "shards": len(_shards(model)),
        "cpus": os.cpu_count(),
        "floors": {"cold_read_s": floor_cold_read(model), "memcpy_s": floor_memcpy(size)},
        "runs": [],
    }
    print(json.dumps(results["floors"]), flush=True)
    for mode in args.modes.split(","):
        for name in args.formats.split(","):
            r = run_format(model, name, mode)
            print(json.dumps(r), flush=True)
            results["runs"].append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"vllm-{size / (1 << 30):.1f}GiB"  # not Path.with_suffix: ".1GiB" would be the suffix
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(markdown(results))
    plot(results, out / f"{stem}.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
