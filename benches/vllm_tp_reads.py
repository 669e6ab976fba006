"""What each vLLM worker reads from storage while loading a cold checkpoint, 1 and 2 ranks.

    bash scripts/vllm-env.sh   # once: the vLLM environment
    ~/.cache/fastload/vllm-venv/bin/python benches/vllm_tp_reads.py [--model test|bench] [--out DIR]

For ``--load-format fastload`` and vLLM's own ``safetensors`` (lazy), with 1 rank and with 2
tensor-parallel ranks (``distributed_executor_backend="mp"``, ``VLLM_CPU_OMP_THREADS_BIND='0|1'``):
the checkpoint's shards are evicted from the page cache, ``LLM(...)`` starts in a fresh process
(a user's script), and this script, from outside, follows each process that loads (the 2 workers;
with 1 rank the process itself, engine in process) until the engine is ready:

* ``read_bytes``: the kernel's count of bytes the process fetched from storage
  (``/proc/<pid>/io``) when the engine is ready.

On one host the ranks share one page cache: with vLLM's own loader every rank maps and copies
every tensor whole (its weight loaders narrow it afterwards), so between them they fetch each byte
once, split by whichever touches a page first; ranks on separate hosts (or with separate caches)
would each fetch all of it. With fastload each rank fetches its own slices. Then greedy tokens for
two prompts, to compare like with like. Writes ``vllm-tp-reads-<model>.json`` and ``.md`` to
--out.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # fastload from this checkout, here and in the vLLM processes

PROMPTS = ["The quick brown fox", "Once upon a time"]

#: the test suite's model (rows of every row-parallel weight span whole pages per rank) and the
#: benchmark's (o_proj and down_proj rows are not a whole number of pages per rank)
MODELS = {
    "test": dict(hidden=1024, intermediate=8192, layers=4, vocab=4096, heads=16, kv_heads=8),
    "bench": dict(hidden=2048, intermediate=5632, layers=12, vocab=4096, heads=16, kv_heads=8),
}

_CHILD = r"""
import json, sys

def main():
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=128,
              max_num_seqs=4, seed=0, **json.loads(sys.argv[2]))
    print("LOADED", flush=True)
    sys.stdin.readline()
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in out]), flush=True)

if __name__ == "__main__":  # the workers vLLM spawns import this file
    main()
""".replace("PROMPTS", repr(PROMPTS))


def _read_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _loaders(pid: int, tp: int) -> list[int]:
    import psutil

    if tp == 1:
        return [pid]
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [p.pid for p in kids if "Worker" in p.name()]


def run(model: Path, load_format: str, tp: int) -> dict[str, Any]:
    from fastload.core.memory.page_cache import evict

    for f in sorted(model.glob("*.safetensors")):
        evict(f)
    script = Path(tempfile.mkdtemp()) / "user.py"
    script.write_text(_CHILD)
    log = tempfile.TemporaryFile(mode="w+")
    kwargs: dict[str, Any] = {"load_format": load_format}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tp)))
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model), json.dumps(kwargs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    result: dict[str, Any] = {"load_format": load_format, "tp": tp}
    try:
        while (line := lines.get(timeout=1800)) is not None:
            if line.startswith("LOADED"):
                result["ranks"] = [{"read_bytes": _read_bytes(p)} for p in _loaders(proc.pid, tp)]
                assert proc.stdin is not None
                proc.stdin.write("\n")
                proc.stdin.flush()
            elif line.startswith("TOKENS "):
                result["tokens"] = json.loads(line[7:])
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if "tokens" not in result:
        log.seek(0)
        result["error"] = log.read()[-2000:]
    return result


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f}"


def markdown(results: dict[str, Any]) -> str:
    size = results["model_bytes"]
    lines = [
        f"vLLM {results['vllm']} (CPU), model `{results['model']}`: bf16 Llama "
        f"{_mib(size)} MiB in {results['shards']} shards ({results['shape']}); cold (evicted) "
        f"before each run. Command: `{results['command']}`.",
        "",
        f"Ideal share of one of 2 ranks: {_mib(results['ideal_tp2_rank'])} MiB "
        f"({results['ideal_tp2_rank'] / size:.3f} of the checkpoint: half of every sharded "
        "tensor, all of the replicated ones); in whole pages (rows of a row-parallel weight "
        "share pages between the ranks where a row's half is not a whole number of pages, and "
        f"tensors do not start on page boundaries): {_mib(results['pages_tp2_rank'])} MiB "
        f"({results['pages_tp2_rank'] / size:.3f}); pages both ranks need are read by whichever "
        "touches them first.",
        "",
        "| load format | ranks | rank | read from storage MiB | x checkpoint |",
        "|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        if "ranks" not in r:
            lines.append(
                f"| {r['load_format']} | {r['tp']} | failed: {r.get('error', '')[-200:]} |"
            )
            continue
        for i, rank in enumerate(r["ranks"]):
            lines.append(
                f"| {r['load_format']} | {r['tp']} | {i} | {_mib(rank['read_bytes'])} | "
                f"{rank['read_bytes'] / size:.3f} |"
            )
        if len(r["ranks"]) > 1:
            total = sum(rank["read_bytes"] for rank in r["ranks"])
            lines.append(
                f"| {r['load_format']} | {r['tp']} | all | {_mib(total)} | {total / size:.3f} |"
            )
    lines += ["", "Greedy tokens (12 per prompt):", ""]
    for r in results["runs"]:
        lines.append(f"* {r['load_format']}, {r['tp']} rank(s): {r.get('tokens')}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="test")
    parser.add_argument("--workdir", default="/tmp/fastload-vllm-bench")
    parser.add_argument("--out", default="benches/results")
    args = parser.parse_args()
    import vllm
    from vllm_models import make_llama, pages_needed

    shape = MODELS[args.model]
    model = Path(args.workdir) / f"llama-tp-{args.model}"
    if not (model / "model.safetensors.index.json").exists():
        make_llama(model, shards=4, **shape)  # type: ignore[arg-type]
    shards = sorted(model.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in shards)
    replicated = sharded = 0
    for f in shards:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if name.endswith("norm.weight"):  # the replicated tensors of a Llama
                replicated += end - begin
            else:
                sharded += end - begin
    results: dict[str, Any] = {
        "vllm": vllm.__version__,
        "model": model.name,
        "shape": ", ".join(f"{k} {v}" for k, v in shape.items()),
        "model_bytes": size,
        "shards": len(shards),
        "ideal_tp2_rank": replicated + sharded / 2,
        "pages_tp2_rank": max(pages_needed(shards, ranks=2)),
        "command": "python benches/vllm_tp_reads.py " + shlex.join(sys.argv[1:]),
        "runs": [],
    }
    for tp in (1, 2):
        for load_format in ("fastload", "safetensors"):
            r = run(model, load_format, tp)
            print(json.dumps(r), flush=True)
            results["runs"].append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"vllm-tp-reads-{args.model}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
