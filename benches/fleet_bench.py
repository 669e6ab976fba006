"""A fleet started from one bucket: bytes each rank fetched from the store and the load's time,
for collective loads from object storage with 2 and 4 ranks, against independent loads and one
node's floor at the bucket's bandwidth, measured in the same run.

    python benches/fleet_bench.py [--gib 0.25] [--ranks 2,4] [--cap-mbps 60] [--repeats 2]
        [--shared] [--tp] [--workdir /tmp/fastload-fleet-bench] [--out benches/results/fleet-256MiB]

The benchmark Llama of ``fastload.tools.bench.run`` (bf16, one ``model.safetensors``) is served
by the tests' S3-compatible server (s3s-fs on 127.0.0.1, tests/support/s3_server.py). Each rank (a
gloo process on this machine, loopback) reaches it through its own proxy, which counts the bytes of
the answers it forwards to that rank (outside fastload), and every proxy draws on one shared
token bucket of ``--cap-mbps`` MB/s: the bucket's bandwidth, which all ranks share. Runs, round
robin, ``--repeats`` times:

* ``floor``: one process fetching every byte of the object with 8 MiB ranged GETs, 16 at a
  time, into one buffer (``fastload.core.store.object_store.read_into``: no engine): one node's time
  at the capped bandwidth;
* ``fastload, 1 rank``: ``from_pretrained(LlamaForCausalLM, "s3://...")`` alone;
* ``fastload(process_group), N ranks``: the same call with ``process_group=WORLD`` on N ranks;
* ``independent, N ranks``: N ranks each loading alone at the same time (what a fleet does
  today);
* ``fastload(tp_plan), N ranks`` (``--tp``): the same call with ``tp_plan="llama"`` on N ranks,
  each keeping its shards (compared bitwise with the single-process load's tensors cut as the
  plan cuts them);
* ``share_fetch, N peers`` (``--shared``): N processes that are not one job (vLLM replicas)
  meeting at a rendezvous (``fastload.distributed.rendezvous``) and streaming the checkpoint's
  tensors as vLLM's ``--load-format fastload`` does with ``share_fetch``
  (``fastload.integrations.vllm.remote.RemoteWeights``: no model is built, so the row is the
  read alone).

Each rank's time runs from a barrier to a barrier after the load (the slowest rank's time);
after the clock each rank's state dict is hashed and compared with a local single-process load
(``bitwise``), and its peak resident memory (``VmHWM``) is taken, above what it held when the
load started (``/proc/self/statm``): the kernel's counts. Its private peak (anonymous memory:
the tensors, buffers and objects the load holds, without the shared libraries' code pages it ran)
is sampled from this process every 5 ms during the load (``_private_memory.py``). The CPU time
each rank spent in its load (``getrusage``, every thread), that of this process (the proxies,
the bucket and the memory sampler) and of the server, over the run, show when the machine's
cores, not the bucket, set the time: every process of the fleet runs on this one machine.
Writes ``<out>.json`` (raw figures, the command) and ``<out>.md`` (the table).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _fleet_link import CountingProxy, TokenBucket
from _private_memory import PrivateMemoryWatch, private_bytes

BUCKET = "bench"
RANGE = 8 << 20
PARALLEL = 16


# ---------------------------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------------------------


def _digest(tensors: dict[str, Any]) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        t = tensors[name]
        t = t.to_local() if hasattr(t, "to_local") else t  # a tensor-parallel rank's shard
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _shard_digests(model: Any, world: int) -> list[str]:
    """The :func:`_digest` of each rank's shards of ``model`` (a full single-process load) under
    the llama plan on ``world`` ranks."""
    from fastload.distributed.tensor_parallel import LLAMA_TP_PLAN, TPLayout

    state = dict(model.state_dict())
    out = []
    for rank in range(world):
        layout = TPLayout(LLAMA_TP_PLAN, rank, world)
        cut = {}
        for name, t in state.items():
            selection = layout.selection(name, t.shape)
            if selection is not None:
                dim, start, stop = selection
                t = t.narrow(dim, start, stop - start)
            cut[name] = t
        out.append(_digest(cut))
    return out


def _rss() -> int:
    """Bytes of this process resident now (the kernel's count)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """Bytes of this process resident at its peak so far (the kernel's ``VmHWM``, which starts
    anew at the process's exec; ``getrusage``'s peak would carry over the parent's from before
    the exec of a spawned child)."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _cpu() -> float:
    """CPU seconds this process has run so far, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pid: int) -> float:
    """CPU seconds process ``pid`` has run so far (``/proc/<pid>/stat``: user and system)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _held(tensors: dict[str, Any]) -> int:
    """Bytes of the storages under ``tensors`` (a tensor-parallel rank's: its shards')."""
    storages = {}
    for t in tensors.values():
        t = t.to_local() if hasattr(t, "to_local") else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _result(
    seconds: float,
    digest: str | None,
    before: int,
    held: int | None = None,
    window: tuple[float, float, int] = (0.0, 0.0, 0),
    cpu: float = 0.0,
) -> str:
    """A rank's figures: its time, its tensors' digest, and its peak resident memory, whole and
    above what it held when the load started; ``window``: the load's start and end
    (``time.monotonic``) and its private memory at the start, for the parent's samples;
    ``cpu``: the CPU seconds of its load."""
    peak = _peak()
    return json.dumps(
        {
            "seconds": seconds,
            "digest": digest,
            "peak_rss": peak,
            "peak_over_start": peak - before,
            "held": held,
            "window": window,
            "cpu_s": cpu,
            "pid": os.getpid(),
        }
    )


