"""A diffusers pipeline from object storage: diffusers under ``fastload.patch_diffusers()`` reading
``s3://`` against downloading the pipeline then loading it with diffusers, beside the floor of
ranged GETs of the same bytes measured in the same run.

    python benches/pipeline_s3_bench.py [--gib 2] [--repeats 3] [--workdir DIR] [--out DIR]

The pipeline of ``benches/pipeline_bench.py`` (a scaled-down FLUX.1 of about ``--gib`` GiB of bf16
weights, made once under --workdir) is uploaded with boto3 to a local S3-compatible server (s3s-fs
on 127.0.0.1, the tests' server: tests/support/s3_server.py), which serves it from its page cache
(one untimed read of every object first). Every run is a fresh interpreter, round robin; each
imports what it uses before the clock, loads, touches one byte per 4 KiB page of every weight, and
reports its time and its peak RSS above the RSS before the clock (``VmHWM``). Methods:

* ``floor(ranged GETs)``: every weight file's bytes into preallocated buffers with 8 MiB ranged
  GETs, 16 at a time (``fastload.core.store.object_store.read_into``: fastload's HTTP client
  without the engine);
* ``fastload``: ``DiffusionPipeline.from_pretrained("s3://bench/<prefix>/", dtype=torch.bfloat16)``
  under ``fastload.patch_diffusers()``;
* ``download+diffusers``: every object of the prefix downloaded with boto3's ``download_file``
  (its default multipart transfer) into a temporary folder, then diffusers'
  ``DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)`` (diffusers cannot read
  ``s3://``);
* ``floor(http ranged GETs)`` and ``fastload (http)``: the same over plain ``http://`` (a second
  s3s-fs on the same folder, no credentials asked: an object's URL is
  ``http://127.0.0.1:<port>/bench/<key>``), each load over the floor of its own protocol.

Writes ``pipeline-s3-<gib>GiB.json`` and ``.md`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_this_checkout  # noqa: E402

BUCKET = "bench"
RANGE = 8 << 20
PARALLEL = 16
FLOOR = "floor(ranged GETs)"
FLOOR_HTTP = "floor(http ranged GETs)"
HTTP = "fastload (http)"
METHODS = [FLOOR, "fastload", "download+diffusers", FLOOR_HTTP, HTTP]
GIB = 1 << 30


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(method: str, prefix: str) -> dict[str, Any]:
    """One load of ``s3://bench/<prefix>/`` in this fresh process."""
    import concurrent.futures as futures

    import boto3
    import diffusers
    import torch
    import transformers  # noqa: F401 - imported before the clock, as diffusers' components are
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel  # noqa: F401
    from transformers import CLIPTextModel, T5EncoderModel  # noqa: F401

    import fastload
    import fastload.diffusion.patch  # noqa: F401 - fastload's layers, before the clock
    import fastload.diffusion.remote_pipeline  # noqa: F401
    import fastload.hf.patch  # noqa: F401
    from fastload.core.store import object_store
    from fastload.tools.bench.loaders import _touch

    http = method in (FLOOR_HTTP, HTTP)
    url = (
        f"{os.environ['FASTLOAD_BENCH_HTTP']}/{BUCKET}/{prefix}/"
        if http
        else f"s3://{BUCKET}/{prefix}/"
    )
    kwargs = {"dtype": torch.bfloat16, "tokenizer": None, "tokenizer_2": None}
    client = boto3.client("s3")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]]
    weights = [k for k in keys if k.endswith(".safetensors")]
    store = object_store.open_store(url)
    # an http store's keys are paths from the host (the bucket first)
    weights = [f"{BUCKET}/{k}" if http else k for k in weights]
    sizes = {k: store.head(k)[0] for k in weights}
    floor = method in (FLOOR, FLOOR_HTTP)
    buffers = {k: torch.empty(n, dtype=torch.uint8) for k, n in sizes.items()} if floor else {}
    rss0 = _status("VmRSS")
    t0 = time.perf_counter()
    if floor:
        jobs = [(k, a, min(a + RANGE, n)) for k, n in sizes.items() for a in range(0, n, RANGE)]
        with futures.ThreadPoolExecutor(PARALLEL) as pool:
            list(
                pool.map(
                    lambda j: object_store.read_into(store, j[0], j[1], buffers[j[0]][j[1] : j[2]]),
                    jobs,
                )
            )
        _touch(list(buffers.values()))
    else:
        with tempfile.TemporaryDirectory(dir=os.environ.get("FASTLOAD_BENCH_DOWNLOADS")) as d:
            if method in ("fastload", HTTP):
                with fastload.patch_diffusers():
                    pipe = diffusers.DiffusionPipeline.from_pretrained(url, **kwargs)
            elif method == "download+diffusers":
                for key in keys:
                    local = Path(d) / key[len(prefix) + 1 :]
                    local.parent.mkdir(parents=True, exist_ok=True)
                    client.download_file(BUCKET, key, str(local))
                pipe = diffusers.DiffusionPipeline.from_pretrained(d, **kwargs)
            else:
                raise SystemExit(f"unknown method {method!r}")
            tensors = [
                t
                for c in pipe.components.values()
                if isinstance(c, torch.nn.Module)
                for t in c.state_dict().values()
            ]
            _touch(tensors)
    return {
        "seconds": time.perf_counter() - t0,
        "peak_rss_above_start": _status("VmHWM") - rss0,
        "bytes": sum(sizes.values()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from s3_server import S3Server

    from fastload.tools.bench.run import compile_fastload
    from pipeline_bench import make_pipeline

    compile_fastload()
    folder = make_pipeline(args.workdir, args.gib)
    root = Path(tempfile.mkdtemp(prefix="s3-root-", dir=args.workdir))
    server = S3Server(root)
    anonymous = S3Server(root, anonymous=True)  # the same objects over plain http
    prefix = folder.name
    runs: list[dict[str, Any]] = []
    try:
        server.bucket(BUCKET)
        client = server.client()
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder)}")
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            **server.env(),
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_CONFIG_FILE": "/nonexistent",
            "FASTLOAD_BENCH_DOWNLOADS": str(args.workdir),
            "FASTLOAD_DISABLE_PROGRESS_BARS": "1",
            "FASTLOAD_BENCH_HTTP": anonymous.endpoint,
        }

        def once(method: str) -> dict[str, Any]:
            cmd = [sys.executable, __file__, "--child", method, prefix]
            done = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=1800, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(f"{method} failed:\n{done.stderr[-3000:]}")
            return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

        once(FLOOR)  # untimed: the server's page cache holds the objects
        for rep in range(args.repeats):
            for method in args.methods:
                row = once(method) | {"method": method, "repeat": rep}
                runs.append(row)
                print(
                    f"[pipeline-s3-bench] {rep} {method:20} {row['seconds']:.3f} s, peak "
                    f"{row['peak_rss_above_start'] / GIB:.2f} GiB",
                    flush=True,
                )
    finally:
        server.stop()
        anonymous.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"runs": runs, "bytes": runs[0]["bytes"]}


