"""vLLM serving a checkpoint from object storage: fastload's ``weights`` option against vLLM's
``runai_streamer`` (an ``s3://`` model), beside the transport floor.

    bash scripts/vllm-env.sh   # once: the vLLM environment (prints its python)
    ~/.cache/fastload/vllm-venv/bin/python benches/vllm_s3_bench.py [--repeats 3] [--out DIR]

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
``load_model``, memory from the OS). The floor, once per repeat: every byte of the shards fetched
with 8 MiB ranged GETs, 16 at a time, into one preallocated buffer (fastload's HTTP client, no
engine, nothing else), with the server's cache warm; twice: into a buffer touched before (the
transport alone) and into fresh memory (the transport plus the page faults of a first write,
which any first load pays for the model's memory). With ``--serve``, each run is followed by
``vllm serve`` of the same format timed from process start to the first token
(benches/vllm_serve.py). Writes ``vllm-s3-<size>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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
        "Cold/warm: the server's page cache.",
        "",
        *(
            f"- {key.replace('fresh_floor', 'fresh-memory floor').replace('_', ', ')}: "
            f"{floors[key]:.2f} s (runs: {runs(key)})"
            for key in sorted(floors)
        ),
        "",
        "| format | server cache | load_weights s | x floor | x fresh-memory floor | post s "
        "| load_model s | engine s | peak RSS in load GiB | RSS after load GiB | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    served = [row for row in results["summary"] if row["format"].endswith(SERVED)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--workdir", default="/tmp/fastload-vllm-bench")
    parser.add_argument("--out", default="benches/results")
    parser.add_argument("--modes", default="cold,warm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--serve", action="store_true", help="also time `vllm serve` to the first token"
    )
    args = parser.parse_args()

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
        names = list(formats)
        for repeat in range(args.repeats):
            for mode in args.modes.split(","):
                for touched, key in ((True, "floor"), (False, "fresh_floor")):
                    _server_cache(root, mode)
                    took = floor_ranged_gets(url, _shards(model), touched=touched)
                    results["floors"].setdefault(f"{key}_{mode}", []).append(took)
            print(json.dumps({"repeat": repeat, "floors": results["floors"]}), flush=True)
            for name in rotated(names, repeat):
                target, kwargs = formats[name]
                for mode in args.modes.split(","):
                    _server_cache(root, mode)
                    r = run_format(target, name, kwargs, mode, set_cache=False)
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
