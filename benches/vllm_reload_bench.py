"""A running vLLM engine's ``reload_weights``, with vLLM's own loader and with fastload, cold and
warm, beside the floors.

    ~/.cache/fastload/vllm-venv/bin/python benches/vllm_reload_bench.py [--repeats 2] [--out DIR]

The benchmark model of benches/vllm_bench.py (a bf16 Llama, 1.1 GiB by default, made once under
--workdir) is served by vLLM (CPU, ``LLM(...)`` with the engine in process) in one process per
configuration (all up at once, each reload going round-robin over them, so the machine's noise
falls on all alike), which then reloads it with ``llm.collective_rpc("reload_weights", kwargs={
"weights_path": ...})``, alternating between two copies of the checkpoint (so every reload
replaces the weights), cold (the target's shards evicted from the page cache just before) and
warm (read once just before), ``--repeats`` times each:

* ``safetensors``: vLLM's own loader (``--load-format safetensors``), the default strategy;
* ``fastload``: ``--load-format fastload``, a full reload (the copies carry no digests);
* ``fastload, 10% changed``: both copies written by fastload with digests, 10% of the tensors
  differing between them: the unchanged layers are neither read nor copied.

Per reload, measured in the serving process: the seconds of the ``collective_rpc`` call, and the
peak RSS during it from the OS (``VmHWM`` after resetting it through ``/proc/self/clear_refs``),
beside the RSS before. Floors, in the same run: reading every byte of the evicted shards (8
threads, ``sendfile`` to /dev/null) and one memcpy of every byte into fresh memory; the cold
reloads are given as ratios to the first, the warm ones to the second. The greedy tokens after the
last reload of each configuration are checked equal (same checkpoint, same tokens). Writes
``vllm-reload-<size>.json`` and ``.md`` to --out.
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from vllm_bench import _set_cache, _shards, floor_cold_read, floor_memcpy, make_model  # noqa: E402

_CHILD = r"""
import json, sys, time

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out

def main():
    model, kwargs = sys.argv[1], json.loads(sys.argv[2])
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=128,
              max_num_seqs=4, seed=0, **kwargs)
    print("READY", flush=True)
    for line in sys.stdin:
        step = json.loads(line)
        if step.get("generate"):
            out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8))
            print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
            continue
        before = status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        start = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": step["path"]})
        seconds = time.perf_counter() - start
        after = status()
        print("RELOAD " + json.dumps({"seconds": seconds, "rss_before": before,
              "peak_rss": after["VmHWM"], "rss_after": after["VmRSS"]}), flush=True)

if __name__ == "__main__":
    main()
