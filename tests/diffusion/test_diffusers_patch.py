"""``fastload.patch_diffusers()``: diffusers' own ``ModelMixin.from_pretrained`` served by fastload.

Under the patch, diffusers' call gives the model diffusers gives (every tensor bitwise, its dtype,
the loading info in diffusers' form), and what fastload does not serve identically goes whole to
diffusers' own loader with one warning saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import fastload  # noqa: E402
from fastload.diffusion import patch as patchmod  # noqa: E402


def _vae() -> torch.nn.Module:
    torch.manual_seed(0)
    model = diffusers.AutoencoderKL(
        block_out_channels=[2, 4],
        norm_num_groups=2,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    _vae().save_pretrained(tmp_path / "vae", max_shard_size="4KB")
    return tmp_path / "vae"


@pytest.fixture
def patched() -> Iterator[None]:
    with fastload.patch_diffusers():
        yield
    assert not fastload.diffusers_patched()


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    x, y = a.state_dict(), b.state_dict()
    return list(x) == list(y) and all(
        torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x
    )


def test_diffusers_from_pretrained_is_served_by_fastload_under_the_patch(
    folder: Path, patched: None
) -> None:
    cls = diffusers.AutoencoderKL
    assert fastload.diffusers_patched()
    model, info = cls.from_pretrained(folder, torch_dtype=torch.float16, output_loading_info=True)
    assert patchmod.last_report is not None and patchmod.last_fallback is None
    assert info == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    with fastload.patch_diffusers() as again:  # idempotent: the inner handle undoes nothing
        assert not again.installed
    assert fastload.diffusers_patched()
    fastload.unpatch_diffusers()
    reference = cls.from_pretrained(folder, torch_dtype=torch.float16)
    fastload.patch_diffusers()
    assert _equal(model, reference)
    assert next(model.parameters()).dtype == torch.float16


def test_the_patch_also_serves_transformers_and_undoes_it(patched: None) -> None:
    transformers = pytest.importorskip("transformers")
    from fastload.hf.patch import is_patched

    assert is_patched()
    fastload.unpatch_diffusers()
    assert not is_patched() and not fastload.diffusers_patched()
    assert transformers.PreTrainedModel.from_pretrained.__func__.__module__.startswith(
        "transformers"
    )
    fastload.patch_diffusers()


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"low_cpu_mem_usage": False}, "low_cpu_mem_usage=False"),
        ({"device_map": "balanced"}, "device_map='balanced'"),
        ({"ignore_mismatched_sizes": True}, "ignore_mismatched_sizes=True"),
        ({"variant": "fp16"}, "variant='fp16'"),
    ],
)
def test_what_fastload_does_not_serve_is_left_whole_to_diffusers_with_one_warning(
    folder: Path,
    patched: None,
    options: dict[str, object],
    why: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cls = diffusers.AutoencoderKL
    with caplog.at_level(logging.WARNING, logger="fastload"):
        try:
            model = cls.from_pretrained(folder, **options)
        except (OSError, ValueError) as e:  # diffusers' own error (no fp16 variant here)
            model = e
    said = [r.getMessage() for r in caplog.records if r.name == "fastload"]
    assert len(said) == 1 and "is left to diffusers" in said[0] and why in said[0], said
    assert patchmod.last_report is None and why in (patchmod.last_fallback or "")
    if isinstance(model, torch.nn.Module):
        fastload.unpatch_diffusers()
        assert _equal(model, cls.from_pretrained(folder, **options))
        fastload.patch_diffusers()


def test_a_bad_shape_raises_diffusers_kind_of_error_under_the_patch(
    folder: Path, patched: None
) -> None:
    import json

    config = json.loads((folder / "config.json").read_text())
    config["latent_channels"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"encoder\.conv_out\.weight"):
        diffusers.AutoencoderKL.from_pretrained(folder)
