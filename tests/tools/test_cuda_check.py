"""The GPU check script's own logic, exercised on the CPU: checkpoint and checksums, child runs,
ratios, the JSON and the plot, the test-count parsing, and a clean exit without a GPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cuda_check", ROOT / "benches" / "cuda_check.py")
assert _spec is not None and _spec.loader is not None
cuda_check = importlib.util.module_from_spec(_spec)
sys.modules["cuda_check"] = cuda_check
_spec.loader.exec_module(cuda_check)


def test_the_checkpoint_has_its_size_and_checksums_of_every_tensor(tmp_path: Path) -> None:
    ckpt = cuda_check.make_checkpoint(tmp_path, 0.01, "cpu")
    sums = json.loads((ckpt / "checksums.json").read_text())
    size = (ckpt / "model.safetensors").stat().st_size
    assert 0.5 * 0.01 * (1 << 30) < size < 1.5 * 0.01 * (1 << 30)
    from safetensors.torch import load_file

    tensors = load_file(ckpt / "model.safetensors")
    assert set(sums) == set(tensors)
    assert all(float(tensors[k].double().sum()) == v for k, v in sums.items())
    assert (ckpt / "config.json").is_file()


def test_a_cpu_run_measures_every_loader_and_checks_its_tensors(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    code = cuda_check.main(
        [
            "--device", "cpu", "--sizes", "0.01", "--modes", "cold", "--no-tests",
            "--repeats", "1", "--cold-repeats", "1", "--workdir", str(tmp_path / "w"),
            "--loaders", "floor:disk_read", "fastload.load_file", "safetensors.safe_open",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    loaders = json.loads(out.read_text())["sizes"]["0.01GiB"]["modes"]["cold"]
    for name in ("fastload.load_file", "safetensors.safe_open"):
        entry = loaders[name]
        assert entry["runs"][0]["correct"], entry
        assert isinstance(entry["gb_per_s"], float) and isinstance(entry["floor_over_time"], float)
    assert isinstance(loaders["fastload.load_file"]["speedup_vs_fastest_peer"], float)
    assert "correct" not in loaders["floor:disk_read"]["runs"][0]
    cuda_check.main(["--plot", str(out)])
    assert out.with_suffix(".png").stat().st_size > 0
    page = out.with_suffix(".md").read_text()
    assert "| fastload.load_file |" in page and "--loaders floor:disk_read" in page


def test_the_tuning_grid_times_every_setting_of_load_file(tmp_path: Path) -> None:
    ckpt = cuda_check.make_checkpoint(tmp_path, 0.01, "cpu")
    result = cuda_check.run_child("tune", ckpt, "cpu", "warm", 1, timeout=120)
    grid = len(cuda_check.TUNE_STAGING) * len(cuda_check.TUNE_THREADS)
    assert len(result["settings"]) == grid * len(cuda_check.TUNE_READ_MODES), result
    assert all(v > 0 for v in result["settings"].values())


def test_residency_is_read_from_the_kernel_before_and_after_eviction(tmp_path: Path) -> None:
    from fastload.core.memory.page_cache import evict, warm

    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * (4 << 20))
    warm(path)
    assert cuda_check.resident_fraction(path) == 1.0
    evict(path)
    assert cuda_check.resident_fraction(path) < 0.5


def test_a_loader_that_fails_is_recorded_with_its_error(tmp_path: Path) -> None:
    ckpt = cuda_check.make_checkpoint(tmp_path, 0.01, "cpu")
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    result = cuda_check.run_child("fastload.load_file", ckpt, "cpu", "warm", 1, timeout=60)
    assert "error" in result and "median_seconds" not in result


def test_test_counts_come_from_the_cuda_marked_tests_only(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "@pytest.mark.cuda\ndef test_ok(): pass\n"
        "@pytest.mark.cuda\ndef test_bad(): assert False\n"
        "def test_not_gpu(): assert False\n"
    )
    result = cuda_check.run_tests(timeout=120, tests=tmp_path)
    assert (result["tests"], result["failures"]) == (2, 1)
    # The class name is the module's dotted path from pytest's rootdir, which depends on where
    # the temporary directory lies relative to the repository.
    assert len(result["failed"]) == 1 and result["failed"][0].endswith("test_x::test_bad")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a CUDA GPU")
def test_without_a_gpu_the_check_says_so_and_exits_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert cuda_check.main(["--out", str(out)]) == 0
    assert json.loads(out.read_text())["skipped"] == "no CUDA device"
