"""Pre-quantized checkpoints on CPU: fastload against transformers on the same files, beside the
read floors of the same bytes measured in the same run.

    python benches/quantized_bench.py [--gib 1] [--repeats 3] [--modes warm] [--out benches/results]

One Llama (hidden 1024, intermediate 2816, vocabulary 32000; as many layers as make ``--gib`` of
bf16 weights) is written once under --workdir in bf16 with random values, then quantized by
compressed-tensors' own code, as the tests make theirs (``tests/hf/test_hf_quantized.py``): every
Linear layer but the head, weight-only, symmetric, its scales calibrated from the weights, then
compressed in the format and saved as llm-compressor saves one. Formats (``--formats``):

* ``bf16``: the model unquantized, the reference of the same model's load;
* ``int8``: int8 per output channel (``int-quantized``, stored as int8);
* ``int4``: int4 per output channel (``pack-quantized``, eight to an int32);
* ``fp8``: FP8 e4m3 per output channel (``float-quantized``, stored as FP8);
* ``nvfp4``: the ``NVFP4A16`` preset (``nvfp4-pack-quantized``: FP4 two to a uint8, FP8 scales per
  16 values, a global scale);
* ``mxfp4``: the ``MXFP4A16`` preset (``mxfp4-pack-quantized``: FP4 two to a uint8, E8M0 scales
  per 32 values);
* ``fp8-blocks``, ``int4-dequantized``, ``bnb-nf4``, ``bnb-int8``: formats transformers loads
  through a load operation on a CPU, which fastload runs on the tensors it read
  (``benches/quantized_formats.py``); their ``quantizer`` time includes the operations.

Every run is a fresh process (torch, transformers, compressed-tensors, fastload's entry point and
transformers' compressed-tensors quantizer imported before the clock; each run records the modules
imported inside its clock). ``warm``: before the series every file is evicted and read once with
``read()`` (one page-cache state for every run, as ``fastload bench`` starts its warm series),
then read again before each run; ``cold``: evicted before each run (``fsync`` +
``posix_fadvise(DONTNEED)``). Runs go round
robin (every format and method once, then again, ``--repeats`` times); the table gives medians.
Every timed region ends with one read per 4 KiB page of every parameter and buffer (a view of the
file's mapping pays for its page faults there, as a first forward would). Methods:

* ``floor: map+touch``: map each safetensors file and read one byte per 4 KiB page of its data:
  the warm floor of the same bytes (fastload's default load makes views of the mapping);
* ``floor: parallel read``: 8 threads ``pread`` the same data in 16 MiB blocks into reused
  buffers: the disk's floor cold, a copy out of the page cache warm;
* ``fastload``: ``fastload.from_pretrained(dir, output_loading_info=True)``, defaults; the child
  also reports ``LoadReport.quant_seconds`` (the quantizer's hooks: module swaps,
  post-processing, apart from the reads), ``quant_method`` and the phases;
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir)``, its defaults (on a CPU it
  keeps these formats as stored: compressed-tensors' compressed modules).

Writes ``quantized-<gib>GiB.json`` and ``.md`` to --out; ``--summarize FILE.json`` recomputes a
results file's summary and table from its runs (a ``note`` key in it, such as what else ran on the
machine, is written into the ``.md`` too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

METHODS = ["floor: map+touch", "floor: parallel read", "fastload", "transformers"]
FLOORS = {"warm": "floor: map+touch", "cold": "floor: parallel read"}
MODES = ["warm", "cold"]
#: name -> the weights' scheme (a compressed-tensors preset, or (value type, bits) per output
#: channel) and the compressed-tensors format; ``bf16`` is not quantized
FORMATS: dict[str, tuple[str | tuple[str, int], str] | None] = {
    "bf16": None,
    "int8": (("int", 8), "int-quantized"),
    "int4": (("int", 4), "pack-quantized"),
    "fp8": (("float", 8), "float-quantized"),
    "nvfp4": ("NVFP4A16", "nvfp4-pack-quantized"),
    "mxfp4": ("MXFP4A16", "mxfp4-pack-quantized"),
}
#: the formats made of the bf16 (or int4) checkpoint (benches/quantized_formats.py: MADE): those
#: with a load operation, then GPTQ and AWQ (stored as they run)
OP_FORMATS = [
    "fp8-blocks",
    "int4-dequantized",
    "bnb-nf4",
    "bnb-int8",
    "torchao-int8",
    "torchao-float8",
]
MADE_FORMATS = [*OP_FORMATS, "gptq", "awq"]
GIB = 1 << 30


def _formats() -> Any:
    """benches/quantized_formats.py: how each format's checkpoint is made."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import quantized_formats

    return quantized_formats