def table(result: dict[str, Any], command: str, load: dict[str, Any]) -> str:
    times: dict[str, list[float]] = {}
    rss: dict[str, list[int]] = {}
    for r in result["runs"]:
        times.setdefault(r["method"], []).append(r["seconds"])
        rss.setdefault(r["method"], []).append(r["peak_rss_above_start"])
    med = {m: statistics.median(t) for m, t in times.items()}
    lines = [
        f"A {result['bytes'] / GIB:.2f} GiB diffusers pipeline (bf16 weights, 7 files) from s3s-fs "
        "on 127.0.0.1; fresh process per run, round robin, medians; timed to the last page of "
        "every weight touched. `x floor`: median / the ranged-GET floor's of the same protocol. "
        "`x download+diffusers`: its median / this one (above 1: faster).",
        "",
        "| method | time s | peak RSS GiB | x floor | x download+diffusers |",
        "|---|---|---|---|---|",
    ]
    for m in [m for m in METHODS if m in med]:
        base = FLOOR_HTTP if m in (FLOOR_HTTP, HTTP) and FLOOR_HTTP in med else FLOOR
        other = med.get("download+diffusers", float("nan"))
        lines.append(
            f"| {m} | {med[m]:.3f} ({min(times[m]):.3f}-{max(times[m]):.3f}) | "
            f"{statistics.median(rss[m]) / GIB:.2f} | {med[m] / med[base]:.2f} | "
            f"{other / med[m]:.2f} |"
        )
    lines += [
        "",
        f"Machine: {load['cpus']} CPUs, {load['platform']}; load average before "
        f"{load['before']}, after {load['after']}.",
        "",
        f"Command: `{command}`",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    use_this_checkout()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fastload-pipeline-bench"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    args.methods = [m for m in args.methods.split(",") if m]
    load = {"cpus": os.cpu_count(), "platform": platform.platform()}
    load["before"] = [round(x, 2) for x in os.getloadavg()]
    result = run(args)
    load["after"] = [round(x, 2) for x in os.getloadavg()]
    command = " ".join(["python", *sys.argv])
    text = table(result, command, load)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"pipeline-s3-{args.gib:g}GiB"
        stem.with_suffix(".json").write_text(json.dumps(result | {"command": command}, indent=1))
        stem.with_suffix(".md").write_text(f"# A diffusers pipeline from S3\n\n{text}")


if __name__ == "__main__":
    main()