def _rank(rank: int, world: int, port: int, out: str, kind: str, url: str, env: dict) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env[rank], MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    import transformers

    import fastload
    import fastload.api  # noqa: F401 - imported before the clock
    import fastload.hf.front  # noqa: F401

    cls = transformers.LlamaForCausalLM
    extra: dict[str, Any] = {}
    if kind == "collective":
        extra = {"process_group": dist.group.WORLD}
    elif kind == "tp":
        extra = {"tp_plan": "llama"}
    dist.barrier()
    private, opened, cpu = private_bytes(), time.monotonic(), _cpu()
    before, start = _rss(), time.perf_counter()
    model = fastload.from_pretrained(cls, url, progress=False, **extra)
    loaded, cpu = time.monotonic(), _cpu() - cpu
    dist.barrier()  # the load ends when the slowest rank is done
    seconds = time.perf_counter() - start
    state = dict(model.state_dict())
    window = (opened, loaded, private)
    result = _result(seconds, _digest(state), before, _held(state), window, cpu)
    Path(out, f"rank{rank}.json").write_text(result)
    dist.barrier()
    dist.destroy_process_group()


def _peer(rank: int, world: int, port: int, out: str, url: str, env: dict) -> None:
    """A replica of a fleet with ``share_fetch``: the rendezvous, then vLLM's weight stream."""
    import torch

    from fastload.distributed.rendezvous import Rendezvous, join
    from fastload.integrations.vllm.remote import RemoteWeights

    os.environ.update(env[rank])
    torch.set_num_threads(1)
    group = join(Rendezvous("127.0.0.1", port, world, 600.0), f"bench:{url}")
    group.gather(None)  # every peer ready
    private, opened, cpu = private_bytes(), time.monotonic(), _cpu()
    before, start = _rss(), time.perf_counter()
    tensors = dict(RemoteWeights(url, group=group))
    loaded, cpu = time.monotonic(), _cpu() - cpu
    group.gather(None)  # the load ends when the slowest peer is done
    seconds = time.perf_counter() - start
    window = (opened, loaded, private)
    result = _result(seconds, _digest(tensors), before, _held(tensors), window, cpu)
    Path(out, f"rank{rank}.json").write_text(result)
    group.gather(None)
    os._exit(0)  # no teardown of the peers' group


