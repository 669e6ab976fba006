"""Under ``fastload.patch_diffusers()`` the reads of diffusers' adapter and single-file loaders
are fastload's (:mod:`fastload.diffusion.reads`): ``from_single_file``, a LoRA's state dict, and
what the patch rebinds is put back when it ends. The tensors are the ones diffusers reads
without the patch; a file fastload refuses is read by safetensors, so diffusers' own errors stay."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
st = pytest.importorskip("safetensors.torch")

import fastload  # noqa: E402
from fastload.safetensors import files as fastload_files  # noqa: E402

REBOUND = {
    ("diffusers.loaders.lora_base", "safetensors"),
    ("diffusers.loaders.textual_inversion", "safetensors"),
    ("diffusers.loaders.unet", "safetensors"),
    ("diffusers.loaders.ip_adapter", "safe_open"),
    ("diffusers.loaders.single_file_utils", "load_state_dict"),
}


@pytest.fixture
def fastload_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files fastload's ``load_file`` read (the patch looks it up when it is called)."""
    read: list[str] = []
    original = fastload_files.load_file

    def spy(path: Any, *args: Any, **kwargs: Any) -> Any:
        read.append(Path(path).name)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(fastload_files, "load_file", spy)
    return read


def _flux_single_file(tmp: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_config(tmp / "config")
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    st.save_file(state, tmp / "flux1-tiny.safetensors", metadata={"format": "pt"})
    return tmp / "flux1-tiny.safetensors", tmp / "config"


def test_from_single_file_is_read_by_fastload_and_builds_the_same_model(
    tmp_path: Path, fastload_reads: list[str]
) -> None:
    path, config = _flux_single_file(tmp_path)
    kw: dict[str, Any] = {"config": str(config), "local_files_only": True}
    kw["torch_dtype"] = torch.bfloat16
    theirs = diffusers.FluxTransformer2DModel.from_single_file(str(path), **kw).state_dict()
    assert fastload_reads == []
    with fastload.patch_diffusers():
        ours = diffusers.FluxTransformer2DModel.from_single_file(str(path), **kw).state_dict()
    assert fastload_reads == [path.name]
    assert list(ours) == list(theirs)
    for k, t in theirs.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k], t), k


def test_a_lora_state_dict_is_read_by_fastload(tmp_path: Path, fastload_reads: list[str]) -> None:
    gen = torch.Generator().manual_seed(1)
    base = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    lora = {
        f"{base}.lora_A.weight": torch.randn(4, 32, generator=gen),
        f"{base}.lora_B.weight": torch.randn(32, 4, generator=gen),
    }
    st.save_file(lora, tmp_path / "pytorch_lora_weights.safetensors")
    pipe_cls = diffusers.StableDiffusionPipeline
    theirs = pipe_cls.lora_state_dict(str(tmp_path))
    with fastload.patch_diffusers():
        ours = pipe_cls.lora_state_dict(str(tmp_path))
    assert fastload_reads == ["pytorch_lora_weights.safetensors"]
    theirs_sd = theirs[0] if isinstance(theirs, tuple) else theirs
    ours_sd = ours[0] if isinstance(ours, tuple) else ours
    assert sorted(ours_sd) == sorted(theirs_sd)
    for k, t in theirs_sd.items():
        assert torch.equal(ours_sd[k], t), k


def test_a_file_fastload_refuses_is_read_by_safetensors(
    tmp_path: Path, fastload_reads: list[str]
) -> None:
    """A header fastload's strict checks refuse (a tensor's bytes overlapping another's) is
    handed to safetensors, whose own error reaches diffusers' caller as without the patch."""
    path = tmp_path / "pytorch_lora_weights.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"{not a header!!}")
    with pytest.raises(Exception) as unpatched:
        diffusers.StableDiffusionPipeline.lora_state_dict(str(tmp_path))
    with fastload.patch_diffusers(), pytest.raises(Exception) as patched:
        diffusers.StableDiffusionPipeline.lora_state_dict(str(tmp_path))
    assert type(patched.value) is type(unpatched.value)
    assert fastload_reads == [path.name]  # tried by fastload first


def test_the_patch_rebinds_the_loaders_reads_and_puts_them_back() -> None:
    import importlib

    before = {(m, a): getattr(importlib.import_module(m), a) for m, a in REBOUND}
    with fastload.patch_diffusers():
        for (m, a), original in before.items():
            assert getattr(sys.modules[m], a) is not original, (m, a)
        assert sys.modules["diffusers.loaders.ip_adapter"].safe_open is fastload.safe_open
        proxy = sys.modules["diffusers.loaders.lora_base"].safetensors
        assert (
            proxy.SafetensorError
            is before[("diffusers.loaders.lora_base", "safetensors")].SafetensorError
        )
    for (m, a), original in before.items():
        assert getattr(sys.modules[m], a) is original, (m, a)
