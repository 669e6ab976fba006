"""vLLM serving a checkpoint from object storage: fastload's ``weights`` option against vLLM's
``runai_streamer`` (an ``s3://`` model), beside the transport floor.

    bash scripts/vllm-env.sh   # once: the vLLM environment (prints its python)
    ~/.cache/fastload/vllm-venv/bin/python benches/vllm_s3_bench.py [--repeats 7] [--out DIR]
    ~/.cache/fastload/vllm-venv/bin/python benches/vllm_s3_bench.py --render RESULTS.json

The bf16 Llama of ``benches/vllm_bench.py`` (1.1 GiB in several shards, made once under
--workdir) is put in a local S3-compatible server (s3s-fs on 127.0.0.1, ``bash
scripts/s3-server.sh``), and vLLM (CPU, engine in process) starts from it in a fresh process per
run:

* ``fastload``: ``LLM(<config dir>, load_format="fastload", model_loader_extra_config={"weights":
  "s3://bench/llama/"})``, the config and tokenizer copied once with ``fastload fetch``;
* ``runai_streamer``: ``LLM("s3://bench/llama/", load_format="runai_streamer")`` (vLLM fetches
  the config itself with Run:ai's ``pull_files``).

Each from the server's page cache cold (its files evicted just before) and warm. The figures are
``benches/vllm_bench.py``'s (the loader's ``load_weights``, vLLM's post-processing, the whole
``load_model``, memory from the OS; the engine's memory not polled while it loads: the peak is
the kernel's high-water mark). The floor, once per round and server cache state, in a fresh
process of its own like the loads: every byte of the shards fetched with 8 MiB ranged GETs, 16
at a time, into one preallocated buffer (fastload's HTTP client, no engine, nothing else); twice:
into a buffer touched before (the transport alone) and into fresh memory (the transport plus the
page faults of a first write, which any first load pays for the model's memory). The floors and
the formats take turns in a round-robin order (each round starts with another), and every load
is divided by the floor of its own round: the machine's slow and quiet spells fall on both, and
the table gives the median of those ratios and their spread (lowest-highest) beside the ratio of
the medians. With ``--serve``, each run is followed by ``vllm serve`` of the same format timed
from process start to the first token (benches/vllm_serve.py). Writes
``vllm-s3-<size>.{json,md}``; ``--render`` writes the tables again from such a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from vllm_bench import (  # noqa: E402
    SERVED,
    _shards,
    describe,
    make_model,
    rotated,
    run_format,
    save,
    serve_first_token,
    serve_table,
    summarize,
    token_sets,
)

RANGE = 8 << 20
PARALLEL = 16
BUCKET = "bench"


def floor_ranged_gets(url: str, files: list[Path], touched: bool = True) -> float:
    """Seconds to fetch every byte of ``files`` (objects under ``url``) with parallel ranged
    GETs into one preallocated buffer: touched before (the transport alone), or not (``touched``
    false: the transport and the first write to fresh memory, which a first load of a model
    pays too; measured here: 0.2-0.45 s per GiB of page faults)."""
    import torch

    from fastload.core.store.object_store import open_store, read_into

    store = open_store(url)
    prefix = store.key.rstrip("/")
    sizes = [(f"{prefix}/{f.name}", f.stat().st_size) for f in files]
    total = sum(size for _, size in sizes)
    buffer = (torch.ones if touched else torch.empty)(total, dtype=torch.uint8)
    jobs, at = [], 0
    for key, size in sizes:
        for off in range(0, size, RANGE):
            n = min(RANGE, size - off)
            jobs.append((key, off, buffer[at + off : at + off + n]))
        at += size
    start = time.perf_counter()
    with ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(lambda job: read_into(store, *job), jobs))
    return time.perf_counter() - start


def floor_in_process(url: str, model: Path, touched: bool) -> float:
    """:func:`floor_ranged_gets` in a fresh process, as every load runs (its own client and
    connections, nothing of this process's heap); the server's address from this environment."""
    out = subprocess.run(
        [sys.executable, __file__, "--floor", url, str(model), "touched" if touched else "fresh"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.split()[-1])


def _server_cache(root: Path, mode: str) -> None:
    from fastload.core.memory.page_cache import evict, warm

    for f in (root / BUCKET).rglob("*.safetensors"):
        (evict if mode == "cold" else warm)(f)


def markdown(results: dict[str, Any]) -> str:
    floors = results["floor_s"]

    def runs(key: str) -> str:
        return ", ".join(f"{x:.2f}" for x in results["floors"][key])

    lines = [
        f"vLLM {results['vllm']} (CPU, {results['cpus']} cores), {results['model']}: bf16 Llama, "
        f"{results['model_bytes'] / (1 << 30):.2f} GiB in {results['shards']} shards, in s3s-fs "
        "on 127.0.0.1; engine in process, a fresh process per run, round-robin, medians of "
        f"{results['repeats']}.",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Floors (same run, the server's page cache as in the runs they are compared with): "
        f"every byte fetched with {RANGE >> 20} MiB ranged GETs, {PARALLEL} at a time, into "
        "memory touched before (the transport alone), and into fresh memory (the page faults "
        "of a first write too, which a first load pays for the model's memory). "
        "Cold/warm: the server's page cache. Each in a fresh process, in turn with the loads.",
        "",
        *(
            f"- {key.replace('fresh_floor', 'fresh-memory floor').replace('_', ', ')}: "
            f"{floors[key]:.2f} s (runs: {runs(key)})"
            for key in sorted(floors)
        ),
    ]
    served = [row for row in results["summary"] if row["format"].endswith(SERVED)]
    lines += _round_ratios(results)
    lines += [
        "",
        "Medians of every run (the ratios here are of the medians):",
        "",
        "| format | server cache | load_weights s | x floor | x fresh-memory floor | post s "
        "| load_model s | engine s | peak RSS in load GiB | RSS after load GiB | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        if row in served:
            continue
        if not row["ok"]:
            lines.append(f"| {row['format']} | {row['mode']} | failed: {row['error']} |")
            continue

        def s(key: str, row: dict[str, Any] = row) -> str:
            v = row.get(key)
            return "-" if v is None else f"{v:.2f}"

        def g(key: str, row: dict[str, Any] = row) -> str:
            v = row.get(key)
            return "-" if v is None else f"{v / (1 << 30):.2f}"

        weights = row.get("load_weights_s")
        floor = floors.get(f"floor_{row['mode']}")
        fresh = floors.get(f"fresh_floor_{row['mode']}")
        ratio = "-" if weights is None or floor is None else f"{weights / floor:.2f}"
        ratio_fresh = "-" if weights is None or fresh is None else f"{weights / fresh:.2f}"
        lines.append(
            f"| {row['format']} | {row['mode']} | {s('load_weights_s')} | {ratio} "
            f"| {ratio_fresh} | {s('post_s')} "
            f"| {s('load_model_s')} | {s('engine_s')} | {g('peak_rss_load')} "
            f"| {g('rss_after_load')} | {row['ok']} |"
        )
    lines += serve_table(served, floors.get("floor_cold"), floors.get("floor_warm"))
    tokens = token_sets(results["runs"])
    lines += ["", f"Greedy tokens of every successful run the same: {len(tokens) == 1}."]
    return "\n".join(lines) + "\n"


def per_round(results: dict[str, Any], name: str, mode: str, key: str) -> list[float]:
    """``load_weights`` of format ``name`` from server cache ``mode`` divided by floor ``key``
    ("floor", "fresh_floor") of the same round, for each round where both were measured."""
    floors = results["floors"].get(f"{key}_{mode}", [])
    out = []
    for r in results["runs"]:
        repeat, weights = r.get("repeat"), r.get("load_weights_s")
        if r["format"] == name and r["mode"] == mode and weights and repeat < len(floors):
            out.append(weights / floors[repeat])
    return out


def _round_ratios(results: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "`load_weights` over the floors of its own round (median, lowest-highest, every round):",
        "",
        "| format | server cache | x fresh-memory floor | spread | x floor | spread "
        "| x fresh-memory floor, each round |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        if row["format"].endswith(SERVED) or not row["ok"]:
            continue
        name, mode = row["format"], row["mode"]
        fresh = per_round(results, name, mode, "fresh_floor")
        touched = per_round(results, name, mode, "floor")
        if not fresh or not touched:
            continue
        lines.append(
            f"| {name} | {mode} | {statistics.median(fresh):.2f} "
            f"| {min(fresh):.2f}-{max(fresh):.2f} | {statistics.median(touched):.2f} "
            f"| {min(touched):.2f}-{max(touched):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in fresh)} |"
        )
    return lines


def main() -> None:
    if sys.argv[1:2] == ["--floor"]:  # a floor in this fresh process (floor_in_process)
        url, model, state = sys.argv[2:5]
        print(floor_ranged_gets(url, _shards(Path(model)), touched=state == "touched"))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--workdir", default="/tmp/fastload-vllm-bench")
    parser.add_argument("--out", default="benches/results")
    parser.add_argument("--modes", default="cold,warm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--formats", default="fastload,runai_streamer")
    parser.add_argument("--render", help="write the tables again from this results JSON file")
    parser.add_argument(
        "--serve", action="store_true", help="also time `vllm serve` to the first token"
    )
    args = parser.parse_args()
    if args.render:
        results = json.loads(Path(args.render).read_text())
        size = results["model_bytes"]
        save(Path(args.out), f"vllm-s3-{size / (1 << 30):.1f}GiB", results, markdown(results))
        return

    from s3_server import S3Server

    from fastload.core.store.object_store import download_files

    work = Path(args.workdir)
    model = make_model(work, args.layers)
    root = Path(tempfile.mkdtemp(prefix="s3-root-", dir=work))
    server = S3Server(root)
    try:
        # uploaded, not placed: s3s-fs keeps an uploaded object's checksum, and hashes a placed
        # file on every request
        server.bucket(BUCKET)
        url = server.upload(model, BUCKET, "llama")
        os.environ.update(server.env())
        os.environ.update(
            AWS_EC2_METADATA_DISABLED="true",
            AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
            AWS_CONFIG_FILE="/nonexistent",
            RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
        )
        config = work / "llama-config-only"
        shutil.rmtree(config, ignore_errors=True)
        download_files(url, config)  # what `fastload fetch URL DIR` does
        formats: dict[str, tuple[str, dict[str, Any]]] = {
            "fastload": (
                str(config),
                {"load_format": "fastload", "model_loader_extra_config": {"weights": url}},
            ),
            "runai_streamer": (url, {"load_format": "runai_streamer"}),
        }
        results = describe(model, args.repeats, "vllm_s3_bench.py")
        results.update(floors={}, runs=[])
        size = results["model_bytes"]
        names = ["floor", "fresh_floor", *args.formats.split(",")]
        for repeat in range(args.repeats):
            for name in rotated(names, repeat):
                if name in ("floor", "fresh_floor"):
                    for mode in args.modes.split(","):
                        _server_cache(root, mode)
                        took = floor_in_process(url, model, touched=name == "floor")
                        results["floors"].setdefault(f"{name}_{mode}", []).append(took)
                        print(json.dumps({"repeat": repeat, name: took, "mode": mode}), flush=True)
                    continue
                target, kwargs = formats[name]
                for mode in args.modes.split(","):
                    _server_cache(root, mode)
                    r = run_format(target, name, kwargs, mode, set_cache=False, poll=False)
                    r["repeat"] = repeat
                    print(json.dumps(r), flush=True)
                    results["runs"].append(r)
                    if args.serve:
                        _server_cache(root, mode)
                        r = serve_first_token(target, name, kwargs, mode)
                        r["repeat"] = repeat
                        print(json.dumps(r), flush=True)
                        results["runs"].append(r)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)  # the store's copy of the checkpoint
    results["floor_s"] = {k: statistics.median(v) for k, v in results["floors"].items()}
    results["summary"] = summarize(results)
    save(Path(args.out), f"vllm-s3-{size / (1 << 30):.1f}GiB", results, markdown(results))


if __name__ == "__main__":
    main()
