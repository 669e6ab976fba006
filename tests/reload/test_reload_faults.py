"""fastload.reload is never torn silently (issue 44): a failure during a reload leaves the old
weights whole, or raises ReloadError naming the tensors that may hold new bytes and marks the
model so that its forward refuses to run until a reload succeeds. One test per fault: a shard
truncated or replaced during the reload, a read error, Ctrl-C, and atomic=True's budget and
checks."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from torch import nn

import fastload
from fastload.core.memory.budget import MemoryBudget
from fastload.core.reads import reading
from fastload.reloading import guard as reload_guard
from fastload.reloading import in_place as reload_module


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _model(seed: int) -> Stack:
    torch.manual_seed(seed)
    return Stack()


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.fixture
def setup(tmp_path):
    """A model loaded from a, and b: new weights in several shards (digests in both)."""
    a, b = tmp_path / "a", tmp_path / "b"
    fastload.save_pretrained(_model(1), a, max_shard_size="40KB", digests=True)
    fastload.save_pretrained(_model(2), b, max_shard_size="40KB", digests=True)
    assert len(list(b.glob("*.safetensors"))) >= 3
    model = fastload.from_pretrained(Stack, a, progress=False)
    return model, _values(model), _values(_model(2)), b


def _on_open(monkeypatch, action) -> None:
    """Runs ``action(ckpt)`` right after the reload opened and validated the checkpoint."""
    real = reload_module.open_source

    def opened(*args, **kwargs):
        ckpt = real(*args, **kwargs)
        action(ckpt)
        return ckpt

    monkeypatch.setattr(reload_module, "open_source", opened)


def _on_fill(monkeypatch, nth: int, error: BaseException) -> None:
    """The ``nth`` file's copy (from 1) raises ``error`` instead of reading."""
    real, calls = reading.fill, []

    def fill(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(reading, "fill", fill)


def _assert_torn(model: nn.Module, named: list[str], old: dict, new: dict) -> None:
    """Every tensor not named holds its old bytes or (a file read whole before) its new ones,
    and the forward refuses to run."""
    for name, value in model.state_dict().items():
        if name not in named:
            assert torch.equal(value, old[name]), name
    with pytest.raises(fastload.ReloadError, match="refuses to run"):
        model(torch.zeros(1, 64))


def _assert_whole(model: nn.Module, old: dict) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, old[name]), name
    assert model(torch.zeros(1, 64)).shape == (1, 64)


def _recovers(model: nn.Module, b, new: dict) -> None:
    fastload.reload(model, b)
    for name, value in model.state_dict().items():
        assert torch.equal(value, new[name]), name
    assert model(torch.zeros(1, 64)).shape == (1, 64)


def test_a_shard_truncated_during_the_reload_names_the_tensors_and_marks_the_model(
    setup, monkeypatch
):
    model, old, new, b = setup
    _on_open(monkeypatch, lambda ckpt: os.truncate(ckpt.files[-1].path, 200))
    with pytest.raises(fastload.ReloadError) as info:
        fastload.reload(model, b)
    named = info.value.tensors
    assert named and all(n in str(info.value) for n in named)
    # the tensors of every file read whole hold the new bytes, the error named them too
    written = [n for n in named if torch.equal(model.state_dict()[n], new[n])]
    assert written
    _assert_torn(model, named, old, new)
    monkeypatch.undo()
    fastload.save_pretrained(_model(2), b, max_shard_size="40KB", digests=True)
    _recovers(model, b, new)


def test_a_shard_truncated_during_an_atomic_reload_leaves_the_old_weights(setup, monkeypatch):
    model, old, _, b = setup
    _on_open(monkeypatch, lambda ckpt: os.truncate(ckpt.files[-1].path, 200))
    with pytest.raises(fastload.FastloadError) as info:
        fastload.reload(model, b, atomic=True)
    assert not isinstance(info.value, fastload.ReloadError)
    assert "the model is unchanged" in "".join(getattr(info.value, "__notes__", []))
    _assert_whole(model, old)


def test_a_shard_replaced_during_the_reload_reads_the_checkpoint_as_it_was_opened(
    setup, monkeypatch, tmp_path
):
    model, _, new, b = setup

    def replace(ckpt):  # a writer renames another file over the last shard
        other = tmp_path / "other.safetensors"
        fastload.save_file({"x": torch.zeros(3)}, other)
        os.replace(other, ckpt.files[-1].path)

    _on_open(monkeypatch, replace)
    fastload.reload(model, b, atomic=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, new[name]), name


