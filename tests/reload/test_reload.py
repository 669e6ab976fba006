"""fastload.reload: a new checkpoint into a model fastload loaded, in place (issue 44).

What a user relies on: every parameter and buffer keeps its memory (data_ptr), ties stay ties,
the load's dtype and key mapping are kept, a checkpoint that does not fit is refused before a byte
is written (naming the tensors), and with digests only the changed tensors are read. The faults
(a file truncated meanwhile, read errors, Ctrl-C, atomic=True) are in test_reload_faults.py.
"""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import safetensors.torch
import torch
from torch import nn

import fastload
import safetensors
from fastload.reloading import files as reload_files


class Tied(nn.Module):
    """Tied embedding and head, a buffer, and enough tensors for shards."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(ids)) * self.scale)


def _model(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def _save(model: nn.Module, path, **kwargs) -> None:
    fastload.save_pretrained(model, path, max_shard_size="8KB", **kwargs)


def _pointers(model: nn.Module) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _same(model: nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    got = model.state_dict()
    return set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in got)


@pytest.fixture
def two(tmp_path):
    """Checkpoint a (the model's) and b (new weights, same architecture), sharded, with
    digests."""
    a, b = tmp_path / "a", tmp_path / "b"
    _save(_model(1), a, digests=True)
    _save(_model(2), b, digests=True)
    assert len(list(b.glob("*.safetensors"))) > 2
    return a, b


def test_reload_writes_the_new_weights_into_the_same_memory_and_keeps_ties(two):
    a, b = two
    model = fastload.from_pretrained(Tied, a, progress=False)
    before = _pointers(model)
    report = fastload.reload(model, b)
    assert _pointers(model) == before
    assert model.head.weight is model.emb.weight
    assert _same(model, _values(fastload.from_pretrained(Tied, b, progress=False)))
    # the tie is read once; the buffer `scale` (ones in both) has the same digest: skipped
    assert (report.tensors_read, report.tensors_unchanged) == (9, 1)
    total = sum(t.nbytes for t in _model(2).state_dict().values())
    assert report.bytes_read == total - 64 * 32 * 4 - 32 * 4
    assert model(torch.tensor([[1, 2]])).shape == (1, 2, 64)


def test_reload_keeps_the_dtype_of_the_load_and_converts_the_new_checkpoint(two):
    a, b = two
    model = fastload.from_pretrained(Tied, a, dtype=torch.bfloat16, progress=False)
    before = _pointers(model)
    fastload.reload(model, b)
    assert _pointers(model) == before
    assert all(t.dtype == torch.bfloat16 for t in model.parameters())
    want = {k: v.to(torch.bfloat16) for k, v in _model(2).state_dict().items()}
    assert _same(model, want)


def test_reload_into_views_of_the_old_file_leaves_that_file_alone(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    fastload.save_file({"weight": torch.zeros(8, 4), "bias": torch.zeros(8)}, a)
    fastload.save_file({"weight": torch.ones(8, 4), "bias": torch.ones(8)}, b)
    old = a.read_bytes()
    model = fastload.from_pretrained(nn.Linear(4, 8), a, mmap="shared", progress=False)
    fastload.reload(model, b)
    assert torch.equal(model.weight, torch.ones(8, 4)) and torch.equal(model.bias, torch.ones(8))
    assert a.read_bytes() == old  # the views were of a private mapping


def test_reload_through_the_staged_path_fills_the_same_memory(two, monkeypatch):
    # accelerator destinations go through core.streaming.stream_into; CPU ones take it here too
    a, b = two
    model = fastload.from_pretrained(Tied, a, progress=False)
    before = _pointers(model)
    calls = []
    real = reload_files.stream_into

    def spy(file, items, **kwargs):
        calls.append(len(items))
        return real(file, items, **kwargs)

    monkeypatch.setattr(reload_files, "_staged", lambda device: True)
    monkeypatch.setattr(reload_files, "stream_into", spy)
    fastload.reload(model, b)
    assert sum(calls) == 9
    assert _pointers(model) == before
    assert _same(model, _model(2).state_dict())


def test_reload_from_a_state_dict(two):
    a, _ = two
    model = fastload.from_pretrained(Tied, a, progress=False)
    new = {k: v for k, v in _model(3).state_dict().items() if k != "head.weight"}
    fastload.reload(model, new)
    assert _same(model, _model(3).state_dict())


def test_a_model_fastload_did_not_load_is_refused():
    with pytest.raises(fastload.RequestError, match="from_pretrained"):
        fastload.reload(Tied(), "anything")


# --- refused before a byte is written ------------------------------------------------------------


def _refused(model: nn.Module, source, error: type[Exception], *names: str) -> None:
    before = _values(model)
    with pytest.raises(error) as info:
        fastload.reload(model, source)
    for name in names:
        assert name in str(info.value)
    assert "nothing was written" in str(info.value)
    assert _same(model, before)


def test_a_checkpoint_of_another_shape_is_refused_naming_every_tensor(two, tmp_path):
    a, b = two
    model = fastload.from_pretrained(Tied, a, progress=False)
    state = _model(2).state_dict()
    del state["head.weight"]
    state["blocks.3.weight"] = torch.zeros(16, 32)
    state["scale"] = torch.zeros(33)
    fastload.save_file(state, tmp_path / "other.safetensors")
    _refused(
        model,
        tmp_path / "other.safetensors",
        fastload.ModelMismatchError,
        "'blocks.3.weight' has shape [16, 32]",
        "'scale' has shape [33]",
    )


def test_missing_unknown_and_unconvertible_tensors_are_refused(two, tmp_path):
    a, _ = two
    model = fastload.from_pretrained(Tied, a, progress=False)
    state = {k: v for k, v in _model(2).state_dict().items() if k != "head.weight"}
    del state["blocks.0.bias"]
    state["extra.weight"] = torch.zeros(2)
    state["scale"] = torch.ones(32, dtype=torch.int32)
    fastload.save_file(state, tmp_path / "bad.safetensors")
    _refused(
        model,
        tmp_path / "bad.safetensors",
        fastload.CheckpointError,
        "'blocks.0.bias'",
        "extra.weight",
        "'scale' is stored as I32",
    )


# --- digests: only what changed -------------------------------------------------------------------


def test_save_file_writes_digests_only_when_asked(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.int16)}
    fastload.save_file(tensors, tmp_path / "plain.safetensors")
    safetensors.torch.save_file(tensors, tmp_path / "theirs.safetensors")
    assert (tmp_path / "plain.safetensors").read_bytes() == (
        tmp_path / "theirs.safetensors"
    ).read_bytes()
    fastload.save_file(tensors, tmp_path / "d.safetensors", metadata={"k": "v"}, digests=True)
    with safetensors.safe_open(tmp_path / "d.safetensors", "pt") as f:
        meta = f.metadata()
    recorded = json.loads(meta["fastload.digests"])
    assert meta["k"] == "v"
    for name, t in tensors.items():  # the bytes a reader of the file gets, hashed here
        want = hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest()
        assert recorded[name] == f"blake2b-128:{want}"
    with pytest.raises(fastload.RequestError, match="fastload.digests"):
        fastload.save_file(
            tensors, tmp_path / "x.safetensors", {"fastload.digests": ""}, digests=True
        )


def test_with_digests_only_the_changed_tensors_are_read_and_copied(tmp_path):
    base = _model(1)
    _save(base, tmp_path / "a", digests=True)
    changed = copy.deepcopy(base)
    with torch.no_grad():
        changed.blocks[2].weight.add_(1.0)
    _save(changed, tmp_path / "b", digests=True)
    model = fastload.from_pretrained(Tied, tmp_path / "a", progress=False)
    # a change made to the model in place is not described by the digests: skipped tensors keep
    # it, which shows they were not copied
    with torch.no_grad():
        model.blocks[0].bias.fill_(7.0)
    report = fastload.reload(model, tmp_path / "b")
    assert (report.tensors_read, report.tensors_unchanged) == (1, 9)
    assert report.bytes_read == 32 * 32 * 4
    assert json.loads(json.dumps(report.to_dict()))["bytes_unchanged"] == report.bytes_unchanged
    assert "1 tensors read" in str(report) and "9 unchanged" in str(report)
    assert torch.equal(model.blocks[2].weight, changed.blocks[2].weight)
    assert torch.equal(model.blocks[0].bias, torch.full((32,), 7.0))
    # skip_unchanged=False reads everything
    report = fastload.reload(model, tmp_path / "b", skip_unchanged=False)
    assert (report.tensors_read, report.tensors_unchanged) == (10, 0)
    assert _same(model, changed.state_dict())


def test_without_digests_on_either_side_everything_is_read(tmp_path):
    _save(_model(1), tmp_path / "a")
    _save(_model(1), tmp_path / "b", digests=True)
    model = fastload.from_pretrained(Tied, tmp_path / "a", progress=False)
    assert fastload.reload(model, tmp_path / "b").tensors_unchanged == 0
    # the model now carries b's digests: reloading b again skips everything
    report = fastload.reload(model, tmp_path / "b")
    assert (report.tensors_read, report.tensors_unchanged) == (0, 10)


@pytest.mark.parametrize("class_name", ["LlamaForCausalLM", "GPT2LMHeadModel", "BertForMaskedLM"])
def test_a_transformers_model_reloads_to_the_outputs_of_a_fresh_load(class_name, tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import assert_same_outputs, example_inputs, make_checkpoint

    a = make_checkpoint(tmp_path / "a", class_name, seed=1, max_shard_size="20KB")
    b = make_checkpoint(tmp_path / "b", class_name, seed=2, max_shard_size="20KB")
    model = fastload.from_pretrained(a, progress=False)
    before = _pointers(model)
    fastload.reload(model, b)
    assert _pointers(model) == before
    fresh = fastload.from_pretrained(b, progress=False)
    assert_same_outputs(model, fresh, example_inputs(fresh))


def test_arguments_are_checked_before_the_checkpoint_is_opened(two):
    a, b = two
    model = fastload.from_pretrained(Tied, a, progress=False)
    with pytest.raises(TypeError, match="atomic"):
        fastload.reload(model, b, atomic="yes")  # type: ignore[arg-type]
    with pytest.raises(fastload.RequestError, match="threads"):
        fastload.reload(model, b, threads=0)
    with pytest.raises(fastload.RequestError, match="storage_options"):
        fastload.reload(model, b, storage_options={"region": "x"})


def test_a_model_loaded_with_tensors_offloaded_to_disk_is_refused(tmp_path):
    pytest.importorskip("accelerate")
    fastload.save_pretrained(_model(1), tmp_path / "a")
    model = fastload.from_pretrained(
        Tied,
        tmp_path / "a",
        device_map={"blocks": "disk", "": "cpu"},
        offload_folder=tmp_path / "offload",
        progress=False,
    )
    with pytest.raises(fastload.UnsupportedError, match="offloaded to disk"):
        fastload.reload(model, tmp_path / "a")
