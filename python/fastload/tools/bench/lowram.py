"""Low-RAM benchmark: a model larger than the memory a process may use.

``python -m fastload.tools.bench.lowram CHECKPOINT_DIR`` (or ``fastload bench --low-ram``) runs each
loader in a fresh child process inside a memory cgroup limited to ``--fraction`` (default 0.7) of
the checkpoint's safetensors bytes, from a cold page cache, and times its load plus the first
forward of 8 tokens (imports happen before the clock). The floor is measured in the same run:
one cold read of the files by 8 threads (``floor(cold read)``) plus the load and first forward of
a model whose files are already cached (``floor(cached load+forward)``: the files are read by this
process, outside the child's cgroup, so their page cache is not charged to the child's limit).
Needs root and a cgroup filesystem with the memory controller (v1 or v2): :class:`MemoryCgroup`.
With ``--make``, a 1.92 GiB bf16 Llama (20 layers, 3 shards) is written to CHECKPOINT_DIR first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from fastload.core.memory.budget import cgroup_dir
from fastload.core.memory.page_cache import evict, warm

#: name -> what it measures
LOADERS: dict[str, str] = {
    "floor(cold read)": "8 threads pread every safetensors file once (the disk's bandwidth)",
    "floor(cached load+forward)": "fastload load + first forward, the files cached outside the "
    "child's cgroup",
    "fastload": "fastload.from_pretrained + first forward, cold, in the cgroup",
    # the read-ahead variants tried (settings of fastload.core.memory.paced, .sharing and .memory)
    "fastload(paced ahead 0 MiB)": "paced read-ahead, one view ahead of the forward",
    "fastload(paced ahead 256 MiB)": "paced read-ahead, at most 256 MiB ahead of the forward",
    "fastload(unpaced)": "read ahead only the first views that fit half the budget, before "
    "returning; the rest on first use",
    "fastload(unpaced+read-ahead share 0)": "read nothing ahead: every page on first use",
    "fastload(unbounded budget)": "as before the budget: the whole files read ahead beside the "
    "skeleton build, whatever the cgroup's limit",
    "transformers": "transformers AutoModelForCausalLM.from_pretrained + first forward, cold",
    "fastload(mmap=copy)": "fastload.from_pretrained(mmap='copy'): expected to be refused",
}
FLOORS = ("floor(cold read)", "floor(cached load+forward)")
DEFAULT_LOADERS = ("floor(cold read)", "floor(cached load+forward)", "fastload", "transformers")


class MemoryCgroup:
    """A fresh memory cgroup limited to ``limit`` bytes (v2 ``memory.max``, or v1
    ``memory.limit_in_bytes`` under this process's own v1 memory cgroup), removed on exit.
    :meth:`run` starts a command inside it. :func:`unavailable` says why one cannot be made."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.path: Path | None = None

    @staticmethod
    def unavailable() -> str | None:
        """Why no memory cgroup can be made here (``None``: one can)."""
        if not sys.platform.startswith("linux"):
            return "memory cgroups are Linux only"
        if os.geteuid() != 0:
            return "making a memory cgroup needs root"
        if _parent() is None:
            return "no cgroup filesystem with the memory controller is mounted"
        return None

    def __enter__(self) -> MemoryCgroup:
        reason = self.unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        parent, version = _parent()  # type: ignore[misc]
        self.version = version
        self.path = parent / f"fastload-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        knob = "memory.max" if version == 2 else "memory.limit_in_bytes"
        (self.path / knob).write_text(str(self.limit))
        if version == 2 and (self.path / "memory.swap.max").exists():
            (self.path / "memory.swap.max").write_text("0")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.path is not None:
            for _ in range(50):  # the child's exit may take a moment to leave the group
                try:
                    self.path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            self.path = None

    def run(self, cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Runs ``cmd`` inside the cgroup (it joins before ``exec``); output captured as text."""
        assert self.path is not None, "use MemoryCgroup as a context manager"
        procs = str(self.path / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.run(
            cmd, preexec_fn=join, capture_output=True, text=True, check=False, **kwargs
        )

    def oom_killed(self) -> bool:
        """Whether the OOM killer killed a process of the cgroup."""
        assert self.path is not None
        events = self.path / "memory.events"
        if events.exists():
            return any(
                line.split()[0] == "oom_kill" and int(line.split()[1]) > 0
                for line in events.read_text().splitlines()
            )
        control = (self.path / "memory.oom_control").read_text()
        return any(
            line.startswith("oom_kill ") and line.split()[1] != "0" for line in control.splitlines()
        )


def _parent() -> tuple[Path, int] | None:
    """Where a new memory cgroup goes: v2's mount root (with +memory for its children), or
    this process's own v1 memory cgroup."""
    v1 = cgroup_dir(1)
    if v1 is not None:
        return v1, 1
    root = Path("/sys/fs/cgroup")
    if "memory" in _read(root / "cgroup.controllers").split():
        control = root / "cgroup.subtree_control"
        if "memory" not in _read(control).split():
            try:
                control.write_text("+memory")
            except OSError:
                return None
        return root, 2
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def safetensors_files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.safetensors"))


def model_bytes(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in safetensors_files(checkpoint))


# ---------------------------------------------------------------------------------------------
# The child
# ---------------------------------------------------------------------------------------------


def child(loader: str, checkpoint: Path) -> dict[str, Any]:
    """One load + first forward (imports before the clock); returns its measurements."""
    import torch
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    import fastload
    import fastload.api  # noqa: F401
    import fastload.hf.front  # noqa: F401
    from fastload.tools.bench.loaders import parallel_read

    tokens = torch.arange(8)[None]
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if loader == "floor(cold read)":
        for path in safetensors_files(checkpoint):
            parallel_read(path)
        out["seconds"] = time.perf_counter() - t0
        return out
    if loader == "transformers":
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
    else:
        kwargs: dict[str, Any] = {"progress": False, "output_loading_info": True}
        _variant(loader)
        if loader == "fastload(mmap=copy)":
            kwargs["mmap"] = "copy"
        try:
            model, report = fastload.from_pretrained(None, checkpoint, **kwargs)
        except MemoryError as e:
            out.update(seconds=time.perf_counter() - t0, refused=f"{type(e).__name__}: {e}")
            return out
        out["memory_budget"] = getattr(report, "memory_budget", None)
        out["bytes_read_ahead"] = getattr(report, "bytes_read_ahead", None)
    t1 = time.perf_counter()
    with torch.inference_mode():
        logits = model(tokens).logits
    t2 = time.perf_counter()
    out.update(
        seconds=t2 - t0,
        load_seconds=t1 - t0,
        forward_seconds=t2 - t1,
        logits_sum=float(logits.float().sum()),
    )
    return out


def _variant(loader: str) -> None:
    """Applies the read-ahead settings a loader's name asks for: ``fastload(unpaced+read-ahead
    share 0)``, ``fastload(paced ahead 256 MiB)``, ``fastload(unbounded budget)``."""
    import fastload.core.loading
    import fastload.core.memory.budget
    import fastload.core.memory.paced
    import fastload.core.memory.sharing

    inside = loader.partition("(")[2].rstrip(")")
    for setting in (s.strip() for s in inside.split("+")):
        if setting == "unpaced":
            fastload.core.memory.sharing.PACED = False
        elif setting.startswith("paced ahead "):
            fastload.core.memory.paced.AHEAD = int(setting.split()[2]) << 20
        elif setting.startswith("read-ahead share "):
            fastload.core.memory.budget.READ_AHEAD_SHARE = float(setting.split()[2])
        elif setting == "unbounded budget":
            fastload.core.loading.memory_budget = _unbounded  # type: ignore[assignment]


def _unbounded() -> Any:
    from fastload.core.memory.budget import MemoryBudget

    return MemoryBudget(None, "unknown")


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------


def run_one(loader: str, checkpoint: Path, limit: int, timeout: float) -> dict[str, Any]:
    files = safetensors_files(checkpoint)
    for path in files:
        (warm if loader == "floor(cached load+forward)" else evict)(path)
    cmd = [sys.executable, "-m", "fastload.tools.bench.lowram", "--child", loader, str(checkpoint)]
    with MemoryCgroup(limit) as group:
        done = group.run(cmd, timeout=timeout)
        killed = group.oom_killed()
    for path in files:  # the next run starts cold whatever this one left
        evict(path)
    if done.returncode != 0:
        why = "killed by the OOM killer" if killed else f"exit {done.returncode}"
        return {"failed": f"{why}: {done.stderr[-1500:]}"}
    measured: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return measured


def run(
    checkpoint: Path, loaders: list[str], repeats: int, fraction: float, timeout: float = 600
) -> dict[str, Any]:
    """Every loader ``repeats`` times, round robin; the medians and the ratios to the floor."""
    size = model_bytes(checkpoint)
    limit = int(size * fraction)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in loaders}
    for _ in range(repeats):
        for loader in loaders:
            r = run_one(loader, checkpoint, limit, timeout)
            runs[loader].append(r)
            print(f"[bench low-ram] {loader:28s} {json.dumps(r)}", flush=True)
    rows: dict[str, Any] = {}
    for loader, rs in runs.items():
        ok = [r["seconds"] for r in rs if "seconds" in r and "refused" not in r]
        rows[loader] = {"runs": rs, "median_seconds": statistics.median(ok) if ok else None}
    parts = [rows.get(f, {}).get("median_seconds") for f in FLOORS]
    floor = sum(parts) if all(p is not None for p in parts) else None  # type: ignore[misc]
    for row in rows.values():
        if floor and row["median_seconds"] is not None:
            row["x_floor"] = row["median_seconds"] / floor
    results = {
        "command": "python -m fastload.tools.bench.lowram " + " ".join(sys.argv[1:]),
        "checkpoint": str(checkpoint),
        "model_bytes": size,
        "cgroup_limit_bytes": limit,
        "fraction": fraction,
        "repeats": repeats,
        "floor_seconds": floor,
        "loaders": rows,
    }
    print(table(results))
    return results


def table(results: dict[str, Any]) -> str:
    gib = 1 << 30
    lines = [
        f"model {results['model_bytes'] / gib:.2f} GiB, cgroup limit "
        f"{results['cgroup_limit_bytes'] / gib:.2f} GiB ({results['fraction']:g}x), "
        f"median of {results['repeats']}",
        "",
        "| loader | seconds (load + first forward) | x floor |",
        "| --- | --- | --- |",
    ]
    for name, row in results["loaders"].items():
        secs = row["median_seconds"]
        if secs is None:
            what = next((r.get("refused") or r.get("failed") for r in row["runs"]), "")
            lines.append(f"| {name} | {str(what)[:120]} | |")
            continue
        ratio = f"{row['x_floor']:.2f}x" if "x_floor" in row else ""
        lines.append(f"| {name} | {secs:.2f} | {ratio} |")
    if results["floor_seconds"]:
        lines.append(
            f"| floor (cold read + cached load+forward) | {results['floor_seconds']:.2f} | 1.00x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="fastload.tools.bench.lowram", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("checkpoint", type=Path, nargs="?", help="a sharded safetensors model directory")
    p.add_argument("--make", action="store_true", help="write the 1.92 GiB test model there first")
    p.add_argument("--fraction", type=float, default=0.7, help="cgroup limit / model bytes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loaders", default=",".join(DEFAULT_LOADERS), help=f"of {list(LOADERS)}")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--child", nargs=2, metavar=("LOADER", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return 0
    if args.checkpoint is None:
        p.error("give the checkpoint directory")
    reason = MemoryCgroup.unavailable()
    if reason is not None:
        p.error(f"the low-RAM benchmark needs a memory cgroup: {reason}")
    if args.make:
        make_model(args.checkpoint)
    loaders = [s for s in args.loaders.split(",") if s]
    unknown = [s for s in loaders if s not in LOADERS]
    if unknown:
        p.error(f"unknown loader(s) {unknown}; choose from {list(LOADERS)}")
    results = run(args.checkpoint, loaders, args.repeats, args.fraction)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


def make_model(out: Path) -> None:
    """A 1.92 GiB bf16 Llama with random weights: 20 layers, 3 safetensors shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if safetensors_files(out):
        return
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=20,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    state = {
        n: (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
        for n, p in model.state_dict().items()
    }
    model.load_state_dict(state, assign=True)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, max_shard_size="750MB")


if __name__ == "__main__":
    sys.exit(main())
