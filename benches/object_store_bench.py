"""Loading from object storage: fastload against Run:ai Model Streamer's S3 path and against
download-then-load, with the network floor measured in the same run.

    python benches/object_store_bench.py [--gib 1] [--repeats 3] [--workdir /tmp/fastload-s3-bench]
        [--out benches/results/object-store-1GiB] [--loaders floor(ranged GETs),fastload,...]

The benchmark Llama of ``fastload.tools.bench.run`` (bf16, one ``model.safetensors``) is uploaded
with boto3 to a local S3-compatible server (s3s-fs on 127.0.0.1, the server of the tests:
tests/support/s3_server.py; ``scripts/s3-server.sh`` installs it), which serves it from its page
cache (one untimed read first, so that every loader finds it warm). Then every loader runs in a
fresh interpreter, ``--repeats`` times round robin, with the AWS variables pointing at the server;
each child imports what it needs before the clock, runs one load, touches one byte per page of every
tensor, and reports the wall time and its peak resident memory (VmHWM) above what was resident
before the load. Loaders:

* ``floor(ranged GETs)``: every byte of the object into one preallocated buffer with 8 MiB
  ranged GETs, 16 at a time (``fastload.core.store.object_store.read_into``: the same HTTP client as
  fastload's, without the engine);
* ``floor(curl)``: the same ranges with ``curl --parallel --parallel-max 16`` (libcurl, signed
  with ``--aws-sigv4``) into ``/dev/null``: an independent client that writes nothing to memory;
* ``fastload``: ``fastload.from_pretrained(LlamaForCausalLM, "s3://bench/<prefix>/")``;
* ``fastload(load_file)``: ``fastload.load_file("s3://.../model.safetensors")``;
* ``runai-model-streamer``: a meta skeleton, ``SafetensorsStreamer.stream_file("s3://...")``,
  ``get_tensors()``, ``load_state_dict(assign=True)`` (runai-model-streamer-s3, its defaults);
* ``boto3 download+fastload``: ``boto3`` ``download_file`` (its default multipart transfer) of
  the checkpoint to a local directory, then ``fastload.from_pretrained`` of it;
* ``fastload(cuda)`` (where CUDA is available): ``fastload.from_pretrained(..., device="cuda")``,
  the bytes staged through the pinned pool: host memory stays at the pool's size, not the
  model's; after the clock the model is compared bit for bit with a local CPU load.

Each time is also given as a ratio to the faster floor of the same run. Writes
``<out>.json`` (raw figures, the machine, the command) and ``<out>.md`` (the table).
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

GIB = 1 << 30
RANGE = 8 << 20
PARALLEL = 16
BUCKET = "bench"

LOADERS = {
    "floor(ranged GETs)": "8 MiB ranged GETs, 16 at a time, into one preallocated buffer "
    "(fastload's HTTP client, no engine)",
    "floor(curl)": "the same ranges with curl --parallel-max 16 into /dev/null",
    "fastload": "fastload.from_pretrained(LlamaForCausalLM, 's3://bench/<prefix>/')",
    "fastload(load_file)": "fastload.load_file('s3://bench/<prefix>/model.safetensors')",
    "runai-model-streamer": "meta skeleton, runai SafetensorsStreamer.stream_file('s3://...'), "
    "get_tensors, load_state_dict(assign=True)",
    "boto3 download+fastload": "boto3 download_file to a local directory, then "
    "fastload.from_pretrained of it",
    "fastload(cuda)": "fastload.from_pretrained(LlamaForCausalLM, 's3://bench/<prefix>/', "
    "device='cuda'), through the 128 MiB pinned staging pool",
}
FLOORS = ("floor(ranged GETs)", "floor(curl)")


# ---------------------------------------------------------------------------------------------
# The child: one load in a fresh interpreter
# ---------------------------------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _touch(tensors: Any) -> None:
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.numel():
            float(flat[:: max(1, 4096 // flat.element_size())].float().sum())


def _ranges(size: int) -> list[tuple[int, int]]:
    return [(o, min(size, o + RANGE)) for o in range(0, size, RANGE)]


def _curl_config(url: str, key: str, size: int, env: dict[str, str]) -> str:
    region = env.get("AWS_REGION", "us-east-1")
    user = f"{env['AWS_ACCESS_KEY_ID']}:{env['AWS_SECRET_ACCESS_KEY']}"
    blocks = []
    for start, stop in _ranges(size):
        blocks.append(
            f'url = "{url}/{BUCKET}/{key}"\nrange = "{start}-{stop - 1}"\noutput = "/dev/null"\n'
            f'aws-sigv4 = "aws:amz:{region}:s3"\nuser = "{user}"\nsilent\nfail\n'
            'header = "x-amz-content-sha256: UNSIGNED-PAYLOAD"\n'
        )
    return "next\n".join(blocks)


def child(loader: str, prefix: str) -> dict[str, Any]:
    """One load of ``s3://bench/<prefix>/``; imports before the clock and the RSS baseline."""
    import concurrent.futures as futures

    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import fastload
    import fastload.api  # noqa: F401 - fastload's entry and its transformers layer, imported
    import fastload.hf.front  # noqa: F401   before the clock as the peers' code is
    from fastload.core.store import object_store

    url = f"s3://{BUCKET}/{prefix}/"
    key = f"{prefix}/model.safetensors"
    if loader == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer
    if loader.startswith("boto3"):
        import boto3

    if loader == "fastload(cuda)":
        torch.zeros(1, device="cuda")  # the CUDA context, as a server has it
    store = object_store.open_store(url)
    size = store.head(key)[0]
    buffer = None
    if loader == "floor(ranged GETs)":
        buffer = torch.empty(size, dtype=torch.uint8)
    rss0 = _status("VmRSS")
    t0 = time.perf_counter()
    produced: list[Any] = []
    if loader == "floor(ranged GETs)":
        assert buffer is not None
        with futures.ThreadPoolExecutor(PARALLEL) as pool:
            list(
                pool.map(
                    lambda r: object_store.read_into(store, key, r[0], buffer[r[0] : r[1]]),
                    _ranges(size),
                )
            )
        produced = [buffer]
    elif loader == "floor(curl)":
        with tempfile.NamedTemporaryFile("w", suffix=".cfg") as cfg:
            cfg.write(_curl_config(os.environ["AWS_ENDPOINT_URL"], key, size, dict(os.environ)))
            cfg.flush()
            subprocess.run(
                ["curl", "-Z", "--parallel-max", str(PARALLEL), "-K", cfg.name], check=True
            )
    elif loader == "fastload":
        model = fastload.from_pretrained(LlamaForCausalLM, url, progress=False)
        produced = list(model.parameters())
    elif loader == "fastload(cuda)":
        model = fastload.from_pretrained(LlamaForCausalLM, url, device="cuda", progress=False)
        torch.cuda.synchronize()
        produced = list(model.parameters())
    elif loader == "fastload(load_file)":
        produced = list(fastload.load_file(url + "model.safetensors").values())
    elif loader == "runai-model-streamer":
        config = AutoConfig.from_pretrained(Path(os.environ["FASTLOAD_BENCH_CONFIG"]))
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(url + "model.safetensors")
            state = dict(streamer.get_tensors())
        model.load_state_dict(state, strict=False, assign=True)
        produced = list(model.parameters())
    elif loader == "boto3 download+fastload":
        client = boto3.client("s3")
        with tempfile.TemporaryDirectory(dir=os.environ.get("FASTLOAD_BENCH_DOWNLOADS")) as d:
            for name in ("config.json", "model.safetensors"):
                client.download_file(BUCKET, f"{prefix}/{name}", str(Path(d) / name))
            model = fastload.from_pretrained(LlamaForCausalLM, d, progress=False)
            produced = list(model.parameters())
    else:
        raise SystemExit(f"unknown loader {loader!r}")
    _touch(produced)
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {
        "seconds": seconds,
        "peak_rss_over_baseline": max(0, _status("VmHWM") - rss0),
    }
    if loader == "fastload(cuda)":  # after the clock: the same bits as a local CPU load
        local = fastload.load_file(Path(os.environ["FASTLOAD_BENCH_CONFIG"]) / "model.safetensors")
        state = model.state_dict()
        out["bitwise_equal"] = all(
            torch.equal(state[k].cpu().view(torch.uint8), v.view(torch.uint8))
            for k, v in local.items()
        )
    return out


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------