"""

CONFIGS = {
    "safetensors": {"load_format": "safetensors"},
    "fastload": {"load_format": "fastload"},
    "fastload, 10% changed": {"load_format": "fastload"},
}


def rewrite(src: Path, dst: Path, changed: float, seed: int) -> Path:
    """A copy of ``src`` written by fastload with digests, ``changed`` of its tensors (by count,
    every ``1/changed``-th name) given new values."""
    import torch
    from safetensors.torch import load_file

    from fastload import save_file

    if (dst / "model.safetensors.index.json").exists():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = sorted(n for f in _shards(src) for n in json.loads(_header(f)))
    step = max(1, round(1 / changed)) if changed else 0
    picked = set(names[seed % step :: step]) if step else set()
    generator = torch.Generator().manual_seed(seed)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp / f.name)
            continue
        state = load_file(f)
        for name in state:
            if name in picked:
                t = state[name]
                state[name] = (torch.randn(t.shape, generator=generator) * 0.5).to(t.dtype)
        save_file(state, tmp / f.name, metadata={"format": "pt"}, digests=True)
    tmp.rename(dst)
    return dst


def _header(shard: Path) -> str:
    with open(shard, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return json.dumps(header)


def copy_plain(src: Path, dst: Path) -> Path:
    """A byte-for-byte copy of ``src`` (its own files: its own pages in the page cache)."""
    if not (dst / "model.safetensors.index.json").exists():
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        tmp.rename(dst)
    return dst


class Child:
    def __init__(self, model: Path, kwargs: dict[str, Any]) -> None:
        script = Path(tempfile.mkdtemp()) / "child.py"
        script.write_text(_CHILD)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(model), json.dumps(kwargs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.expect("READY")

    def expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(word):
                return line[len(word) :].strip()
        self.log.seek(0)
        raise RuntimeError(f"the engine ended before {word}:\n{self.log.read()[-4000:]}")

    def send(self, step: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(step) + "\n")
        self.proc.stdin.flush()

    def reload(self, path: Path) -> dict[str, Any]:
        self.send({"path": str(path)})
        result: dict[str, Any] = json.loads(self.expect("RELOAD"))
        return result

    def tokens(self) -> list[int]:
        self.send({"generate": True})
        tokens: list[int] = json.loads(self.expect("TOKENS"))
        return tokens

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run(workdir: Path, layers: int, repeats: int) -> dict[str, Any]:
    model = make_model(workdir, layers)
    size = sum(f.stat().st_size for f in _shards(model))
    plain = [copy_plain(model, workdir / f"{model.name}-copy{i}") for i in (1, 2)]
    # the two differ in 10% of their tensors
    digested = [
        rewrite(model, workdir / f"{model.name}-digests{i}", c, 1) for i, c in ((1, 0), (2, 0.1))
    ]
    targets = {
        "safetensors": plain,
        "fastload": plain,
        "fastload, 10% changed": digested,
    }
    floors: dict[str, list[float]] = {"cold_read_s": [], "memcpy_s": []}
    runs: dict[str, list[dict[str, Any]]] = {}
    tokens: dict[str, list[int]] = {}
    children: dict[str, Child] = {}
    # every engine up at once (idle ones wait on stdin), the reloads round-robin over them so
    # the machine's noise falls on all alike
    try:
        for name, kwargs in CONFIGS.items():
            children[name] = Child(targets[name][1], kwargs)  # the first reload replaces it
        n = 0
        for repeat in range(repeats):
            for cache in ("cold", "warm"):
                names = list(CONFIGS)
                names = names[repeat % len(names) :] + names[: repeat % len(names)]
                for name in names:
                    target = targets[name][n % 2]
                    _set_cache(target, cache)
                    result = children[name].reload(target)
                    result["cache"] = cache
                    runs.setdefault(name, []).append(result)
                n += 1
            floors["cold_read_s"].append(floor_cold_read(model))
            floors["memcpy_s"].append(floor_memcpy(size))
        for name, child in children.items():  # an even number of reloads: on the second copy
            tokens[name] = child.tokens() if n % 2 == 0 else []
    finally:
        for child in children.values():
            child.close()
    return {
        "model": model.name,
        "bytes": size,
        "repeats": repeats,
        "floors": floors,
        "runs": runs,
        "tokens": tokens,
    }


def markdown(results: dict[str, Any], command: str) -> str:
    size = results["bytes"]
    cold = statistics.median(results["floors"]["cold_read_s"])
    memcpy = statistics.median(results["floors"]["memcpy_s"])
    lines = [
        f"vLLM 0.32 (CPU, 2 shared cores), {results['model']}: bf16 Llama, {size / 2**30:.2f} GiB;"
        " the engine in process, one process per configuration (all up at once, the reloads "
        "round-robin over them), reload_weights alternating "
        f"between two copies, {results['repeats']} repeats per cache state, medians.",
        "",
        f"Command: `{command}`",
        "",
        f"Floors (same run, medians): cold read of every byte {cold:.2f} s; one memcpy of every "
        f"byte into fresh memory {memcpy:.2f} s. Cold reloads as ratios to the cold read, warm "
        "ones to the memcpy.",
        "",
        "| reload | cache | seconds | x floor | peak RSS during (GiB) | RSS before (GiB) | "
        "peak - before (GiB) | runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results["runs"].items():
        for cache in ("cold", "warm"):
            picked = [r for r in runs if r["cache"] == cache]
            if not picked:
                continue
            s = statistics.median(r["seconds"] for r in picked)
            peak = statistics.median(r["peak_rss"] for r in picked)
            before = statistics.median(r["rss_before"] for r in picked)
            floor = cold if cache == "cold" else memcpy
            lines.append(
                f"| {name} | {cache} | {s:.2f} | {s / floor:.2f} | {peak / 2**30:.2f} | "
                f"{before / 2**30:.2f} | {(peak - before) / 2**30:.2f} | {len(picked)} |"
            )
    full = [results["tokens"].get(k) for k in ("safetensors", "fastload")]
    same = bool(full[0]) and full[0] == full[1]
    lines += [
        "",
        "Greedy tokens after the last reload, vLLM's and fastload's full reloads (the same copy): "
        + ("equal" if same else f"DIFFER: {results['tokens']}"),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/fastload-vllm-bench")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = run(workdir, args.layers, args.repeats)
    command = "python benches/vllm_reload_bench.py " + " ".join(sys.argv[1:])
    text = markdown(results, command.strip())
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"vllm-reload-{results['bytes'] / 2**30:.1f}GiB"
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
        (out / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()
