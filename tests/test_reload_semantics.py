"""fastload.reload's contract where the first round left gaps (issue 57): a meta tensor in a state
dict is a CheckpointError naming it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastload


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _stack(seed: int) -> Stack:
    torch.manual_seed(seed)
    return Stack()


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _same(model: nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    got = model.state_dict()
    return set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in got)


def _pointers(model: nn.Module) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}


# -- meta tensors in a state dict ----------------------------------------------------------------


def _with_a_meta_tensor() -> dict[str, torch.Tensor]:
    return {"weight": torch.empty(4, 4, device="meta"), "bias": torch.zeros(4)}


@pytest.mark.parametrize("atomic", [False, True], ids=["in-place", "atomic"])
def test_a_reload_from_a_state_dict_holding_a_meta_tensor_names_it(tmp_path, atomic):
    path = tmp_path / "a.safetensors"
    fastload.save_file({"weight": torch.ones(4, 4), "bias": torch.ones(4)}, path)
    model = fastload.from_pretrained(nn.Linear(4, 4), path, progress=False)
    with pytest.raises(fastload.CheckpointError, match="'weight' is on the meta device"):
        fastload.reload(model, _with_a_meta_tensor(), atomic=atomic)
    assert torch.equal(model.weight, torch.ones(4, 4))
    model(torch.zeros(1, 4))


def test_from_pretrained_of_a_state_dict_holding_a_meta_tensor_names_it():
    with pytest.raises(fastload.CheckpointError, match="'weight' is on the meta device"):
        fastload.from_pretrained(lambda: nn.Linear(4, 4), _with_a_meta_tensor(), progress=False)