def _server(root: Path) -> tuple[Any, dict[str, str]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from s3_server import S3Server

    server = S3Server(root)
    return server, server.env()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from fastload.tools.bench.run import compile_fastload, make_checkpoint

    compile_fastload()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = make_checkpoint(work, args.gib, "bfloat16")
    root = Path(tempfile.mkdtemp(prefix="s3-root-", dir=work))
    server, env = _server(root)
    prefix = f"llama-{args.gib:g}GiB-bfloat16"
    try:
        server.bucket(BUCKET)
        client = server.client()
        for name in ("config.json", "model.safetensors"):
            client.upload_file(str(checkpoint / name), BUCKET, f"{prefix}/{name}")
        size = (checkpoint / "model.safetensors").stat().st_size
        child_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            **env,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_CONFIG_FILE": "/nonexistent",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "FASTLOAD_BENCH_CONFIG": str(checkpoint),
            "FASTLOAD_BENCH_DOWNLOADS": str(work),
            "FASTLOAD_DISABLE_PROGRESS_BARS": "1",
        }

        def once(loader: str) -> dict[str, Any]:
            cmd = [sys.executable, __file__, "--child", loader, prefix]
            done = subprocess.run(
                cmd, capture_output=True, text=True, env=child_env, timeout=1800, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(f"{loader} failed:\n{done.stderr[-3000:]}")
            return json.loads(done.stdout.strip().splitlines()[-1])

        once("floor(ranged GETs)")  # untimed: the server's page cache holds the object
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.loaders}
        for r in range(args.repeats):
            for loader in args.loaders:
                got = once(loader)
                runs[loader].append(got)
                print(
                    f"[bench] run {r + 1}/{args.repeats} {loader}: {got['seconds']:.3f} s, "
                    f"peak RSS +{got['peak_rss_over_baseline'] / (1 << 20):.0f} MiB",
                    flush=True,
                )
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)  # the store's copy of the object
    return {"object_bytes": size, "runs": runs}


