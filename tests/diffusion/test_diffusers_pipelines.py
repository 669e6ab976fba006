"""Whole pipelines under ``fastload.patch_diffusers()``: ``DiffusionPipeline.from_pretrained``.

A tiny Stable Diffusion pipeline (a UNet, a VAE, a CLIP text encoder with a tokenizer built from a
vocabulary written here, a DDIM scheduler), saved with ``save_pretrained``, loads under the patch
as diffusers loads it: every component of the same class, every tensor bitwise and in the dtype
asked for, one denoising step with a fixed seed equal. The model components are served by
fastload (its INFO line on the ``fastload`` logger, one per component) and the text encoder by
the transformers patch the diffusers patch installs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tiny_pipelines import make_pipeline, same_pipeline, step  # noqa: E402

import fastload  # noqa: E402
from fastload.diffusion import patch as patchmod  # noqa: E402
from fastload.hf import patch as hfpatch  # noqa: E402

MODELS = ("unet", "vae", "text_encoder")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pipeline")
    pipe = make_pipeline(tmp)
    pipe.save_pretrained(tmp / "sd")
    pipe.to(torch.float16).save_pretrained(tmp / "sd", variant="fp16")
    return tmp / "sd"


def _load(folder: Path, *, patched: bool, caplog: pytest.LogCaptureFixture, **kw: Any) -> Any:
    """The pipeline diffusers' ``from_pretrained`` gives, with fastload's patch or without, and
    the components fastload served (its INFO lines)."""
    caplog.clear()
    if not patched:
        assert not fastload.diffusers_patched()
        return diffusers.DiffusionPipeline.from_pretrained(folder, **kw), []
    with caplog.at_level(logging.INFO, logger="fastload"), fastload.patch_diffusers():
        pipe = diffusers.DiffusionPipeline.from_pretrained(folder, **kw)
    served = [r.getMessage() for r in caplog.records if "fastload served" in r.getMessage()]
    return pipe, served


def _dtypes(pipe: Any) -> dict[str, set[torch.dtype]]:
    return {n: {p.dtype for p in getattr(pipe, n).parameters()} for n in MODELS}


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"torch_dtype": torch.float16},
        {"variant": "fp16", "torch_dtype": torch.float16},
        {"variant": "fp16"},
        {"torch_dtype": {"unet": torch.float16, "default": torch.float32}},
        {"dtype": torch.float16},  # diffusers 0.40's new name for torch_dtype
    ],
    ids=["default", "fp16", "fp16-variant", "fp16-variant-as-stored", "per-component", "dtype"],
)
def test_a_pipeline_loads_under_the_patch_as_diffusers_loads_it(
    saved: Path, kw: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    theirs, _ = _load(saved, patched=False, caplog=caplog, **kw)
    ours, served = _load(saved, patched=True, caplog=caplog, **kw)
    assert not fastload.diffusers_patched()
    same_pipeline(ours, theirs)
    assert _dtypes(ours) == _dtypes(theirs)
    asked = kw.get("dtype", kw.get("torch_dtype"))
    if isinstance(asked, torch.dtype):
        assert all(d == {asked} for d in _dtypes(ours).values())
    if isinstance(asked, dict):
        assert _dtypes(ours)["unet"] == {torch.float16}
        assert _dtypes(ours)["vae"] == {torch.float32}
    # every model component was read by fastload: the two diffusers models by the diffusers
    # patch, the CLIP text encoder by the transformers patch it installs
    assert any("UNet2DConditionModel" in line for line in served), served
    assert any("AutoencoderKL" in line for line in served), served
    assert any("CLIPTextModel" in line for line in served), served
    assert len(served) == len(MODELS), served
    if len(set().union(*_dtypes(ours).values())) == 1:  # a mixed pipeline does not run
        assert torch.equal(step(ours), step(theirs))


def test_the_latest_component_is_reported_and_nothing_was_left_to_diffusers(
    saved: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []
    from fastload.diffusion import front

    original = front.load_diffusers

    def counting(cls: type, *args: Any, **kwargs: Any) -> Any:
        calls.append(cls.__name__)
        return original(cls, *args, **kwargs)

    with caplog.at_level(logging.WARNING), fastload.patch_diffusers():
        front.load_diffusers = counting  # type: ignore[assignment]
        try:
            diffusers.DiffusionPipeline.from_pretrained(saved)
        finally:
            front.load_diffusers = original  # type: ignore[assignment]
    assert sorted(calls) == ["AutoencoderKL", "UNet2DConditionModel"]
    assert patchmod.last_fallback is None and patchmod.last_report is not None
    assert hfpatch.last_fallback is None
    assert not [r for r in caplog.records if "left to" in r.getMessage()]
