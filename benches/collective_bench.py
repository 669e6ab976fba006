"""Collective loading: per-rank storage reads and wall time of a cold load with 1, 2 and 4 ranks.

    python benches/collective_bench.py [--gib 1] [--ranks 1,2,4] [--workdir /tmp/fastload-bench]

Each rank (gloo, this machine's CPU) loads its own copy of the benchmark Llama (bf16, one
file), evicted from the page cache just before, all ranks starting together. Loaders:

* ``fastload(process_group)``: a collective load, each rank reading its part;
* ``fastload(each reads all)``: every rank loads alone (``mmap="copy"``: its own memory, as a
  rank's copy of a replicated model is);
* ``fastload(tp_plan=auto)`` and ``transformers(tp_plan=auto)``: transformers' tensor
  parallelism (DTensors) through fastload and through transformers itself.

Per rank, the kernel's count of bytes the process fetched from storage (``read_bytes`` of
``/proc/self/io``) and the load's wall time (from the barrier after eviction); a markdown table
of the slowest rank's time and the mean storage bytes per rank is printed, and the raw
figures are written as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastload.core.memory.page_cache import evict

LOADERS = (
    "fastload(process_group)",
    "fastload(each reads all)",
    "fastload(tp_plan=auto)",
    "transformers(tp_plan=auto)",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _storage_reads() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _load(loader: str, directory: Path) -> Any:
    import transformers

    import fastload

    cls = transformers.LlamaForCausalLM
    if loader == "fastload(process_group)":
        return fastload.from_pretrained(cls, directory, process_group=dist.group.WORLD,
                                        progress=False)  # fmt: skip
    if loader == "fastload(each reads all)":
        return fastload.from_pretrained(cls, directory, mmap="copy", progress=False)
    if loader == "fastload(tp_plan=auto)":
        return fastload.from_pretrained(cls, directory, tp_plan="auto", progress=False)
    return cls.from_pretrained(directory, tp_plan="auto")


def _rank(rank: int, world: int, port: int, root: str, loaders: list[str], out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    # imports outside the clock: the model's module, fastload's loading modules
    import transformers

    import fastload
    import fastload.core.loading  # noqa: F401
    import fastload.hf.dtensor_tp  # noqa: F401

    transformers.LlamaForCausalLM  # noqa: B018  (imports the Llama module)

    own = Path(root) / f"rank{rank}"
    results = {}
    for loader in loaders:
        if world == 1 and "tp_plan" in loader:
            continue
        evict(own / "model.safetensors")
        dist.barrier()
        before, start = _storage_reads(), time.perf_counter()
        model = _load(loader, own)
        dist.barrier()  # the load ends when the slowest rank is done
        seconds = time.perf_counter() - start
        results[loader] = {"seconds": seconds, "storage_bytes": _storage_reads() - before}
        del model
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fastload-bench"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from fastload.tools.bench.run import make_checkpoint

    checkpoint = make_checkpoint(args.workdir, args.gib, "bfloat16")
    size = (checkpoint / "model.safetensors").stat().st_size
    loaders = args.loaders.split(",")
    table = {}
    for world in map(int, args.ranks.split(",")):
        root = args.workdir / f"collective-{world}"
        shutil.rmtree(root, ignore_errors=True)
        for rank in range(world):
            (root / f"rank{rank}").mkdir(parents=True)
            for f in checkpoint.iterdir():
                if f.name != "pytorch_model.bin":
                    shutil.copy(f, root / f"rank{rank}" / f.name)
        mp.spawn(_rank, args=(world, free_port(), str(root), loaders, str(root)), nprocs=world)
        ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]
        table[world] = {
            loader: {
                "seconds": max(r[loader]["seconds"] for r in ranks),
                "storage_bytes_per_rank": statistics.mean(
                    r[loader]["storage_bytes"] for r in ranks
                ),
                "ranks": [r[loader] for r in ranks],
            }
            for loader in loaders
            if loader in ranks[0]
        }
        shutil.rmtree(root)
    print(f"cold load of {checkpoint.name} ({size / 2**30:.2f} GiB), each rank its own copy")
    print("| ranks | loader | wall time (slowest rank) | storage read per rank (of the file) |")
    print("|---|---|---|---|")
    for world, rows in table.items():
        for loader, row in rows.items():
            share = row["storage_bytes_per_rank"] / size
            print(f"| {world} | {loader} | {row['seconds']:.2f} s | "
                  f"{row['storage_bytes_per_rank'] / 2**20:.0f} MiB ({share:.2f}) |")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"size": size, "results": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
