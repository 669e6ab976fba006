"""Whole pipelines under ``fastload.patch_diffusers()``: ``DiffusionPipeline.from_pretrained``.

A tiny Stable Diffusion pipeline (a UNet, a VAE, a CLIP text encoder with a tokenizer built from a
vocabulary written here, a DDIM scheduler), saved with ``save_pretrained``, loads under the patch
as diffusers loads it: every component of the same class, every tensor bitwise and in the dtype
asked for, one denoising step with a fixed seed equal. The model components are served by
fastload (its INFO line on the ``fastload`` logger, one per component) and the text encoder by
the transformers patch the diffusers patch installs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

import fastload  # noqa: E402
from fastload.diffusion import patch as patchmod  # noqa: E402
from fastload.hf import patch as hfpatch  # noqa: E402

MODELS = ("unet", "vae", "text_encoder")


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (CLIP's byte-level BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _tokenizer(where: Path) -> Any:
    """A CLIP tokenizer without merges: every byte a token (no hub)."""
    where.mkdir(parents=True)
    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": 256 + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": 512, "<|endoftext|>": 513})
    (where / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (where / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return transformers.CLIPTokenizer(
        str(where / "vocab.json"), str(where / "merges.txt"), model_max_length=8
    )


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def _pipeline(tmp: Path) -> Any:
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(4, 8),
        norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        attention_head_dim=2,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        sample_size=8,
    )
    vae = diffusers.AutoencoderKL(
        block_out_channels=[2, 4],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4,
        norm_num_groups=2,
    )
    text = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=514,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=8,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        )
    )
    for model in (unet, vae, text):
        _randomize(model)
    return diffusers.StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=_tokenizer(tmp / "tokenizer-source"),
        unet=unet,
        scheduler=diffusers.DDIMScheduler(steps_offset=1, clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pipeline")
    pipe = _pipeline(tmp)
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


def _step(pipe: Any) -> torch.Tensor:
    out = pipe(
        "a cat",
        num_inference_steps=1,
        height=16,
        width=16,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    )
    return out.images


def _same(ours: Any, theirs: Any) -> None:
    assert set(ours.components) == set(theirs.components)
    for name, component in theirs.components.items():
        mine = ours.components[name]
        assert type(mine) is type(component), name
        if isinstance(component, torch.nn.Module):
            x, y = mine.state_dict(), component.state_dict()
            assert list(x) == list(y), name
            for key in y:
                assert x[key].dtype == y[key].dtype, (name, key)
                assert torch.equal(x[key], y[key]), (name, key)


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
    _same(ours, theirs)
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
        assert torch.equal(_step(ours), _step(theirs))


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
