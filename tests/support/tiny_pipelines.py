"""Tiny diffusers pipelines for the tests: a Stable Diffusion pipeline of random weights (a UNet,
a VAE, a CLIP text encoder with a tokenizer built from a vocabulary written here, a DDIM
scheduler), one denoising step, and the comparison of two loads of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers

__all__ = ["make_pipeline", "same_pipeline", "step"]

#: the sizes of the tiny pipeline and of the larger one (files of a few MiB, for reads to see)
_TINY = {
    "unet_channels": (4, 8),
    "unet_groups": 4,
    "hidden": 8,
    "head": 2,
    "vae_channels": [2, 4],
    "vae_groups": 2,
    "layers": 1,
    "heads": 2,
}
_LARGER = {
    "unet_channels": (32, 64),
    "unet_groups": 8,
    "hidden": 32,
    "head": 8,
    "vae_channels": [8, 16],
    "vae_groups": 4,
    "layers": 2,
    "heads": 4,
}


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


def make_pipeline(tmp: Path, *, larger: bool = False) -> Any:
    """A Stable Diffusion pipeline of random weights: a few KiB, or a few MiB with ``larger``."""
    s = _LARGER if larger else _TINY
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=s["unet_channels"],
        norm_num_groups=s["unet_groups"],
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=s["hidden"],
        attention_head_dim=s["head"],
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        sample_size=8,
    )
    vae = diffusers.AutoencoderKL(
        block_out_channels=s["vae_channels"],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4,
        norm_num_groups=s["vae_groups"],
    )
    text = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=514,
            hidden_size=s["hidden"],
            intermediate_size=2 * s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
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


def step(pipe: Any) -> torch.Tensor:
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


def same_pipeline(ours: Any, theirs: Any) -> None:
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
