"""The ``fastload`` command line. Exit statuses and stderr are checked in a separate process
(``python -m fastload.tools.cli``); what the commands print and write is checked through
``fastload.tools.cli.main`` in this process, which spares a torch import per test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from torch import nn

import fastload
from fastload.tools.cli import main
from fastload.tools.convert import dedupe_shared
from safetensors import safe_open as st_safe_open


def cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastload.tools.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def run_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str]:
    """``fastload ARGS`` in this process: (exit status, stdout)."""
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert status == 0, err
    return status, out


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10)
        self.head.weight = self.embed.weight


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    fastload.save_pretrained(model, tmp_path / "ckpt", max_shard_size=1500)
    return tmp_path / "ckpt"


# --- inspect -----------------------------------------------------------------------------------


def test_inspect_lists_every_tensor_with_its_dtype_shape_and_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.safetensors"
    tensors = {"weight": torch.zeros(3, 4), "ids": torch.arange(5)}
    fastload.save_file(tensors, path, metadata={"format": "pt"})
    _, out = run_main(capsys, "inspect", path)
    lines = out.splitlines()
    table = lines[
        next(i for i, line in enumerate(lines) if line.split()[:2] == ["name", "dtype"]) :
    ]
    rows = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert rows == {"weight": ["F32", "[3,", "4]", "48", "B"], "ids": ["I64", "[5]", "40", "B"]}
    assert '"format": "pt"' in out


def test_inspect_json_describes_every_shard_of_a_sharded_checkpoint(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = json.loads(run_main(capsys, "inspect", sharded, "--json")[1])
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(info["files"]) == len(set(index["weight_map"].values())) > 1
    names = {t["name"] for f in info["files"] for t in f["tensors"]}
    assert names == set(index["weight_map"])
    assert info["bytes"] == sum(t["bytes"] for f in info["files"] for t in f["tensors"])
    assert info["bytes"] == index["metadata"]["total_size"]
    assert info["dtypes"] == {"F32": {"tensors": 6, "bytes": 3 * (16 * 16 + 16) * 4}}


# --- verify ------------------------------------------------------------------------------------


def test_verify_accepts_a_sound_sharded_checkpoint_after_reading_all_of_it(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out = run_main(capsys, "verify", sharded)
    total = 3 * (16 * 16 + 16) * 4
    assert out.startswith("OK ")
    assert f"6 tensors, {total / 1024:.1f} KiB of tensor data ({total / 1024:.1f} KiB read)" in out


def test_verify_names_the_shard_whose_header_is_broken(sharded: Path) -> None:
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[8] = ord("[")  # the header must be a JSON object
    shard.write_bytes(bytes(data))
    assert_one_line_error(cli("verify", sharded), shard.name, "fastload: error:")


def test_verify_reports_an_index_that_lists_a_missing_shard(sharded: Path) -> None:
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    shard.unlink()
    assert_one_line_error(cli("verify", sharded), shard.name, "missing")


def test_verify_reports_a_data_region_the_file_no_longer_holds(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    fastload.save_file({"w": torch.zeros(64)}, path)
    path.write_bytes(path.read_bytes()[:-8])  # truncated: the header still claims 256 bytes
    assert_one_line_error(cli("verify", path), str(path))


# --- convert -----------------------------------------------------------------------------------


def test_convert_writes_the_pickle_tensors_and_stores_a_tied_weight_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = Tied()
    state = model.state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    _, out = run_main(capsys, "convert", tmp_path / "pytorch_model.bin", tmp_path / "out")
    assert "head.weight = embed.weight" in out
    written = st_load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(written) == ["embed.weight", "head.bias", "norm.bias", "norm.weight"]
    for name, tensor in written.items():
        assert torch.equal(tensor, state[name]), name
    with st_safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata["fastload.tied"]) == {"head.weight": "embed.weight"}


def test_a_converted_transformers_checkpoint_loads_with_its_tie_and_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    from tiny_models import assert_same_outputs, example_inputs, make_model

    model = make_model("GPT2LMHeadModel")
    source = tmp_path / "pickled"
    model.config.save_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")
    run_main(capsys, "convert", source, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
    loaded = fastload.from_pretrained(transformers.GPT2LMHeadModel, tmp_path / "out")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert_same_outputs(loaded, model, example_inputs(model))


def test_convert_refuses_a_pickle_that_would_run_code(tmp_path: Path) -> None:
    bad = tmp_path / "evil.bin"
    torch.save({"w": torch.zeros(2), "extra": Path("x")}, bad)
    assert_one_line_error(cli("convert", bad, tmp_path / "out"), "weights_only=True", str(bad))
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_convert_keeps_an_existing_output_unless_told_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "a.bin")
    run_main(capsys, "convert", tmp_path / "a.bin", tmp_path / "out")
    torch.save({"w": torch.zeros(2)}, tmp_path / "b.bin")
    assert_one_line_error(cli("convert", tmp_path / "b.bin", tmp_path / "out"), "--overwrite")
    run_main(capsys, "convert", tmp_path / "b.bin", tmp_path / "out", "--overwrite")
    assert torch.equal(st_load_file(tmp_path / "out" / "model.safetensors")["w"], torch.zeros(2))


def test_convert_unwraps_a_training_checkpoint_state_dict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"epoch": 3, "state_dict": {"w": torch.ones(2)}}, tmp_path / "train.pt")
    run_main(capsys, "convert", tmp_path / "train.pt", tmp_path / "out")
    assert sorted(st_load_file(tmp_path / "out" / "model.safetensors")) == ["w"]


def test_convert_joins_the_shards_of_a_sharded_pickle_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.zeros(3)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    weight_map = {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    run_main(capsys, "convert", tmp_path, tmp_path / "out")
    written = st_load_file(tmp_path / "out" / "model.safetensors")
    assert {k: v.tolist() for k, v in written.items()} == {"a": [1.0, 1.0], "b": [0.0] * 3}


def test_slices_of_a_fused_weight_are_stored_as_separate_copies() -> None:
    fused = torch.arange(12.0).reshape(6, 2)
    state = {"qkv": fused, "q": fused[:2], "k": fused[2:4], "same": fused}
    tensors, aliases, cloned = dedupe_shared(state)
    assert aliases == {"same": "qkv"}
    assert sorted(cloned) == ["k", "q"]
    assert tensors["q"].untyped_storage().data_ptr() != fused.untyped_storage().data_ptr()
    assert torch.equal(tensors["k"], fused[2:4])


# --- help and bad input -------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "bench", "demo"])
def test_every_subcommand_has_help(command: str) -> None:
    result = cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["inspect", "no/such/file.safetensors"], "No such file or directory"),
        (["verify", "no/such/dir"], "No such file or directory"),
        (["inspect"], "required"),
        (["frobnicate"], "invalid choice"),
        (["convert", "no/such.bin", "out"], "No such file or directory"),
        (["bench", "--loaders", "nope"], "unknown loader"),
    ],
)
def test_bad_input_exits_with_status_1_and_one_line(
    tmp_path: Path, args: list[str], fragment: str
) -> None:
    assert_one_line_error(cli(*args, cwd=tmp_path), fragment)


def test_a_file_that_is_not_safetensors_is_one_line_naming_the_rule(tmp_path: Path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\xff" * 64)
    assert_one_line_error(cli("inspect", path), str(path), "[")


def test_a_pickle_checkpoint_given_to_inspect_is_refused_in_one_line(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    assert_one_line_error(cli("inspect", tmp_path / "pytorch_model.bin"), "pickle")


# the installed console script, else the launcher scripts/checkout_env.py writes into a checkout
# (.bin/fastload, what `source scripts/activate.sh` puts on PATH)
SCRIPT = next(
    (
        p
        for p in (
            Path(sys.executable).parent / "fastload",
            Path(fastload.__file__).resolve().parents[2] / ".bin" / "fastload",
        )
        if p.is_file()
    ),
    None,
)


@pytest.mark.skipif(SCRIPT is None, reason="the console script is not installed")
def test_the_console_script_runs_the_same_command_line() -> None:
    assert SCRIPT is not None
    result = subprocess.run([SCRIPT, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.strip() == f"fastload {fastload.__version__}"