def llama_config(gib: float, tiny: bool) -> Any:
    """A Llama whose bf16 weights take about ``gib`` GiB (``tiny``: a test's few KiB model)."""
    from transformers import LlamaConfig

    if tiny:
        hidden, inter, vocab, heads, kv, layers = 64, 128, 128, 4, 2, 2
    else:
        hidden, inter, vocab, heads, kv = 1024, 2816, 32000, 16, 4
        per_layer = 2 * hidden * hidden + 2 * hidden * (hidden // 4) + 3 * hidden * inter
        layers = max(1, round((gib * GIB / 2 - 2 * vocab * hidden) / per_layer))
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        dtype="bfloat16",
    )


def make_checkpoints(work: Path, gib: float, tiny: bool, formats: list[str]) -> dict[str, Path]:
    """The checkpoint of each format under ``work`` (made once); returns format -> directory."""
    import torch
    from transformers import LlamaForCausalLM

    work.mkdir(parents=True, exist_ok=True)
    dirs = {f: work / f for f in formats}
    bf16 = work / "bf16"
    if not (bf16 / "config.json").exists():
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config(gib, tiny))
        gen = torch.Generator().manual_seed(0)
        state = {
            name: (torch.randn(p.shape, generator=gen) * 0.02).bfloat16()
            for name, p in model.state_dict().items()
        }
        model.load_state_dict(state, assign=True)
        model.config.dtype = "bfloat16"
        _formats().save_compressed(model, bf16, None)
    needed = {"int4"} if "int4-dequantized" in formats else set()
    for name in [*dict.fromkeys([*needed, *formats])]:
        directory = work / name
        if name in MADE_FORMATS and not (directory / "config.json").exists():
            print(f"[quantized-bench] making {name} ...", flush=True)
            source, _ = _formats().MADE[name]
            _formats().make(name, work / source, directory)
        elif FORMATS.get(name) is not None and not (directory / "config.json").exists():
            print(f"[quantized-bench] quantizing {name} ...", flush=True)
            model = LlamaForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
            _formats().save_compressed(model, directory, FORMATS[name])
    return dirs


