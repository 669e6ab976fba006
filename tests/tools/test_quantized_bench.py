"""``benches/quantized_bench.py``'s own logic: its ratios, and a tiny real run (fresh processes, a
few KiB Llama quantized by compressed-tensors, one repeat) that writes its results. Nothing here
asserts a speed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

BENCH = Path(__file__).resolve().parents[2] / "benches" / "quantized_bench.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quantized_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_method_gets_its_spread_and_ratios_to_the_floor_and_to_transformers() -> None:
    bench = _bench()
    runs = [
        {"mode": "warm", "format": "int8", "method": m, "seconds": s, **extra}
        for m, s, extra in [
            ("floor: map+touch", 0.1, {}),
            ("floor: map+touch", 0.3, {}),
            ("floor: map+touch", 0.2, {}),
            ("fastload", 0.25, {"quant_seconds": 0.05}),
            ("fastload", 0.3, {"quant_seconds": 0.1}),
            ("fastload", 0.2, {"quant_seconds": 0.04}),
            ("transformers", 1.0, {}),
        ]
    ]
    summary = bench.summarize(runs, {"int8": 1 << 30})
    fl = summary["warm"]["int8"]["fastload"]
    assert (fl["median_seconds"], fl["min_seconds"], fl["max_seconds"]) == (0.25, 0.2, 0.3)
    assert fl["x floor: map+touch"] == pytest.approx(1.25)
    assert fl["transformers / this"] == pytest.approx(4.0)
    assert fl["median_quant_seconds"] == pytest.approx(0.05)
    assert fl["quant_share"] == pytest.approx(0.2)
    # each run's load less its own quantizer time (0.2, 0.2, 0.16), then the median
    assert fl["median_seconds_less_quantizer"] == pytest.approx(0.2)
    assert fl["less quantizer x floor: map+touch"] == pytest.approx(1.0)
    assert "median_quant_seconds" not in summary["warm"]["int8"]["transformers"]
    # no parallel-read floor in these runs: no ratio to it, and the table says so
    assert "x floor: parallel read" not in fl
    row = "| warm | int8 | 1.000 | fastload | 0.250 (0.200-0.300) | 1.25 | nan | 4.00 | nan "
    assert row + "| 0.050 (20%) | 0.200 (1.00) |" in bench.table(summary, {"int8": 1 << 30})


def test_a_tiny_run_times_every_method_in_fresh_processes_and_writes_its_results(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH), "--tiny", "--repeats", "1", "--formats", "int8,fp8-blocks"]
    cmd += ["--workdir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "quantized-tiny.json").read_text())
    assert results["command"].endswith(" ".join(cmd[1:]))
    assert set(results["bytes"]) == {"int8", "fp8-blocks"} and results["bytes"]["int8"] > 0
    methods = ["floor: map+touch", "floor: parallel read", "fastload", "transformers"]
    runs = results["runs"]
    # round robin: every method on every format once, in order
    assert [(r["format"], r["method"]) for r in runs] == [
        (f, m) for f in ("int8", "fp8-blocks") for m in methods
    ]
    assert all(r["seconds"] > 0 and r["mode"] == "warm" for r in runs)
    loads = {(r["format"], r["method"]): r for r in runs if r["method"] in methods[2:]}
    # the quantizer's time comes from fastload's report in the child
    assert loads["int8", "fastload"]["quant_method"] == "compressed-tensors"
    assert loads["int8", "fastload"]["quant_seconds"] > 0
    # both loaders built the same model: compressed-tensors' int8 weights, as stored
    for fmt in ("int8",):
        mine, theirs = loads[fmt, "fastload"], loads[fmt, "transformers"]
        assert mine["linear_tensors"] == theirs["linear_tensors"]
        assert mine["linear_class"] == theirs["linear_class"]
    assert loads["int8", "fastload"]["linear_tensors"]["weight"] == "torch.int8"
    # a format with a load operation: FP8 blocks, dequantized by transformers' operation
    assert loads["fp8-blocks", "fastload"]["quant_method"] == "fp8"
    mine, theirs = loads["fp8-blocks", "fastload"], loads["fp8-blocks", "transformers"]
    assert mine["linear_tensors"] == theirs["linear_tensors"] == {"weight": "torch.bfloat16"}
    cells = results["summary"]["warm"]["int8"]
    assert list(cells) == methods
    assert cells["fastload"]["x floor: map+touch"] > 0
    assert cells["fastload"]["transformers / this"] > 0
    assert "median_quant_seconds" in cells["fastload"]
    table = (out / "quantized-tiny.md").read_text()
    assert table.startswith(f"`{results['command']}`")
    assert "| warm | int8 |" in table and "| fastload |" in table
    # --summarize recomputes the same summary and table from the runs, making none
    (out / "quantized-tiny.md").unlink()
    cmd = [sys.executable, str(BENCH), "--summarize", str(out / "quantized-tiny.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "quantized-tiny.json").read_text()) == results
    assert (out / "quantized-tiny.md").read_text() == table


def test_a_tiny_run_of_a_torchao_checkpoint_touches_the_tensors_its_subclasses_hold(
    tmp_path: Path,
) -> None:
    """torchao's weights are tensor subclasses (``Int8Tensor``) that cannot be flattened: the
    timed touch reads the tensors they hold."""
    pytest.importorskip("torchao")
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH), "--tiny", "--repeats", "1", "--formats", "torchao-int8"]
    cmd += ["--methods", "fastload,transformers", "--workdir", str(tmp_path / "work")]
    cmd += ["--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((out / "quantized-tiny.json").read_text())["runs"]
    loads = {r["method"]: r for r in runs}
    assert loads["fastload"]["quant_method"] == "torchao"
    assert loads["fastload"]["linear_class"] == loads["transformers"]["linear_class"]
    assert loads["fastload"]["linear_tensors"] == loads["transformers"]["linear_tensors"]