def _floor(rank: int, out: str, url: str, env: dict) -> None:
    """One node: every byte of the object with ranged GETs into one buffer."""
    import concurrent.futures as futures

    import torch

    from fastload.core.store import object_store

    os.environ.update(env[rank])
    store = object_store.open_store(url)
    key = store.key.rstrip("/") + "/model.safetensors"
    size = store.head(key)[0]
    before = _rss()
    buffer = torch.empty(size, dtype=torch.uint8)
    ranges = [(o, min(size, o + RANGE)) for o in range(0, size, RANGE)]
    start, cpu = time.perf_counter(), _cpu()
    with futures.ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(lambda r: object_store.read_into(store, key, r[0], buffer[r[0] : r[1]]),
                      ranges))  # fmt: skip
    seconds, cpu = time.perf_counter() - start, _cpu() - cpu
    Path(out, f"rank{rank}.json").write_text(_result(seconds, None, before, cpu=cpu))


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import shutil
    import tempfile

    import transformers

    import fastload
    from fastload.tools.bench.run import make_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from s3_server import S3Server

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = make_checkpoint(work, args.gib, "bfloat16")
    size = (checkpoint / "model.safetensors").stat().st_size
    local = fastload.from_pretrained(transformers.LlamaForCausalLM, checkpoint, progress=False)
    expected = _digest(dict(local.state_dict()))
    shards = {w: _shard_digests(local, w) for w in args.ranks} if args.tp else {}
    stored = _digest(fastload.load_file(checkpoint / "model.safetensors"))  # the stream's
    del local
    root = Path(tempfile.mkdtemp(prefix="s3-root-", dir=work))
    server = S3Server(root)
    prefix = f"llama-{args.gib:g}GiB-bfloat16"
    url = f"s3://{BUCKET}/{prefix}/"
    bucket = TokenBucket(args.cap_mbps * 1e6)
    configs = [("floor", 1), ("single", 1)]
    for world in args.ranks:
        configs += [("collective", world), ("independent", world)]
        if args.tp:
            configs.append(("tp", world))
        if args.shared:
            configs.append(("shared", world))
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        server.bucket(BUCKET)
        (root / BUCKET / prefix).mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(checkpoint / name, root / BUCKET / prefix / name)
            server.tag(BUCKET, f"{prefix}/{name}")
        for repeat in range(args.repeats):
            for kind, world in configs:
                proxies = [CountingProxy(server.port, bucket) for _ in range(world)]
                out = Path(tempfile.mkdtemp(prefix="ranks-", dir=work))
                env = [
                    {
                        **server.env(p.endpoint),
                        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                        "AWS_CONFIG_FILE": "/nonexistent",
                        "MASTER_ADDR": "127.0.0.1",
                        "GLOO_SOCKET_IFNAME": "lo",
                        "FASTLOAD_DISABLE_PROGRESS_BARS": "1",
                    }
                    for p in proxies
                ]
                if kind == "floor":
                    job, spawned = _floor, (str(out), url, env)
                elif kind == "shared":
                    job, spawned = _peer, (world, _free_port(), str(out), url, env)
                else:
                    mode = kind if kind in ("collective", "tp") else "alone"
                    job, spawned = _rank, (world, _free_port(), str(out), mode, url, env)
                # the proxies, the bucket and the memory sampler run in this process
                cpu, served = _cpu(), _cpu_of(server.process.pid)
                ranks = _spawn(job, spawned, world, out)
                cpu, served = _cpu() - cpu, _cpu_of(server.process.pid) - served
                shutil.rmtree(out)
                for p in proxies:
                    p.close()
                row = {
                    "seconds": max(r["seconds"] for r in ranks),
                    "peak_over_start": max(r["peak_over_start"] for r in ranks),
                    # the largest private peak above the start over that rank's tensors
                    "private_x_held": max(
                        r["private_over_start"] / r["held"] if r.get("held") else 0.0 for r in ranks
                    ),
                    "peak_rss": max(r["peak_rss"] for r in ranks),
                    # the largest peak above the start over what that rank's tensors hold
                    "peak_x_held": max(
                        r["peak_over_start"] / r["held"] if r.get("held") else 0.0 for r in ranks
                    ),
                    "store_bytes_per_rank": [p.sent for p in proxies],
                    "cpu_s": {
                        "loads": sum(r["cpu_s"] for r in ranks),
                        "proxies": cpu,
                        "server": served,
                    },
                    "bitwise": None
                    if kind == "floor"
                    else all(
                        r["digest"] == (stored if kind == "shared" else expected) for r in ranks
                    )
                    if kind != "tp"
                    else [r["digest"] for r in ranks] == shards[world],  # fmt: skip
                }
                label = _label(kind, world)
                runs.setdefault(label, []).append(row)
                print(f"[bench] run {repeat + 1}/{args.repeats} {label}: {row}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"object_bytes": size, "runs": runs}


def _spawn(job: Any, spawned: tuple, world: int, out: Path) -> list[dict[str, Any]]:
    """Runs ``job`` on ``world`` processes, watching their private memory from here; each
    rank's figures, with its private peak above its start (``private_over_start``)."""
    import torch.multiprocessing as mp

    context = mp.spawn(job, args=spawned, nprocs=world, join=False)
    watch = PrivateMemoryWatch(p.pid for p in context.processes)
    try:
        while not context.join():
            pass
    finally:
        watch.stop()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for rank in ranks:
        opened, loaded, private = rank["window"]
        rank["private_over_start"] = max(0, watch.peak(rank["pid"], opened, loaded) - private)
    return ranks


def _label(kind: str, world: int) -> str:
    return {
        "floor": "floor (one node, ranged GETs)",
        "single": "fastload, 1 rank",
        "collective": f"fastload(process_group), {world} ranks",
        "independent": f"independent loads, {world} ranks",
        "shared": f"share_fetch (vLLM's weight stream), {world} peers",
        "tp": f"fastload(tp_plan), {world} ranks",
    }[kind]


def summarize(result: dict[str, Any], args: argparse.Namespace, command: str) -> dict[str, Any]:
    import torch

    size = result["object_bytes"]
    rows = {}
    for label, runs in result["runs"].items():
        per_rank = [statistics.median(r["store_bytes_per_rank"][i] for r in runs)
                    for i in range(len(runs[0]["store_bytes_per_rank"]))]  # fmt: skip
        rows[label] = {
            "median_s": statistics.median(r["seconds"] for r in runs),
            "all_s": [r["seconds"] for r in runs],
            "store_bytes_per_rank": per_rank,
            "peak_over_start": statistics.median(r["peak_over_start"] for r in runs),
            "peak_rss": statistics.median(r["peak_rss"] for r in runs),
            "peak_x_held": statistics.median(r["peak_x_held"] for r in runs),
            "private_x_held": statistics.median(r["private_x_held"] for r in runs),
            "cpu_s": {k: statistics.median(r["cpu_s"][k] for r in runs) for k in runs[0]["cpu_s"]},
            "store_bytes_total": sum(per_rank),
            "bitwise": None if runs[0]["bitwise"] is None else all(r["bitwise"] for r in runs),
        }
    floor = rows["floor (one node, ranged GETs)"]["median_s"]
    for row in rows.values():
        row["x_floor"] = row["median_s"] / floor
        row["x_checkpoint_total"] = row["store_bytes_total"] / size
        row["max_share_per_rank"] = max(row["store_bytes_per_rank"]) / size
    return {
        "command": command,
        "object_bytes": size,
        "cap_mbps": args.cap_mbps,
        "repeats": args.repeats,
        "server": "s3s-fs 0.14.0 on 127.0.0.1; one counting proxy per rank, all drawing on one "
        f"{args.cap_mbps:g} MB/s token bucket (the bucket's bandwidth)",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_1_5_15min_at_the_end": os.getloadavg(),
        },
        "floor_s": floor,
        "rows": rows,
    }


