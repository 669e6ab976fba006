"""fastload.save_file / save_pretrained, round-tripped through safetensors', transformers' and
fastload's own loaders."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from tensor_samples import assert_bitwise_equal, every_dtype_tensors
from torch import nn

import fastload
from fastload import _core
from fastload.safetensors import publish, saving
from fastload.safetensors.saving import parse_size
from fastload.training.gradient_checkpointing import is_gradient_checkpointing
from safetensors import safe_open as st_safe_open

transformers = pytest.importorskip("transformers")

SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"


# --- models ---------------------------------------------------------------------------------------


def _gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _bert_mlm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


class TiedLM(nn.Module):
    """A plain module whose output projection is its embedding (one Parameter, two names)."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)
        self.out = nn.Linear(16, 50, bias=False)
        if tie:
            self.out.weight = self.embed.weight


class Uneven(nn.Module):
    """One tensor of 4000 bytes between small ones, for shard-boundary tests."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)  # 64 + 16 bytes
        self.big = nn.Linear(100, 10, bias=False)  # 4000 bytes
        self.b = nn.Linear(4, 4)


def _assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every weight file in ``directory``, read by safetensors."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(st_load_file(path))
    return out


def _metadata(path: Path) -> dict[str, str]:
    with st_safe_open(path, framework="pt") as f:
        return f.metadata()


@pytest.fixture
def transformers_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    """A function returning the warnings transformers has logged or raised so far in the test."""
    logger = logging.getLogger("transformers")
    propagate = logger.propagate
    logger.propagate = True  # transformers keeps its records to itself outside CI
    with (
        caplog.at_level(logging.WARNING, logger="transformers"),
        warnings.catch_warnings(record=True) as raised,
    ):
        warnings.simplefilter("always")

        def so_far() -> list[str]:
            logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            return logged + [str(w.message) for w in raised]

        yield so_far
    logger.propagate = propagate


# --- save_file ------------------------------------------------------------------------------------


def test_save_file_round_trips_every_dtype_through_safetensors(tmp_path: Path) -> None:
    tensors = every_dtype_tensors()
    fastload.save_file(tensors, tmp_path / "all.safetensors")
    assert_bitwise_equal(st_load_file(tmp_path / "all.safetensors"), tensors, same_order=False)


def test_save_file_round_trips_every_dtype_through_fastload(tmp_path: Path) -> None:
    tensors = every_dtype_tensors()
    fastload.save_file(tensors, tmp_path / "all.safetensors")
    assert_bitwise_equal(
        fastload.load_file(tmp_path / "all.safetensors"), tensors, same_order=False
    )


def test_save_file_stores_the_metadata(tmp_path: Path) -> None:
    meta = {"format": "pt", "note": "fastload"}
    fastload.save_file({"x": torch.ones(2)}, tmp_path / "m.safetensors", metadata=meta)
    assert _metadata(tmp_path / "m.safetensors") == meta


def test_save_file_aligns_every_tensor_to_its_element_size(tmp_path: Path) -> None:
    tensors = {
        "bytes": torch.ones(3, dtype=torch.uint8),
        "f64": torch.ones(2, dtype=torch.float64),
        "f16": torch.ones(1, dtype=torch.float16),
        "i32": torch.ones(1, dtype=torch.int32),
    }
    fastload.save_file(tensors, tmp_path / "a.safetensors")
    opened = _core.SafetensorsFile(tmp_path / "a.safetensors")
    for name, _, _, begin, _ in opened.tensors():
        assert (opened.data_start + begin) % tensors[name].element_size() == 0, name


def test_save_file_packs_non_contiguous_and_conjugated_tensors(tmp_path: Path) -> None:
    def base() -> torch.Tensor:
        return torch.arange(12, dtype=torch.float32).reshape(3, 4)

    tensors = {
        "transposed": base().t(),
        "strided": base()[:, ::2],
        "conj": torch.complex(base(), base()).conj(),
    }
    fastload.save_file(tensors, tmp_path / "v.safetensors")
    loaded = st_load_file(tmp_path / "v.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor.resolve_conj()), name


def test_save_file_refuses_tensors_that_share_memory(tmp_path: Path) -> None:
    base = torch.zeros(4, 4)
    with pytest.raises(fastload.RequestError, match="'a' and 'b' share memory"):
        fastload.save_file({"a": base, "b": base[1:3]}, tmp_path / "s.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_save_file_accepts_disjoint_views_of_one_storage(tmp_path: Path) -> None:
    base = torch.arange(8.0)
    fastload.save_file({"lo": base[:4], "hi": base[4:]}, tmp_path / "d.safetensors")
    loaded = st_load_file(tmp_path / "d.safetensors")
    assert torch.equal(loaded["lo"], base[:4]) and torch.equal(loaded["hi"], base[4:])


def test_save_file_replaces_an_existing_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    fastload.save_file({"x": torch.zeros(3)}, path)
    fastload.save_file({"y": torch.ones(5)}, path)
    assert os.listdir(tmp_path) == ["w.safetensors"]
    _assert_state_equal(st_load_file(path), {"y": torch.ones(5)})


@pytest.mark.parametrize("stem", ["x" * 243, "é" * 121 + "x"])  # 255 bytes with ".safetensors"
def test_a_file_name_of_the_longest_length_a_filesystem_takes_is_saved(
    tmp_path: Path, stem: str
) -> None:
    path = tmp_path / f"{stem}.safetensors"
    assert len(os.fsencode(path.name)) == 255
    tensors = {"w": torch.arange(6.0).reshape(2, 3)}
    fastload.save_file(tensors, path)
    fastload.save_file({"w": tensors["w"] + 1}, path)  # over an existing file, too
    assert torch.equal(fastload.load_file(path)["w"], tensors["w"] + 1)
    assert sorted(os.listdir(tmp_path)) == [path.name]


def test_a_failed_write_keeps_the_previous_file_and_removes_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.safetensors"
    fastload.save_file({"x": torch.zeros(3)}, path)
    real_write = _core.write_file

    def write_then_fail(target: str, *args: object) -> int:
        real_write(target, *args)  # the bytes reach the temporary file, then the disk "fails"
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saving._core, "write_file", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        fastload.save_file({"x": torch.ones(3)}, path)
    assert os.listdir(tmp_path) == ["w.safetensors"]
    _assert_state_equal(st_load_file(path), {"x": torch.zeros(3)})


def test_save_file_refuses_non_string_metadata(tmp_path: Path) -> None:
    with pytest.raises(fastload.RequestError, match="metadata"):
        fastload.save_file({"x": torch.ones(1)}, tmp_path / "m.safetensors", metadata={"n": 1})


def test_save_file_refuses_a_meta_tensor_naming_it(tmp_path: Path) -> None:
    with pytest.raises(fastload.RequestError, match="'ghost' is on the meta device"):
        fastload.save_file({"ghost": torch.empty(2, device="meta")}, tmp_path / "g.safetensors")


# --- shard sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "expected"),
    [(1234, 1234), ("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30),
     ("1.5KB", 1500), ("64kib", 65536)],
)  # fmt: skip
def test_max_shard_size_accepts_bytes_and_unit_strings(size: int | str, expected: int) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["5 parsecs", "GB", 0, -1, True, 2.5])
def test_max_shard_size_refuses_anything_else(size: object) -> None:
    with pytest.raises(fastload.RequestError, match="max_shard_size"):
        parse_size(size)  # type: ignore[arg-type]


# --- save_pretrained: ties ------------------------------------------------------------------------


def test_gpt2_tied_embeddings_are_stored_once_under_the_name_transformers_keeps(
    tmp_path: Path,
) -> None:
    fastload.save_pretrained(_gpt2(), tmp_path)
    stored = _stored(tmp_path)
    assert "transformer.wte.weight" in stored and "lm_head.weight" not in stored
    tied = json.loads(_metadata(tmp_path / "model.safetensors")["fastload.tied"])
    assert tied == {"lm_head.weight": "transformer.wte.weight"}


def test_transformers_loads_a_fastload_gpt2_without_warnings_and_with_ties_intact(
    tmp_path: Path, transformers_warnings: Callable[[], list[str]]
) -> None:
    model = _gpt2()
    fastload.save_pretrained(model, tmp_path)
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    _assert_state_equal(loaded.state_dict(), model.state_dict())
    assert transformers_warnings() == []


def test_bert_mlm_decoder_weight_and_bias_are_stored_once_and_reload_tied(tmp_path: Path) -> None:
    model = _bert_mlm()
    fastload.save_pretrained(model, tmp_path)
    stored = _stored(tmp_path)
    assert "cls.predictions.decoder.weight" not in stored
    assert "cls.predictions.decoder.bias" not in stored
    loaded, info = transformers.BertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    assert loaded.cls.predictions.decoder.bias is loaded.cls.predictions.bias
    _assert_state_equal(loaded.state_dict(), model.state_dict())


def test_a_plain_module_tie_is_recorded_so_a_plain_load_can_retie_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    fastload.save_pretrained(model, tmp_path)
    path = tmp_path / "model.safetensors"
    state = fastload.load_file(path)
    tied = json.loads(_metadata(path)["fastload.tied"])
    assert tied == {"out.weight": "embed.weight"} and "out.weight" not in state
    untied = TiedLM(tie=False)
    untied.load_state_dict({**state, **{a: state[c] for a, c in tied.items()}})
    _assert_state_equal(untied.state_dict(), model.state_dict())


# --- save_pretrained: layout ----------------------------------------------------------------------


def test_a_plain_module_is_saved_as_one_file_with_format_pt_and_no_config(tmp_path: Path) -> None:
    model = TiedLM(tie=False)
    fastload.save_pretrained(model, tmp_path, metadata={"origin": "test"})
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert _metadata(tmp_path / "model.safetensors") == {"format": "pt", "origin": "test"}
    _assert_state_equal(_stored(tmp_path), model.state_dict())


def test_a_sharded_save_uses_the_transformers_names_and_index(tmp_path: Path) -> None:
    model = _gpt2()
    fastload.save_pretrained(model, tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    count = len(shards)
    assert count > 1
    assert [p.name for p in shards] == [SHARD_NAME.format(i, count) for i in range(1, count + 1)]
    for shard in shards:
        with st_safe_open(shard, framework="pt") as f:
            assert all(index["weight_map"][k] == shard.name for k in f.keys())
    stored = _stored(tmp_path)
    assert sorted(index["weight_map"]) == sorted(stored)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in stored.values())


def test_shards_and_index_match_the_ones_transformers_writes(tmp_path: Path) -> None:
    model = _bert_mlm()
    model.save_pretrained(tmp_path / "hf", max_shard_size="16KB")
    fastload.save_pretrained(model, tmp_path / "fl", max_shard_size="16KB")
    hf = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    fl = json.loads((tmp_path / "fl" / "model.safetensors.index.json").read_text())
    assert fl["weight_map"] == hf["weight_map"]
    fl["metadata"].pop("fastload.tied")
    assert fl["metadata"] == hf["metadata"]


def test_transformers_loads_a_sharded_fastload_checkpoint(tmp_path: Path) -> None:
    model = _gpt2()
    fastload.save_pretrained(model, tmp_path, max_shard_size="20KB")
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    _assert_state_equal(loaded.state_dict(), model.state_dict())


def test_every_shard_loads_the_same_in_fastload_and_safetensors(tmp_path: Path) -> None:
    fastload.save_pretrained(_bert_mlm(), tmp_path, max_shard_size="16KB")
    for shard in tmp_path.glob("model-*.safetensors"):
        assert_bitwise_equal(fastload.load_file(shard), st_load_file(shard), same_order=False)


def test_a_tensor_larger_than_the_shard_size_gets_a_shard_of_its_own(tmp_path: Path) -> None:
    fastload.save_pretrained(Uneven(), tmp_path, max_shard_size=1000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    # huggingface_hub's rule: the big tensor is set aside, the small ones keep filling a shard.
    assert len(set(index["weight_map"].values())) == 2
    alone = index["weight_map"]["big.weight"]
    assert [k for k, f in index["weight_map"].items() if f == alone] == ["big.weight"]


def test_saving_fewer_shards_removes_the_stale_shards_of_the_previous_save(tmp_path: Path) -> None:
    model = _gpt2()
    fastload.save_pretrained(model, tmp_path, max_shard_size="10KB")
    fastload.save_pretrained(model, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(
        set(index["weight_map"].values())
    )
    _assert_state_equal(_stored(tmp_path), {k: v for k, v in model.state_dict().items()
                                            if k != "lm_head.weight"})  # fmt: skip


def test_switching_to_a_single_file_removes_the_index_and_the_shards(tmp_path: Path) -> None:
    model = _gpt2()
    fastload.save_pretrained(model, tmp_path, max_shard_size="20KB")
    fastload.save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [
        "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip


def test_switching_to_shards_removes_the_previous_single_file(tmp_path: Path) -> None:
    model = _gpt2()
    fastload.save_pretrained(model, tmp_path)
    fastload.save_pretrained(model, tmp_path, max_shard_size="20KB")
    assert not (tmp_path / "model.safetensors").exists()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    _assert_state_equal(loaded.state_dict(), model.state_dict())


def test_an_interrupted_save_leaves_the_previous_checkpoint_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _gpt2(seed=0)
    fastload.save_pretrained(old, tmp_path, max_shard_size="20KB")
    before = sorted(os.listdir(tmp_path))
    real_write = _core.write_file
    calls = [0]

    def fail_on_second_shard(target: str, *args: object) -> int:
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt  # the process is stopped mid-save
        return real_write(target, *args)

    monkeypatch.setattr(saving._core, "write_file", fail_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        fastload.save_pretrained(_gpt2(seed=1), tmp_path, max_shard_size="20KB")
    assert sorted(os.listdir(tmp_path)) == before  # no temporary file or directory left
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    _assert_state_equal(loaded.state_dict(), old.state_dict())


def test_a_data_parallel_wrapper_is_saved_without_its_module_prefix(tmp_path: Path) -> None:
    model = TiedLM(tie=False)
    fastload.save_pretrained(nn.DataParallel(model), tmp_path)
    _assert_state_equal(_stored(tmp_path), model.state_dict())


# --- save_pretrained: replacing a directory in one step -------------------------------------------


def _files(directory: Path) -> dict[str, bytes]:
    """Every regular file under ``directory`` (relative path -> bytes)."""
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _add_unrelated_files(directory: Path) -> None:
    (directory / "tokenizer.json").write_text('{"vocab": {}}')
    (directory / "README.md").write_text("# my model\n")
    (directory / "runs").mkdir()
    (directory / "runs" / "events.log").write_text("step 1\n")
    (directory / "readme-link").symlink_to("README.md")


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    return int(child.stdout)


def test_saving_over_a_checkpoint_keeps_the_other_files_of_the_directory(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    fastload.save_pretrained(TiedLM(tie=False), target, max_shard_size=4000)
    _add_unrelated_files(target)
    others = {k: v for k, v in _files(target).items() if not k.startswith("model")}
    new = TiedLM(tie=False)
    fastload.save_pretrained(new, target)
    assert {k: v for k, v in _files(target).items() if not k.startswith("model")} == others
    assert os.readlink(target / "readme-link") == "README.md"
    assert sorted(p.name for p in target.glob("model*")) == ["model.safetensors"]
    _assert_state_equal(_stored(target), new.state_dict())


def test_a_save_over_a_checkpoint_leaves_no_staging_directory_behind(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    fastload.save_pretrained(TiedLM(tie=False), target, max_shard_size=4000)
    fastload.save_pretrained(TiedLM(tie=False), target, max_shard_size=4000)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert not [name for name in os.listdir(target) if name.startswith(".")]


def test_the_next_save_removes_the_staging_directory_a_killed_save_left(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    fastload.save_pretrained(TiedLM(tie=False), target)
    leftover = tmp_path / f".fastload-ckpt.{_dead_pid()}-0123abcd.tmp"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half written")
    fastload.save_pretrained(TiedLM(tie=False), target)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_save_leaves_a_staging_directory_whose_lock_is_held_alone(tmp_path: Path) -> None:
    # Ownership is the lock beside the directory (see test_save_ownership.py for other
    # processes); the pid in the name means nothing.
    from fastload.safetensors.ownership import OwnerLock

    target = tmp_path / "ckpt"
    running = tmp_path / f".fastload-ckpt.{_dead_pid()}-0123abcd.tmp"
    lock = OwnerLock(running)
    running.mkdir()
    try:
        fastload.save_pretrained(TiedLM(tie=False), target)
        assert sorted(os.listdir(tmp_path)) == sorted(
            [running.name, running.name + ".lock", "ckpt"]
        )
    finally:
        lock.release()


def test_a_failure_just_before_the_swap_leaves_the_old_checkpoint_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ckpt"
    old = TiedLM(tie=False)
    fastload.save_pretrained(old, target, max_shard_size=4000)
    _add_unrelated_files(target)
    before = _files(target)
    real_exchange = publish._exchange

    def interrupted_at_the_swap(a: Path, b: Path) -> None:
        if Path(b) == target:  # the publishing exchange, not the capability probe
            raise KeyboardInterrupt
        real_exchange(a, b)

    monkeypatch.setattr(publish, "_exchange", interrupted_at_the_swap)
    with pytest.raises(KeyboardInterrupt):
        fastload.save_pretrained(TiedLM(tie=False), target, max_shard_size=4000)
    assert _files(target) == before
    assert os.listdir(tmp_path) == ["ckpt"]
    _assert_state_equal(_stored(target), old.state_dict())


def test_without_an_atomic_exchange_files_are_renamed_one_by_one_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "ckpt"
    fastload.save_pretrained(TiedLM(tie=False), target, max_shard_size=4000)
    _add_unrelated_files(target)
    monkeypatch.setattr(publish, "_renameat2", lambda: None)  # no renameat2 in this C library
    new = TiedLM(tie=False)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        fastload.save_pretrained(new, target)
    assert any("one by one" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(target)) == [
        "README.md", "model.safetensors", "readme-link", "runs", "tokenizer.json",
    ]  # fmt: skip
    assert os.listdir(tmp_path) == ["ckpt"]
    _assert_state_equal(_stored(target), new.state_dict())


def test_with_no_room_beside_the_directory_files_are_staged_inside_it_and_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "ckpt"
    fastload.save_pretrained(TiedLM(tie=False), target, max_shard_size=4000)
    real_mkdir = publish._mkdir_staging

    def parent_not_writable(place: Path, target_name: str | None) -> Path:
        if target_name is not None:
            raise PermissionError(13, "Permission denied", str(place))
        return real_mkdir(place, target_name)

    monkeypatch.setattr(publish, "_mkdir_staging", parent_not_writable)
    new = TiedLM(tie=False)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        fastload.save_pretrained(new, target)
    assert any("cannot create a directory beside it" in r.getMessage() for r in caplog.records)
    assert os.listdir(target) == ["model.safetensors"]
    _assert_state_equal(_stored(target), new.state_dict())


def test_files_that_cannot_be_hard_linked_are_copied_into_the_new_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "ckpt"
    fastload.save_pretrained(TiedLM(tie=False), target)
    _add_unrelated_files(target)
    others = {k: v for k, v in _files(target).items() if not k.startswith("model")}

    def no_hard_links(*args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted")  # fs.protected_hardlinks

    monkeypatch.setattr(publish.os, "link", no_hard_links)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        fastload.save_pretrained(TiedLM(tie=False), target)
    assert not caplog.records  # still one atomic swap, not the file-by-file fallback
    assert {k: v for k, v in _files(target).items() if not k.startswith("model")} == others


def test_the_directory_keeps_its_permission_bits(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    fastload.save_pretrained(TiedLM(tie=False), target)
    target.chmod(0o750)
    fastload.save_pretrained(TiedLM(tie=False), target)
    assert target.stat().st_mode & 0o7777 == 0o750


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_the_directory_keeps_its_owner(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    fastload.save_pretrained(TiedLM(tie=False), target)
    os.chown(target, 65534, 65534)
    fastload.save_pretrained(TiedLM(tie=False), target)
    assert (target.stat().st_uid, target.stat().st_gid) == (65534, 65534)


def test_saving_through_a_symlink_replaces_the_directory_it_points_to(tmp_path: Path) -> None:
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    model = TiedLM(tie=False)
    fastload.save_pretrained(model, link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    _assert_state_equal(_stored(real), model.state_dict())


def test_saving_into_the_working_directory_leaves_it_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    monkeypatch.chdir(target)
    fastload.save_pretrained(TiedLM(tie=False), ".")
    assert os.path.samefile(os.getcwd(), target)
    assert sorted(os.listdir(".")) == ["model.safetensors"]


# --- save_pretrained: config ----------------------------------------------------------------------


def test_the_config_is_written_by_transformers_and_loads_back(tmp_path: Path) -> None:
    fastload.save_pretrained(_bert_mlm(), tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.architectures == ["BertForMaskedLM"]
    assert config.hidden_size == 32


def test_a_legacy_gradient_checkpointing_key_is_not_written_back(tmp_path: Path) -> None:
    model = _bert_mlm()
    model.config.gradient_checkpointing = True
    fastload.save_pretrained(model, tmp_path)
    assert "gradient_checkpointing" not in json.loads((tmp_path / "config.json").read_text())


def test_checkpointing_on_at_save_time_is_not_saved(tmp_path: Path) -> None:
    model = _bert_mlm()
    fastload.gradient_checkpointing_enable(model)
    fastload.save_pretrained(model, tmp_path)
    assert "gradient_checkpointing" not in (tmp_path / "config.json").read_text()
    assert not is_gradient_checkpointing(transformers.BertForMaskedLM.from_pretrained(tmp_path))


# --- the other direction, and fastload.from_pretrained ------------------------------------------


def test_a_transformers_checkpoint_loads_in_fastload_load_file(tmp_path: Path) -> None:
    model = _gpt2()
    model.save_pretrained(tmp_path)
    loaded = fastload.load_file(tmp_path / "model.safetensors")
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    _assert_state_equal(loaded, want)


def test_fastload_from_pretrained_loads_a_sharded_fastload_checkpoint_with_ties(
    tmp_path: Path,
) -> None:
    model = _gpt2()
    fastload.save_pretrained(model, tmp_path, max_shard_size="20KB")
    loaded = fastload.from_pretrained(transformers.GPT2LMHeadModel, tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    _assert_state_equal(loaded.state_dict(), model.state_dict())


def test_fastload_from_pretrained_loads_a_sharded_transformers_checkpoint(tmp_path: Path) -> None:
    model = _bert_mlm()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    loaded = fastload.from_pretrained(transformers.BertForMaskedLM, tmp_path)
    assert loaded.cls.predictions.decoder.weight is loaded.bert.embeddings.word_embeddings.weight
    _assert_state_equal(loaded.state_dict(), model.state_dict())


def test_fastload_from_pretrained_loads_a_plain_module_saved_by_fastload_with_its_tie(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    fastload.save_pretrained(model, tmp_path)
    loaded, report = fastload.from_pretrained(TiedLM, tmp_path, output_loading_info=True)
    assert loaded.out.weight is loaded.embed.weight
    assert not report.missing and not report.unexpected
    _assert_state_equal(loaded.state_dict(), model.state_dict())


@pytest.mark.parametrize("shard_size", ["5GB", 4000], ids=["single-file", "sharded"])
def test_a_model_that_does_not_tie_gets_the_saved_alias_from_its_canonical_tensor(
    tmp_path: Path, shard_size: int | str
) -> None:
    torch.manual_seed(0)
    model = TiedLM()  # out.weight is stored once, as embed.weight
    fastload.save_pretrained(model, tmp_path, max_shard_size=shard_size)
    loaded, report = fastload.from_pretrained(
        lambda: TiedLM(tie=False), tmp_path, strict=True, output_loading_info=True
    )
    assert loaded.out.weight is not loaded.embed.weight
    assert not report.missing and not report.initialized
    _assert_state_equal(loaded.state_dict(), model.state_dict())


def test_with_a_shared_mapping_an_untied_alias_gets_its_own_memory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    fastload.save_pretrained(model, tmp_path)
    loaded = fastload.from_pretrained(lambda: TiedLM(tie=False), tmp_path, mmap="shared")
    assert torch.equal(loaded.out.weight, model.embed.weight)
    with torch.no_grad():
        loaded.embed.weight.add_(1.0)
    assert torch.equal(loaded.out.weight, model.embed.weight)


def test_a_malformed_tied_record_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = TiedLM(tie=False).state_dict()
    del state["out.weight"]
    fastload.save_file(state, tmp_path / "model.safetensors", metadata={"fastload.tied": "[1]"})
    with caplog.at_level(logging.WARNING, logger="fastload"):
        _, report = fastload.from_pretrained(
            lambda: TiedLM(tie=False), tmp_path, output_loading_info=True
        )
    assert any("'fastload.tied' is not a JSON object" in r.getMessage() for r in caplog.records)
    assert report.missing == ["out.weight"]
