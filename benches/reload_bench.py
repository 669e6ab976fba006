"""``fastload.reload`` on CPU, cold and warm, beside the read floor and the alternatives measured in
the same run.

    python benches/reload_bench.py [--gib 1] [--repeats 3] [--out benches/results]

Three checkpoints of one model (``--gib`` of bf16 tensors of 2048 x 4096, 16 MiB each, in one
file, saved with ``digests=True``) are made once under --workdir: ``a`` (what the model is loaded
from), ``b`` (every tensor different) and ``c`` (``a`` with 10% of the tensors changed). Every run
is a fresh process that first loads ``a`` (``from_pretrained(mmap="copy")``: memory of the model's
own, as after a first reload; not timed), then times one method. Before it the new checkpoint's
file is evicted from the page cache (``fsync`` + ``posix_fadvise(DONTNEED)``: cold) or read once
(warm); ``a`` is read once (warm) for the untimed load. Runs go round robin (every method and
cache state once, then again, ``--repeats`` times); the table gives medians. Methods:

* ``floor: pread``: 8 threads reading ``b`` in 64 MiB ``pread`` calls into buffers of their own:
  the storage's floor cold, the page cache's warm;
* ``floor: pread into the model``: the same 8 threads, each tensor's bytes read with one
  ``preadv`` straight into the loaded model's tensor (offsets from the header, parsed before the
  clock): the least any reload into the model's memory does;
* ``reload``: ``fastload.reload(model, b)`` into the loaded model;
* ``reload atomic``: the same with ``atomic=True`` (read into new tensors, then committed);
* ``reload atomic verify``: ``atomic=True, verify=True``: the staged bytes are also checked
  against the files' digests (BLAKE2b) before the commit;
* ``reload 10% changed``: ``fastload.reload(model, c)``: only the changed tensors are read (their
  digests differ from ``a``'s);
* ``from_pretrained anew``: ``fastload.from_pretrained(Model, b)``, a new model (defaults: views
  of the file where it is local), then one byte of every page read: a view's pages may still be
  on their way when the load returns (read-ahead paced by the first forward), and a reload
  returns with every byte in place;
* ``load_state_dict(load_file)``: ``model.load_state_dict(safetensors.torch.load_file(b))`` into
  the loaded model;
* ``transformers load_sharded_checkpoint``: transformers' own reload path, the one its
  ``Trainer`` resumes with (``transformers.trainer_utils.load_sharded_checkpoint(model, b)``:
  each shard read whole with ``safetensors.torch.load_file``, then ``load_state_dict``; ``b``
  carries a one-shard ``model.safetensors.index.json`` for it).

Ratios are floor time / method time (1.0: at the floor, below 1: slower); the 10% reload reads
a tenth of the bytes, so it can beat the floor of reading everything. Writes ``reload-cpu.json``
and ``reload-cpu.md`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

METHODS = [
    "floor: pread",
    "floor: pread into the model",
    "reload",
    "reload atomic",
    "reload atomic verify",
    "reload 10% changed",
    "from_pretrained anew",
    "load_state_dict(load_file)",
    "transformers load_sharded_checkpoint",
]
MODES = ["cold", "warm"]
READ = 64 << 20
SHAPE = (2048, 4096)  # 16 MiB in bf16


def _model_class(count: int) -> Any:
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ParameterList(
                nn.Parameter(torch.empty(SHAPE, dtype=torch.bfloat16)) for _ in range(count)
            )

    return Model


def make_checkpoints(work: Path, gib: float) -> tuple[int, int]:
    """``a``, ``b`` and ``c`` under ``work`` (made once); returns (tensors, tensors changed in
    ``c``)."""
    import torch

    import fastload

    count = max(10, int(gib * 64))
    changed = max(1, round(count / 10))
    if all((work / n / "model.safetensors").exists() for n in "abc"):
        _index(work / "b", count)
        return count, changed
    model = _model_class(count)()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(SHAPE, generator=gen))
    fastload.save_pretrained(model, work / "a", max_shard_size="1TB", digests=True)
    with torch.no_grad():
        for p in list(model.parameters())[:changed]:
            p.add_(1.0)
    fastload.save_pretrained(model, work / "c", max_shard_size="1TB", digests=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    fastload.save_pretrained(model, work / "b", max_shard_size="1TB", digests=True)
    _index(work / "b", count)
    return count, changed


def _index(directory: Path, count: int) -> None:
    """A one-shard ``model.safetensors.index.json`` in ``directory``: transformers'
    ``load_sharded_checkpoint`` reads only sharded checkpoints (fastload reads the same file
    through it)."""
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        weight_map = {f"layers.{i}": "model.safetensors" for i in range(count)}
        size = (directory / "model.safetensors").stat().st_size
        index.write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}))


def run_one(method: str, work: Path, count: int) -> dict[str, Any]:
    import safetensors.torch
    import torch

    import fastload

    model_cls = _model_class(count)
    model = fastload.from_pretrained(model_cls, work / "a", mmap="copy", progress=False)
    assert callable(fastload.reload)  # its module imported before the clock, as after a load
    new = work / ("c" if method == "reload 10% changed" else "b")
    path = new / "model.safetensors"
    out: dict[str, Any] = {}
    if method == "floor: pread":
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        offsets = list(range(0, size, READ))
        bufs = [bytearray(READ) for _ in range(8)]

        def reader(i: int) -> None:
            view = memoryview(bufs[i])
            for off in offsets[i::8]:
                os.preadv(fd, [view[: min(READ, size - off)]], off)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(reader, range(8)))
        seconds = time.perf_counter() - t0
        os.close(fd)
    elif method == "floor: pread into the model":
        seconds = _pread_into(model, path)
    elif method.startswith("reload"):
        t0 = time.perf_counter()
        atomic, verify = "atomic" in method, "verify" in method
        report = fastload.reload(model, new, atomic=atomic, verify=verify)
        seconds = time.perf_counter() - t0
        out["tensors_read"], out["tensors_unchanged"] = (
            report.tensors_read,
            report.tensors_unchanged,
        )
        out["bytes_read"] = report.bytes_read
    elif method == "from_pretrained anew":
        del model
        t0 = time.perf_counter()
        model = fastload.from_pretrained(model_cls, new, progress=False)
        for p in model.parameters():  # every page in memory, as the first forward would need
            p.detach().view(-1).view(torch.uint8)[::4096].sum()
        seconds = time.perf_counter() - t0
    elif method == "load_state_dict(load_file)":
        t0 = time.perf_counter()
        model.load_state_dict(safetensors.torch.load_file(path))
        seconds = time.perf_counter() - t0
    elif method == "transformers load_sharded_checkpoint":
        from transformers.trainer_utils import load_sharded_checkpoint

        t0 = time.perf_counter()
        load_sharded_checkpoint(model, new)
        seconds = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown method {method!r}")
    # the weights are the new ones (b: every tensor halved from c)
    if method != "floor: pread":
        got = next(iter(model.parameters()))
        want = safetensors.torch.load_file(path)["layers.0"]
        assert torch.equal(got, want), method
    out["seconds"] = seconds
    return out


def _pread_into(model: Any, path: Path) -> float:
    """Seconds for 8 threads to ``preadv`` each tensor of ``path`` into ``model``'s own."""
    import torch

    fd = os.open(path, os.O_RDONLY)
    header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
    header = json.loads(os.pread(fd, header_len, 8))
    params = dict(model.named_parameters())
    jobs = []
    for name, info in header.items():
        if name != "__metadata__":
            view = params[name].detach().view(-1).view(torch.uint8).numpy()
            jobs.append((memoryview(view), 8 + header_len + info["data_offsets"][0]))

    def reader(i: int) -> None:
        for view, offset in jobs[i::8]:
            os.preadv(fd, [view], offset)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(reader, range(8)))
    seconds = time.perf_counter() - t0
    os.close(fd)
    return seconds