def files_of(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def data_bytes(directory: Path) -> int:
    """Bytes of tensor data in the checkpoint's safetensors files (headers not counted)."""
    from fastload.core.reads.reading import open_file

    total = 0
    for path in files_of(directory):
        f = open_file(path)
        total += f.file_size - f.data_start
    return total


# ---------------------------------------------------------------------------------------------
# One run, in a fresh process
# ---------------------------------------------------------------------------------------------


def run_one(method: str, directory: Path) -> dict[str, Any]:
    """One load and touch; every library it uses imported before the clock (the floors' children
    import only what they use: their start is not timed, only shorter)."""
    import torch  # noqa: F401 - imported before the clock on purpose

    import fastload.core.reads.reading  # noqa: F401 - the floors' header parse (fastload's engine)
    from fastload.tools.bench.loaders import _map_and_touch, _touch, parallel_read

    if not method.startswith("floor"):
        import multiprocessing.synchronize  # noqa: F401 - what transformers' loading imports

        import compressed_tensors.compressors  # noqa: F401
        import compressed_tensors.linear.compressed_linear  # noqa: F401
        import transformers.quantizers.auto  # noqa: F401
        import transformers.quantizers.quantizer_compressed_tensors  # noqa: F401
        from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

        import fastload
        import fastload.api  # noqa: F401
        import fastload.hf.front  # noqa: F401
        import fastload.hf.quantized  # noqa: F401

        _formats().import_before_the_clock(directory)

    out: dict[str, Any] = {}
    before = set(sys.modules)
    t0 = time.perf_counter()
    if method == "floor: map+touch":
        _touch([t for path in files_of(directory) for t in _map_and_touch(path)])
    elif method == "floor: parallel read":
        for path in files_of(directory):
            parallel_read(path)
    elif method == "fastload":
        model, report = fastload.from_pretrained(
            directory, output_loading_info=True, progress=False
        )
        _touch([*model.parameters(), *model.buffers()])
        out["quant_method"] = report.quant_method
        out["quant_seconds"] = report.quant_seconds
        out["phases"] = dict(report.seconds)
        out["bytes_read"] = report.bytes_read
    elif method == "transformers":
        model = AutoModelForCausalLM.from_pretrained(directory)
        _touch([*model.parameters(), *model.buffers()])
    else:
        raise SystemExit(f"unknown method {method!r}")
    out["seconds"] = time.perf_counter() - t0
    # modules imported inside the clock: import time, not load time (none expected)
    out["imported_in_clock"] = sorted(set(sys.modules) - before)
    if method in ("fastload", "transformers"):
        out["model_class"] = type(model).__name__
        linear = model.model.layers[0].mlp.down_proj
        out["linear_class"] = type(linear).__name__
        out["linear_tensors"] = {
            k: str(t.dtype) for k, t in [*linear.named_parameters(), *linear.named_buffers()]
        }
    return out


def prepare(directory: Path, mode: str) -> None:
    from fastload.core.memory.page_cache import evict, warm

    for path in files_of(directory):
        (warm if mode == "warm" else evict)(path)


def run_child(method: str, directory: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--run", method, "--dir", str(directory)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode:
        raise SystemExit(f"{method} on {directory}: exit {done.returncode}\n{done.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if row["imported_in_clock"]:
        print(
            f"[quantized-bench] warning: {method} imported {row['imported_in_clock']} in its clock"
        )
    return row


# ---------------------------------------------------------------------------------------------
# The whole benchmark
# ---------------------------------------------------------------------------------------------


def run(
    gib: float,
    formats: list[str],
    modes: list[str],
    methods: list[str],
    repeats: int,
    work: Path,
    out: Path | None,
    tiny: bool = False,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Every method on every format ``repeats`` times per mode, round robin; writes
    ``quantized-<gib>GiB.json`` and ``.md`` (``tiny``: ``quantized-tiny``) to ``out``."""
    import compressed_tensors
    import torch
    import transformers

    from fastload.tools.bench.run import compile_fastload

    compile_fastload()  # fastload's bytecode written once, as installing a wheel does
    dirs = make_checkpoints(work, gib, tiny, formats)
    nbytes = {f: data_bytes(d) for f, d in dirs.items()}
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "compressed_tensors": compressed_tensors.__version__,
        },
        "model": llama_config(gib, tiny).to_dict() | {"bf16_gib": gib, "tiny": tiny},
        "repeats": repeats,
        "touch": "one read per 4 KiB page of every parameter and buffer, inside the timed region",
        "floors": {m: FLOORS[m] for m in modes},
        "bytes": nbytes,
        "runs": [],
    }
    if "warm" in modes:
        # One page-cache state for every run, as ``fastload bench`` starts its warm series: each
        # file evicted, then read once with read() (mostly 2 MiB folios, fast to map; a freshly
        # written file has 4 KiB ones), then read again before every warm run
        for fmt in formats:
            prepare(dirs[fmt], "cold")
            prepare(dirs[fmt], "warm")
    started = time.perf_counter()
    for rep in range(repeats):
        for mode in modes:
            for fmt in formats:
                for method in methods:
                    prepare(dirs[fmt], mode)
                    row = run_child(method, dirs[fmt], timeout)
                    row |= {"mode": mode, "format": fmt, "method": method, "repeat": rep}
                    results["runs"].append(row)
                    extra = (
                        f" (quantizer {row['quant_seconds']:.3f} s)"
                        if "quant_seconds" in row
                        else ""
                    )
                    print(
                        f"[quantized-bench] {rep} {mode} {fmt:6} {method:22} "
                        f"{row['seconds']:.3f} s{extra}",
                        flush=True,
                    )
    results["wall_seconds"] = time.perf_counter() - started
    results["summary"] = summarize(results["runs"], nbytes)
    results["table"] = table(results["summary"], nbytes)
    print(results["table"])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write(results, out / ("quantized-tiny.json" if tiny else f"quantized-{gib:g}GiB.json"))
    return results


def write(results: dict[str, Any], path: Path) -> None:
    """``results`` as ``path`` (.json) and its table beside it (.md)."""
    machine = results["machine"]
    path.write_text(json.dumps(results, indent=1))
    path.with_suffix(".md").write_text(
        f"`{results['command']}`\n\n"
        f"{len(results['runs'])} runs in {results['wall_seconds'] / 60:.1f} min; "
        f"torch {machine['torch']}, transformers {machine['transformers']}, "
        f"compressed-tensors {machine['compressed_tensors']}, {machine['cpus']} CPUs.\n\n"
        + (f"{results['note']}\n\n" if results.get("note") else "")
        + f"{results['table']}\n"
    )


def resummarize(path: Path) -> None:
    """The summary and table of the results file ``path`` recomputed from its runs."""
    results = json.loads(path.read_text())
    results["summary"] = summarize(results["runs"], results["bytes"])
    results["table"] = table(results["summary"], results["bytes"])
    write(results, path)
    print(results["table"])


def summarize(runs: list[dict[str, Any]], nbytes: dict[str, int]) -> dict[str, Any]:
    """Per mode, format and method: median, min and max seconds, and the ratios of the median to
    the mode's floor, to transformers and to the same method on the bf16 model (method time /
    floor time: 1.0 is at the floor; time of transformers / method time: above 1, faster than
    transformers; time / the same method's on bf16); for fastload the median of
    ``quant_seconds`` and its share of the load."""
    summary: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        summary[mode] = {}
        for fmt in dict.fromkeys(r["format"] for r in runs if r["mode"] == mode):
            rows = [r for r in runs if (r["mode"], r["format"]) == (mode, fmt)]
            med = {}
            cells: dict[str, Any] = {}
            for method in dict.fromkeys(r["method"] for r in rows):
                secs = [r["seconds"] for r in rows if r["method"] == method]
                med[method] = statistics.median(secs)
                cells[method] = {
                    "median_seconds": med[method],
                    "min_seconds": min(secs),
                    "max_seconds": max(secs),
                    "runs": len(secs),
                    "gib_per_s": nbytes[fmt] / med[method] / GIB,
                }
                quant = [
                    r["quant_seconds"]
                    for r in rows
                    if "quant_seconds" in r and r["method"] == method
                ]
                if quant:
                    cells[method]["median_quant_seconds"] = statistics.median(quant)
                    cells[method]["quant_share"] = statistics.median(quant) / med[method]
                    # the load less its quantizer's hooks: the part fastload's reading decides
                    rest = [
                        r["seconds"] - r["quant_seconds"] for r in rows if r["method"] == method
                    ]
                    cells[method]["median_seconds_less_quantizer"] = statistics.median(rest)
            for cell in cells.values():
                for floor in [f for f in dict.fromkeys(FLOORS.values()) if f in med]:
                    cell[f"x {floor}"] = cell["median_seconds"] / med[floor]
                    if "median_seconds_less_quantizer" in cell:
                        less = cell["median_seconds_less_quantizer"]
                        cell[f"less quantizer x {floor}"] = less / med[floor]
                if "transformers" in med:
                    cell["transformers / this"] = med["transformers"] / cell["median_seconds"]
            summary[mode][fmt] = cells
        # the same loader on the same model in bf16 (same cache state): what quantization costs
        bf16 = summary[mode].get("bf16", {})
        for cells in summary[mode].values():
            for method, cell in cells.items():
                if method in bf16:
                    cell["x bf16"] = cell["median_seconds"] / bf16[method]["median_seconds"]
    return summary


def table(summary: dict[str, Any], nbytes: dict[str, int]) -> str:
    """The summary as a Markdown table: one row per mode, format and method."""
    nan = float("nan")
    lines = [
        "Time: median (min-max) of the runs, seconds. `x floor`: this median / the floor's median "
        "in the same run and cache state (1.00: at the floor; warm: map+touch, cold: parallel "
        "read). `x transformers`: transformers' median / this one (above 1: faster). "
        "`x bf16`: this median / the same method's on the bf16 model. "
        "`quantizer`: fastload's `LoadReport.quant_seconds` (transformers' quantizer hooks: "
        "module swaps, post-processing), its median and share of the load. `less quantizer`: "
        "the median of fastload's time less its quantizer's, and that over the floor.",
        "",
        "| cache | format | stored GiB | method | time s | x floor | x parallel-read floor "
        "| x transformers | x bf16 | quantizer s (share) | less quantizer s (x floor) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, formats in summary.items():
        floor = FLOORS[mode]
        for fmt, cells in formats.items():
            for method, c in cells.items():
                quant = less = ""
                if "median_quant_seconds" in c:
                    quant = f"{c['median_quant_seconds']:.3f} ({c['quant_share']:.0%})"
                    less = f"{c['median_seconds_less_quantizer']:.3f} "
                    less += f"({c.get(f'less quantizer x {floor}', nan):.2f})"
                lines.append(
                    f"| {mode} | {fmt} | {nbytes[fmt] / GIB:.3f} | {method} | "
                    f"{c['median_seconds']:.3f} ({c['min_seconds']:.3f}-{c['max_seconds']:.3f}) | "
                    f"{c.get(f'x {floor}', nan):.2f} | "
                    f"{c.get('x floor: parallel read', nan):.2f} | "
                    f"{c.get('transformers / this', nan):.2f} | {c.get('x bf16', nan):.2f} | "
                    f"{quant} | {less} |"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="the model's size in bf16 (GiB)")
    ap.add_argument("--tiny", action="store_true", help="a few KiB model (the bench's own test)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--modes", default="warm", help="warm, cold or warm,cold")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/fastload-quantized-bench")
    ap.add_argument("--out", default=None, help="folder for the .json/.md (none: print)")
    ap.add_argument(
        "--summarize",
        metavar="JSON",
        help="recompute the summary and table of a results file from its runs (no runs made)",
    )
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, Path(args.dir))))
        return
    if args.summarize:
        resummarize(Path(args.summarize))
        return
    formats = args.formats.split(",")
    unknown = set(formats) - set(FORMATS) - set(MADE_FORMATS)
    if unknown:
        known = ", ".join([*FORMATS, *MADE_FORMATS])
        raise SystemExit(f"unknown formats {sorted(unknown)}; known: {known}")
    work = Path(args.workdir) / ("tiny" if args.tiny else f"{args.gib:g}GiB")
    run(
        args.gib,
        formats,
        args.modes.split(","),
        args.methods.split(","),
        args.repeats,
        work,
        Path(args.out) if args.out else None,
        tiny=args.tiny,
    )


if __name__ == "__main__":
    main()
