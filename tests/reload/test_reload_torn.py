"""What a torn model refuses, and what is not torn: a model marked torn by a failed reload refuses
every way of running it (``model(x)``, ``model.forward(x)``, a submodule called or its
``forward``) until a reload succeeds, with nothing installed on a model that is whole; a Ctrl-C
during the commit of ``reload(atomic=True)`` is delivered after the commit, which completes, and
does not mark the model."""

from __future__ import annotations

import os
import pickle
import signal
import sys

import pytest
import torch
from torch import nn

import fastload
from fastload.core.reads import reading
from fastload.reloading import in_place as reload_module


class Net(nn.Module):
    """A root with a weight of its own (used by its forward directly) and submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(32))
        self.body = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x * self.scale)


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


@pytest.fixture
def setup(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    fastload.save_pretrained(_net(1), a, max_shard_size="5KB", digests=True)
    fastload.save_pretrained(_net(2), b, max_shard_size="5KB", digests=True)
    assert len(list(b.glob("*.safetensors"))) >= 2
    model = fastload.from_pretrained(Net, a, progress=False)
    return model, a, b


def _tear(model: nn.Module, b, monkeypatch) -> fastload.ReloadError:
    """A reload whose second file's read fails: the model is marked torn."""
    real, calls = reading.fill, []

    def fill(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise fastload.FastloadIOError("injected: Input/output error")
        return real(*args, **kwargs)

    monkeypatch.setattr(reading, "fill", fill)
    with pytest.raises(fastload.ReloadError) as info:
        fastload.reload(model, b)
    monkeypatch.undo()
    return info.value


def _runs(model: Net) -> list[str]:
    """Every way of running the model's weights that did not refuse."""
    x = torch.zeros(1, 32)
    ways = {
        "model(x)": lambda: model(x),
        "model.forward(x)": lambda: model.forward(x),
        "model.body(x)": lambda: model.body(x),
        "model.body.forward(x)": lambda: model.body.forward(x),
        "model.body[0](x)": lambda: model.body[0](x),
        "model.body[0].forward(x)": lambda: model.body[0].forward(x),
    }
    ran = []
    for way, run in ways.items():
        try:
            run()
        except fastload.ReloadError as e:
            assert "refuses to run until a reload succeeds" in str(e), (way, e)
            continue
        ran.append(way)
    return ran


def test_a_torn_model_refuses_its_forward_and_its_submodules_until_a_reload_succeeds(
    setup, monkeypatch
):
    model, _, b = setup
    assert "forward" not in vars(model) and "forward" not in vars(model.body[0])
    _tear(model, b, monkeypatch)
    assert _runs(model) == []
    fastload.reload(model, b)
    assert len(_runs(model)) == 6
    # nothing is left on the model once it is whole again: the untorn path costs nothing
    assert all("forward" not in vars(m) for m in model.modules())
    assert torch.equal(model.body[0].weight, _net(2).body[0].weight)


def test_a_torn_model_marked_twice_is_lifted_by_one_reload_and_keeps_forwards_of_its_own(
    setup, monkeypatch
):
    model, _, b = setup
    # a forward set on one instance (as accelerate's hooks do) is put back once the mark lifts
    own = model.body[2].forward
    model.body[2].forward = lambda x: own(x) + 1  # type: ignore[method-assign]
    wrapped = model.body[2].forward
    _tear(model, b, monkeypatch)
    _tear(model, b, monkeypatch)
    assert _runs(model) == []
    pickle.dumps(model)  # a torn model still pickles
    fastload.reload(model, b)
    assert model.body[2].forward is wrapped
    assert len(_runs(model)) == 6


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_ctrl_c_during_an_atomic_commit_is_delivered_after_it_and_leaves_the_model_whole(
    setup, monkeypatch
):
    model, _, b = setup
    real = reload_module._commit

    def interrupted(pairs):
        os.kill(os.getpid(), signal.SIGINT)  # held back: the commit goes on
        real(pairs)

    monkeypatch.setattr(reload_module, "_commit", interrupted)
    # Python's own handler, whatever the test runner inherited (SIGINT ignored under nohup)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            fastload.reload(model, b, atomic=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "the commit, which completed" in notes and "refuses to run" not in notes, notes
    # every tensor holds its new bytes and the model runs
    for name, value in _net(2).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert len(_runs(model)) == 6
    # the record describes the new checkpoint: reloading it again skips every tensor
    monkeypatch.undo()
    report = fastload.reload(model, b)
    assert report.tensors_read == 0 and report.tensors_unchanged == len(_net(2).state_dict())