def summarize(result: dict[str, Any], args: argparse.Namespace, command: str) -> dict[str, Any]:
    size = result["object_bytes"]
    rows = {}
    for loader, runs in result["runs"].items():
        seconds = [r["seconds"] for r in runs]
        rows[loader] = {
            "median_s": statistics.median(seconds),
            "all_s": seconds,
            "gbps": size / statistics.median(seconds) / 1e9,
            "peak_rss_over_baseline_mib": statistics.median(
                r["peak_rss_over_baseline"] for r in runs
            )
            / (1 << 20),
        }
        if any("bitwise_equal" in r for r in runs):
            rows[loader]["bitwise_equal"] = all(r.get("bitwise_equal") for r in runs)
    floors = [rows[f]["median_s"] for f in FLOORS if f in rows]
    floor = min(floors) if floors else None
    for row in rows.values():
        row["x_floor"] = row["median_s"] / floor if floor else None
    return {
        "command": command,
        "object": f"s3://{BUCKET}/llama-{args.gib:g}GiB-bfloat16/model.safetensors",
        "object_bytes": size,
        "repeats": args.repeats,
        "server": "s3s-fs 0.14.0 on 127.0.0.1, object in its page cache",
        "machine": _machine(),
        "floor_s": floor,
        "loaders": {name: LOADERS[name] for name in rows},
        "rows": rows,
    }


def _machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # other work on the machine during the run (the server and the client share the CPUs)
        "load_average_1_5_15min_at_the_end": os.getloadavg(),
    }


def markdown(summary: dict[str, Any]) -> str:
    model_mib = summary["object_bytes"] / (1 << 20)
    machine = summary["machine"]
    where = f"{machine['cpus']} CPUs" + (f", {machine['gpu']}" if machine["gpu"] else "")
    lines = [
        f"{summary['object_bytes'] / GIB:.2f} GiB bf16 from {summary['server']} ({where}), "
        f"median of {summary['repeats']}, fresh process per run; peak RSS above the "
        f"baseline, and above the model's {model_mib:.0f} MiB",
        "",
        "| loader | seconds | x floor | GB/s | peak RSS (MiB) | over the model (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for loader, row in summary["rows"].items():
        rss = row["peak_rss_over_baseline_mib"]
        over = "" if loader == "floor(curl)" else f"{rss - model_mib:+.0f}"
        if loader == "fastload(cuda)":
            over = "(on the GPU)" + (" bitwise equal" if row.get("bitwise_equal") else " DIFFERS")
        lines.append(
            f"| {loader} | {row['median_s']:.3f} | {row['x_floor']:.2f}x | {row['gbps']:.2f} | "
            f"{'n/a (curl)' if loader == 'floor(curl)' else f'{rss:.0f}'} | {over} |"
        )
    lines += ["", f"Command: `{summary['command']}`", ""]
    lines += [f"* `{name}`: {what}" for name, what in summary["loaders"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("LOADER", "PREFIX"))
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loaders", default=None, help="default: all (fastload(cuda) with CUDA)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fastload-s3-bench"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    if args.loaders is None:
        import torch

        cuda = torch.cuda.is_available()
        args.loaders = ",".join(k for k in LOADERS if cuda or k != "fastload(cuda)")
    args.loaders = [x for x in args.loaders.split(",") if x]
    unknown = [x for x in args.loaders if x not in LOADERS]
    if unknown:
        parser.error(f"unknown loaders {unknown}; known: {list(LOADERS)}")
    command = "python benches/object_store_bench.py " + " ".join(argv or sys.argv[1:])
    summary = summarize(run(args), args, command)
    text = markdown(summary)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