def prepare(work: Path, method: str, mode: str) -> None:
    from fastload.core.memory.page_cache import evict, warm

    warm(work / "a" / "model.safetensors")
    path = work / ("c" if method == "reload 10% changed" else "b") / "model.safetensors"
    if mode == "cold":
        evict(path)
    else:
        warm(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size (GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/fastload-reload-bench")
    ap.add_argument("--out", default=None, help="folder for reload-cpu.json/.md (none: print)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.workdir)
    if args.run:
        print(json.dumps(run_one(args.run, work, args.count)))
        return
    work.mkdir(parents=True, exist_ok=True)
    count, changed = make_checkpoints(work, args.gib)
    size = (work / "b" / "model.safetensors").stat().st_size
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "tensors": count,
        "changed_in_c": changed,
        "bytes": size,
        "runs": [],
    }
    for rep in range(args.repeats):
        for mode in MODES:
            for method in args.methods.split(","):
                prepare(work, method, mode)
                cmd = [sys.executable, __file__, "--run", method, "--workdir", str(work)]
                cmd += ["--count", str(count)]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if done.returncode:
                    raise SystemExit(f"{method} {mode}: {done.stderr[-2000:]}")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row |= {"mode": mode, "method": method, "repeat": rep}
                results["runs"].append(row)
                print(f"{mode:4} {method:28} {row['seconds']:.3f} s", flush=True)
    table = summarize(results["runs"], size, count, changed)
    results["table"] = table
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "reload-cpu.json").write_text(json.dumps(results, indent=1))
        (out / "reload-cpu.md").write_text(f"`{results['command']}`\n\n{table}\n")


def summarize(runs: list[dict[str, Any]], size: int, count: int, changed: int) -> str:
    """Medians per cache state and method, as ratios to the read floor and to the alternatives
    of the same run."""
    lines = [
        f"{size / 2**30:.2f} GiB, {count} tensors; c changes {changed} of them. Ratios: the "
        "other's median time / this method's (above 1: this method is faster).",
        "",
        "| cache | method | median s | GiB/s of the checkpoint | x pread floor "
        "| x pread-into-the-model floor "
        "| x from_pretrained anew | x load_state_dict(load_file) "
        "| x transformers load_sharded_checkpoint |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        rows = [r for r in runs if r["mode"] == mode]
        med = {
            m: statistics.median(r["seconds"] for r in rows if r["method"] == m)
            for m in dict.fromkeys(r["method"] for r in rows)
        }
        nan = float("nan")
        for m, s in med.items():
            lines.append(
                f"| {mode} | {m} | {s:.3f} | {size / s / 2**30:.2f} | "
                f"{med.get('floor: pread', nan) / s:.2f} | "
                f"{med.get('floor: pread into the model', nan) / s:.2f} | "
                f"{med.get('from_pretrained anew', nan) / s:.2f} | "
                f"{med.get('load_state_dict(load_file)', nan) / s:.2f} | "
                f"{med.get('transformers load_sharded_checkpoint', nan) / s:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
