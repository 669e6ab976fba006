"""ComfyUI-style single files: a loader that reads one big file with
``with safe_open(path, "pt") as f: sd = {k: f.get_tensor(k) for k in f.keys()}`` gets fastload's
reads by changing its import to ``from fastload import safe_open``, and the same dict.

The file is a Flux transformer's state dict in diffusers' names (a tiny
``FluxTransformer2DModel``, saved whole with ``st.save_file``, as a single-file
checkpoint stores it); diffusers' ``from_single_file`` reads the same file, offline, with the
model's config from a local folder. (A single file in Black Forest Labs' own names goes through
diffusers' converter, which is diffusers' code run on the tensors; not exercised here.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
st = pytest.importorskip("safetensors.torch")
safetensors = pytest.importorskip("safetensors")

import fastload  # noqa: E402


def _flux(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.to(dtype)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def single_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("flux")
    model = _flux(request.param)
    model.save_config(tmp / "config")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    st.save_file(state, tmp / "flux1-tiny.safetensors", metadata={"format": "pt"})
    return tmp / "flux1-tiny.safetensors", tmp / "config", state


def _comfy_style(safe_open: Any, path: Path) -> dict[str, torch.Tensor]:
    """The loop a ComfyUI-style loader runs, with whichever ``safe_open`` it imported."""
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert list(ours) == list(theirs)
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype, k
        assert ours[k].shape == t.shape, k
        assert torch.equal(ours[k], t), k


def test_the_get_tensor_loop_gives_the_dict_safetensors_gives(single_file: Any) -> None:
    path, _, state = single_file
    theirs = _comfy_style(safetensors.safe_open, path)
    ours = _comfy_style(fastload.safe_open, path)
    _same(ours, theirs)
    assert sorted(ours) == sorted(state)
    assert all(t.device.type == "cpu" for t in ours.values())
    with fastload.safe_open(path, "pt") as f, safetensors.safe_open(path, "pt") as g:
        assert f.keys() == g.keys()
        assert f.metadata() == g.metadata() == {"format": "pt"}
        assert f.offset_keys() == g.offset_keys()


def test_the_tensors_outlive_the_file_and_are_the_callers(single_file: Any) -> None:
    path, _, _ = single_file
    ours = _comfy_style(fastload.safe_open, path)
    name = next(iter(ours))
    before = ours[name].clone()
    ours[name].add_(1)  # writable, and not a view of the file
    assert torch.equal(_comfy_style(fastload.safe_open, path)[name], before)


def test_load_file_gives_the_same_dict(single_file: Any) -> None:
    path, _, _ = single_file
    _same(fastload.load_file(path), st.load_file(path))


def test_diffusers_from_single_file_builds_the_model_of_those_tensors(single_file: Any) -> None:
    path, config, state = single_file
    ours = _comfy_style(fastload.safe_open, path)
    model = diffusers.FluxTransformer2DModel.from_single_file(
        str(path),
        config=str(config),
        local_files_only=True,
        torch_dtype=state[next(iter(state))].dtype,
    )
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(ours)
    for k, t in ours.items():
        assert loaded[k].dtype == t.dtype, k
        assert torch.equal(loaded[k], t), k
