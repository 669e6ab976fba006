"""The side-by-side benchmark's own logic: its ratios, its table, and a tiny real run of the
floors and fastload rows (fresh processes, a 10 MiB checkpoint). Nothing here asserts a speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from fastload.tools.bench import run as bench  # noqa: E402
from fastload.tools.bench.loaders import CONVERSIONS, FLOORS, LOADERS, is_peer  # noqa: E402


def _row(seconds: float, rss_mib: float = 0.0) -> dict[str, float]:
    return {"median_seconds": seconds, "median_peak_rss_over_baseline_mib": rss_mib}


def test_every_row_gets_its_ratios_to_the_floors_the_fastest_peer_and_transformers() -> None:
    rows = {
        "floor(map+touch)": _row(0.02),
        "floor(parallel read)": _row(0.1),
        "floor(read into fresh memory)": _row(0.3),
        "floor(fresh f32 memory)": _row(0.5),
        "safetensors+meta+assign": _row(0.2),
        "transformers": _row(0.4),
        "fastload": _row(0.16, rss_mib=1030.0),
        "transformers(bf16->f32)": _row(1.2),
        "fastload(bf16->f32)": _row(0.6),
    }
    bench._summarize(rows, "warm", nbytes=1 << 30)
    fl = rows["fastload"]
    # warm: one copy of the bytes (from the page cache); the zero-copy floor only for the default
    # load (views of the mapping), beside it
    assert fl["x_floor"] == pytest.approx(1.6)
    assert fl["x_zero_copy_floor"] == pytest.approx(8.0)
    assert "x_zero_copy_floor" not in rows["safetensors+meta+assign"]
    assert "x_zero_copy_floor" not in rows["fastload(bf16->f32)"]
    assert fl["fastest_peer"] == "safetensors+meta+assign"
    assert fl["x_fastest_peer"] == pytest.approx(0.8)
    assert fl["speedup_vs_transformers"] == pytest.approx(2.5)
    assert fl["peak_rss_minus_produced_mib"] == pytest.approx(6.0)
    conv = rows["fastload(bf16->f32)"]
    assert conv["speedup_vs_transformers"] == pytest.approx(2.0)
    assert conv["x_conversion_floor"] == pytest.approx(1.2)
    assert rows["transformers(bf16->f32)"]["x_conversion_floor"] == pytest.approx(2.4)
    # floors are not compared with peers; the fresh-memory floor produces float32 bytes
    assert "x_fastest_peer" not in rows["floor(fresh f32 memory)"]
    assert "x_conversion_floor" not in rows["floor(fresh f32 memory)"]
    assert rows["floor(fresh f32 memory)"]["peak_rss_minus_produced_mib"] == -2048.0
    cold = {"floor(parallel read)": _row(1.0), "fastload(bf16->f32)": _row(1.5)}
    cold["floor(fresh f32 memory)"] = _row(0.5)
    bench._summarize(cold, "cold", nbytes=1 << 30)
    assert "x_conversion_floor" not in cold["fastload(bf16->f32)"]  # the disk bounds it there
    assert "x_zero_copy_floor" not in cold["fastload(bf16->f32)"]
    assert cold["fastload(bf16->f32)"]["x_floor"] == pytest.approx(1.5)


def test_the_floors_and_conversions_are_known_loaders_and_not_peers() -> None:
    assert set(FLOORS) <= set(LOADERS) and set(CONVERSIONS) <= set(LOADERS)
    assert not any(is_peer(n) for n in (*FLOORS, *CONVERSIONS, "fastload", "fastload(mmap=copy)"))
    assert is_peer("transformers") and is_peer("fastsafetensors")


def test_a_tiny_run_measures_the_floors_and_fastload_and_writes_its_results(
    tmp_path: Path,
) -> None:
    loaders = [
        "floor(map+touch)",
        "floor(parallel read)",
        "floor(read into fresh memory)",
        "floor(fresh f32 memory)",
        "fastload",
        "fastload(bf16->f32)",
    ]
    out = tmp_path / "out"
    results = bench.run(
        0.01, ["bfloat16"], ["warm"], loaders, repeats=1, out=out, workdir=tmp_path / "work"
    )
    rows = results["results"]["warm"]["bfloat16"]["loaders"]
    assert list(rows) == loaders
    for name, row in rows.items():
        assert row["median_seconds"] == row["runs"][0]["seconds"], name
        assert len(row["runs"]) == 1
    assert "x_conversion_floor" in rows["fastload(bf16->f32)"]
    assert rows["floor(parallel read)"]["x_floor"] == 1.0  # the warm floor too
    assert "x_zero_copy_floor" in rows["fastload"]
    # each run is a fresh interpreter that imported every library before its clock started
    assert all(r["imported_in_clock"] == [] for row in rows.values() for r in row["runs"])
    written = json.loads((out / "llama-0.01GiB.json").read_text())
    assert written["results"]["warm"]["bfloat16"]["loaders"].keys() == rows.keys()
    table = (out / "llama-0.01GiB.md").read_text()
    assert "fresh-memory floor" in table and "| fastload |" in table
    assert "map+touch floor" in table


def test_a_child_reports_the_modules_a_load_imported_inside_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from fastload.tools.bench import loaders as bench_loaders

    def load_importing(loader: str, checkpoint: Path) -> list[object]:
        monkeypatch.setitem(sys.modules, "fastload_bench_probe", object())
        return []

    monkeypatch.setattr(bench_loaders, "_load", load_importing)
    measured = bench_loaders.child("floor(map+touch)", tmp_path)
    assert measured["imported_in_clock"] == ["fastload_bench_probe"]
    assert measured["seconds"] >= 0


def test_runs_go_round_robin_so_a_drift_in_machine_speed_spreads_over_every_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []

    def fake_child(loader: str, checkpoint: Path, timeout: float) -> dict[str, float]:
        order.append(loader)
        return {"seconds": 1.0 + len(order), "peak_rss_over_baseline": 0}

    monkeypatch.setattr(bench, "make_checkpoint", lambda workdir, size, dtype: tmp_path)
    monkeypatch.setattr(bench, "data_bytes", lambda ckpt: 1 << 20)
    cache: list[tuple[str, str]] = []  # what was done to the page cache, before which run
    monkeypatch.setattr(bench, "warm", lambda path: cache.append(("read", f"run {len(order)}")))
    monkeypatch.setattr(bench, "evict", lambda path: cache.append(("evict", f"run {len(order)}")))
    monkeypatch.setattr(bench, "run_child", fake_child)
    monkeypatch.setattr(bench, "plot", lambda results, path: None)
    loaders = ["floor(map+touch)", "fastload", "fastload(bf16->f32)"]
    results = bench.run(
        1, ["float32"], ["warm"], loaders, repeats=3, out=tmp_path, workdir=tmp_path
    )
    # the conversion row only runs on the bf16 checkpoint
    assert order == ["floor(map+touch)", "fastload"] * 3
    # one page-cache state for the whole warm series (evicted, then read), then a read per run
    assert cache[:2] == [("evict", "run 0"), ("read", "run 0")]
    assert cache[2:] == [("read", f"run {i}") for i in range(6)]
    rows = results["results"]["warm"]["float32"]["loaders"]
    assert [r["seconds"] for r in rows["fastload"]["runs"]] == [3.0, 5.0, 7.0]
    assert rows["fastload"]["median_seconds"] == 5.0