def markdown(summary: dict[str, Any]) -> str:
    mib = summary["object_bytes"] / (1 << 20)
    lines = [
        f"{mib:.0f} MiB bf16 Llama from {summary['server']}; {summary['machine']['cpus']} CPUs, "
        f"gloo over loopback, median of {summary['repeats']} (round robin)",
        "",
        "| run | seconds (slowest rank) | x floor | from the store per rank (MiB) | "
        "largest share | total (x checkpoint) | peak RSS above the start, largest rank (x "
        "checkpoint) | peak above the start (x the rank's tensors) | private peak above the "
        "start (x the rank's tensors) | CPU s: the loads / proxies / server | bitwise |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, row in summary["rows"].items():
        per_rank = ", ".join(f"{b / (1 << 20):.1f}" for b in row["store_bytes_per_rank"])
        bitwise = {None: "", True: "equal", False: "DIFFERS"}[row["bitwise"]]
        held = f"{row['peak_x_held']:.2f}x" if row["peak_x_held"] else ""
        private = f"{row['private_x_held']:.3f}x" if row["private_x_held"] else ""
        cpu = " / ".join(f"{row['cpu_s'][k]:.1f}" for k in ("loads", "proxies", "server"))
        lines.append(
            f"| {label} | {row['median_s']:.2f} | {row['x_floor']:.2f}x | {per_rank} | "
            f"{row['max_share_per_rank']:.3f} | {row['x_checkpoint_total']:.3f}x | "
            f"{row['peak_over_start'] / (1 << 20):.0f} MiB "
            f"({row['peak_over_start'] / summary['object_bytes']:.2f}x) | "
            f"{held} | {private} | {cpu} | {bitwise} |"
        )
    lines += ["", f"Command: `{summary['command']}`", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.25)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--cap-mbps", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fastload-fleet-bench"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--shared", action="store_true", help="also N peers sharing a fetch (share_fetch)"
    )
    parser.add_argument(
        "--tp", action="store_true", help="also N tensor-parallel ranks (tp_plan='llama')"
    )
    args = parser.parse_args(argv)
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    command = "python benches/fleet_bench.py " + " ".join(argv or sys.argv[1:])
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