def test_a_read_error_names_the_tensors_written_and_marks_the_model(setup, monkeypatch):
    model, old, new, b = setup
    _on_fill(monkeypatch, 2, fastload.FastloadIOError("injected: Input/output error"))
    with pytest.raises(fastload.ReloadError, match="injected") as info:
        fastload.reload(model, b)
    _assert_torn(model, info.value.tensors, old, new)
    monkeypatch.undo()
    _recovers(model, b, new)


def test_a_read_error_in_an_atomic_reload_leaves_the_old_weights(setup, monkeypatch):
    model, old, _, b = setup
    _on_fill(monkeypatch, 2, fastload.FastloadIOError("injected: Input/output error"))
    with pytest.raises(fastload.FastloadIOError, match="injected"):
        fastload.reload(model, b, atomic=True)
    _assert_whole(model, old)


def test_ctrl_c_during_the_reload_marks_the_model_and_stays_an_interrupt(setup, monkeypatch):
    model, old, new, b = setup
    _on_fill(monkeypatch, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt) as info:
        fastload.reload(model, b)
    assert "refuses to run" in "".join(info.value.__notes__)
    with pytest.raises(fastload.ReloadError) as refused:
        model(torch.zeros(1, 64))
    _assert_torn(model, refused.value.tensors, old, new)
    monkeypatch.undo()
    _recovers(model, b, new)


def test_ctrl_c_during_an_atomic_reload_leaves_the_old_weights(setup, monkeypatch):
    model, old, _, b = setup
    _on_fill(monkeypatch, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        fastload.reload(model, b, atomic=True)
    _assert_whole(model, old)


def test_the_commit_of_an_atomic_reload_holds_a_ctrl_c_back_until_it_is_done():
    # Python's own handler, as in a terminal: the suite may run with SIGINT ignored (a background
    # job of a non-interactive shell, nohup), which Python keeps
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        done = []
        with pytest.raises(KeyboardInterrupt):
            with reload_guard.sigint_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("after the signal")
        assert done == ["after the signal"]
        # an interrupt the process ignores stays ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with reload_guard.sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_torn_model_is_not_skipped_by_digests_on_the_next_reload(setup, monkeypatch, tmp_path):
    model, old, _, b = setup
    _on_fill(monkeypatch, 2, fastload.FastloadIOError("injected"))
    with pytest.raises(fastload.ReloadError) as info:
        fastload.reload(model, b)
    monkeypatch.undo()
    # the model's own checkpoint again: the digests of a's tensors equal those recorded at the
    # load, but the named tensors hold new bytes now, so they are read
    report = fastload.reload(model, tmp_path / "a")
    assert report.tensors_read == len(info.value.tensors)
    _assert_whole(model, old)


def test_atomic_is_refused_before_reading_when_the_staged_copies_do_not_fit(setup, monkeypatch):
    model, old, _, b = setup
    monkeypatch.setattr(reload_guard, "memory_budget", lambda: MemoryBudget(4096, "test budget"))
    _on_fill(monkeypatch, 1, AssertionError("read although refused"))
    with pytest.raises(fastload.MemoryBudgetError, match="test budget") as info:
        fastload.reload(model, b, atomic=True)
    assert "Refused before reading" in str(info.value)
    _assert_whole(model, old)


def test_atomic_checks_the_bytes_read_against_the_digests(setup, tmp_path):
    model, old, _, _ = setup
    state = _model(2).state_dict()
    lying = {name: "blake2b-128:" + "0" * 32 for name in state}
    bad = tmp_path / "bad.safetensors"
    fastload.save_file(state, bad, metadata={"fastload.digests": json.dumps(lying)})
    with pytest.raises(fastload.CheckpointError, match="do not match the digest"):
        fastload.reload(model, bad, atomic=True, verify=True)
    _assert_whole(model, old)
    with pytest.raises(fastload.RequestError, match="atomic=True"):
        fastload.reload(model, bad, verify=True)
    plain = tmp_path / "plain.safetensors"
    fastload.save_file(state, plain)
    with pytest.raises(fastload.RequestError, match="record none"):
        fastload.reload(model, plain, atomic=True, verify=True)
    _assert_whole(model, old)
    good = tmp_path / "good.safetensors"
    fastload.save_file(state, good, digests=True)
    report = fastload.reload(model, good, atomic=True, verify=True)
    assert report.tensors_verified == len(state)
