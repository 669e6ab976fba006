"""diffusers models through fastload: the same model as diffusers' own ``from_pretrained``.

Tiny models (the configs of diffusers' own tests) with random weights are saved by diffusers'
``save_pretrained`` (one file, sharded, a variant, bf16, in a subfolder), then loaded by diffusers
and by ``fastload.from_pretrained``: the class, every tensor bitwise, its dtype and device, and one
forward on fixed inputs are the same; so is a ``save_pretrained`` round trip of fastload's model.
Bad folders raise fastload's errors naming the file or the tensor.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import fastload  # noqa: E402
from fastload.core.basics.errors import CheckpointError, ModelMismatchError  # noqa: E402

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def _unet() -> tuple[type, dict[str, Any], Callable[[], dict[str, torch.Tensor]]]:
    config = {
        "block_out_channels": (4, 8),
        "norm_num_groups": 4,
        "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
        "cross_attention_dim": 8,
        "attention_head_dim": 2,
        "out_channels": 4,
        "in_channels": 4,
        "layers_per_block": 1,
        "sample_size": 16,
    }

    def inputs() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return {
            "sample": torch.randn(2, 4, 16, 16, generator=g),
            "timestep": torch.tensor([10]),
            "encoder_hidden_states": torch.randn(2, 4, 8, generator=g),
        }

    return diffusers.UNet2DConditionModel, config, inputs


def _vae() -> tuple[type, dict[str, Any], Callable[[], dict[str, torch.Tensor]]]:
    config = {
        "block_out_channels": [2, 4],
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * 2,
        "up_block_types": ["UpDecoderBlock2D"] * 2,
        "latent_channels": 4,
        "norm_num_groups": 2,
    }

    def inputs() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return {"sample": torch.randn(2, 3, 16, 16, generator=g), "sample_posterior": False}

    return diffusers.AutoencoderKL, config, inputs


def _flux() -> tuple[type, dict[str, Any], Callable[[], dict[str, torch.Tensor]]]:
    config = {
        "patch_size": 1,
        "in_channels": 4,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "axes_dims_rope": [4, 4, 8],
    }

    def inputs() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return {
            "hidden_states": torch.randn(1, 16, 4, generator=g),
            "encoder_hidden_states": torch.randn(1, 48, 32, generator=g),
            "pooled_projections": torch.randn(1, 32, generator=g),
            "img_ids": torch.randn(16, 3, generator=g),
            "txt_ids": torch.randn(48, 3, generator=g),
            "timestep": torch.tensor([1.0]),
        }

    return diffusers.FluxTransformer2DModel, config, inputs


def _wan() -> tuple[type, dict[str, Any], Callable[[], dict[str, torch.Tensor]]]:
    """A model class with ``_keep_in_fp32_modules``."""
    config = {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 2,
        "attention_head_dim": 12,
        "in_channels": 4,
        "out_channels": 4,
        "text_dim": 16,
        "freq_dim": 256,
        "ffn_dim": 32,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 32,
    }

    def inputs() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return {
            "hidden_states": torch.randn(1, 4, 2, 16, 16, generator=g),
            "encoder_hidden_states": torch.randn(1, 12, 16, generator=g),
            "timestep": torch.tensor([10]),
        }

    return diffusers.WanTransformer3DModel, config, inputs


MODELS = {"unet": _unet, "vae": _vae, "flux": _flux}


def _build(kind: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    cls, config, _ = (MODELS | {"wan": _wan})[kind]()
    torch.manual_seed(0)
    model = cls(**config)
    with torch.no_grad():  # random weights everywhere (some are zeros after __init__)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.to(dtype)


def _save(kind: str, where: Path, dtype: torch.dtype = torch.float32, **save: Any) -> Path:
    _build(kind, dtype).save_pretrained(where, **save)
    return where


def _same(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """The same model: class, config, every tensor bitwise with its dtype and device."""
    assert type(ours) is type(theirs)
    assert dict(ours.config) == {**theirs.config, "_name_or_path": ours.config._name_or_path}
    mine, other = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(other)
    for name, tensor in other.items():
        got = mine[name]
        assert (got.dtype, got.device, got.shape) == (tensor.dtype, tensor.device, tensor.shape), (
            name
        )
        assert torch.equal(got, tensor), name
    assert ours.training is theirs.training is False
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])


def _forward(kind: str, model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> Any:
    _, _, inputs = (MODELS | {"wan": _wan})[kind]()
    args = {
        k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in inputs().items()
    }
    with torch.no_grad():
        return model(**args, return_dict=False)[0]


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_saved_model_loads_as_diffusers_loads_it(kind: str, tmp_path: Path) -> None:
    folder = _save(kind, tmp_path / kind)
    cls = MODELS[kind]()[0]
    theirs = cls.from_pretrained(folder)
    ours, report = fastload.from_pretrained(cls, folder, output_loading_info=True)
    _same(ours, theirs)
    assert report.missing == [] and report.unexpected == [] and report.mismatched == []
    assert torch.equal(_forward(kind, ours), _forward(kind, theirs))
    assert ours.config._name_or_path == folder  # as given, as diffusers registers it


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_sharded_checkpoint_loads_as_diffusers_loads_it(kind: str, tmp_path: Path) -> None:
    folder = _save(kind, tmp_path / kind, max_shard_size="4KB")
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list(folder.glob("diffusion_pytorch_model-*.safetensors"))) > 1
    cls = MODELS[kind]()[0]
    ours, report = fastload.from_pretrained(cls, folder, output_loading_info=True)
    _same(ours, cls.from_pretrained(folder))
    assert len(report.files) > 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_variant_in_a_subfolder_loads_in_the_dtype_asked_for(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    _save("unet", tmp_path / "pipe" / "unet", dtype=torch.float16, variant="fp16")
    _save("unet", tmp_path / "pipe" / "unet")  # the float32 weights beside it
    cls = diffusers.UNet2DConditionModel
    kw: dict[str, Any] = {"subfolder": "unet", "variant": "fp16"}
    theirs = cls.from_pretrained(tmp_path / "pipe", torch_dtype=dtype, **kw)
    ours = fastload.from_pretrained(cls, tmp_path / "pipe", dtype=dtype, **kw)
    _same(ours, theirs)
    assert next(ours.parameters()).dtype == dtype
    assert torch.equal(_forward("unet", ours, dtype), _forward("unet", theirs, dtype))
    # diffusers' spelling of the dtype, and its default: float32, whatever is stored
    _same(fastload.from_pretrained(cls, tmp_path / "pipe", torch_dtype=dtype, **kw), theirs)
    plain = fastload.from_pretrained(cls, tmp_path / "pipe", **kw)
    _same(plain, cls.from_pretrained(tmp_path / "pipe", **kw))
    assert next(plain.parameters()).dtype == torch.float32


def test_a_bf16_checkpoint_loads_as_stored_or_as_diffusers_defaults(tmp_path: Path) -> None:
    folder = _save("flux", tmp_path / "flux", dtype=torch.bfloat16, max_shard_size="8KB")
    cls = diffusers.FluxTransformer2DModel
    _same(fastload.from_pretrained(cls, folder), cls.from_pretrained(folder))
    bf16 = cls.from_pretrained(folder, torch_dtype=torch.bfloat16)
    _same(fastload.from_pretrained(cls, folder, dtype=torch.bfloat16), bf16)
    stored = fastload.from_pretrained(cls, folder, dtype="stored")
    _same(stored, bf16)


def test_keep_in_fp32_modules_stay_float32_under_a_half_dtype(tmp_path: Path) -> None:
    folder = _save("wan", tmp_path / "wan")
    cls = diffusers.WanTransformer3DModel
    assert cls._keep_in_fp32_modules
    theirs = cls.from_pretrained(folder, torch_dtype=torch.float16)
    ours = fastload.from_pretrained(cls, folder, dtype=torch.float16)
    _same(ours, theirs)
    dtypes = {t.dtype for t in ours.state_dict().values()}
    assert dtypes == {torch.float16, torch.float32}
    kept = [n for n, t in ours.state_dict().items() if t.dtype == torch.float32]
    assert all(any(m in n.split(".") for m in cls._keep_in_fp32_modules) for n in kept)
    assert torch.equal(_forward("wan", ours, torch.float16), _forward("wan", theirs, torch.float16))


def test_a_round_trip_through_save_pretrained_is_the_same_model(tmp_path: Path) -> None:
    folder = _save("unet", tmp_path / "a", max_shard_size="4KB")
    cls = diffusers.UNet2DConditionModel
    ours = fastload.from_pretrained(cls, folder)
    ours.save_pretrained(tmp_path / "b")
    again = cls.from_pretrained(tmp_path / "b")
    _same(again, cls.from_pretrained(folder))


def test_device_map_and_device_place_every_tensor(tmp_path: Path) -> None:
    folder = _save("vae", tmp_path / "vae")
    cls = diffusers.AutoencoderKL
    theirs = cls.from_pretrained(folder, device_map="cpu")
    _same(fastload.from_pretrained(cls, folder, device_map="cpu"), theirs)
    _same(fastload.from_pretrained(cls, folder, device="cpu"), theirs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_model_read_onto_the_gpu_is_the_one_diffusers_places_there(tmp_path: Path) -> None:
    folder = _save("flux", tmp_path / "flux", dtype=torch.bfloat16, max_shard_size="8KB")
    cls = diffusers.FluxTransformer2DModel
    kw: dict[str, Any] = {"torch_dtype": torch.float16, "device_map": "cuda"}
    theirs = cls.from_pretrained(folder, **kw)
    _same(fastload.from_pretrained(cls, folder, dtype=torch.float16, device="cuda"), theirs)
    _same(fastload.from_pretrained(cls, folder, **kw), theirs)


def test_legacy_attention_names_of_a_single_file_are_renamed(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _save("vae", tmp_path / "vae")
    weights = folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    renamed = {}
    for name, t in tensors.items():
        for new, legacy in old.items():
            if ".attentions.0." in name and f".{new}." in name:
                name = name.replace(f".{new}.", f".{legacy}.")
        renamed[name] = t
    assert renamed.keys() != tensors.keys()
    save_file(renamed, weights, metadata={"format": "pt"})
    cls = diffusers.AutoencoderKL
    ours, report = fastload.from_pretrained(cls, folder, output_loading_info=True)
    _same(ours, cls.from_pretrained(folder))
    assert report.missing == [] and report.unexpected == []
    assert any(k.endswith("mid_block.attentions.0.query.weight") for k in report.renamed)


def test_the_legacy_sharded_variant_layout_loads_with_diffusers_warning(tmp_path: Path) -> None:
    folder = _save(
        "unet", tmp_path / "unet", dtype=torch.float16, variant="fp16", max_shard_size="4KB"
    )
    index = folder / "diffusion_pytorch_model.safetensors.index.fp16.json"
    assert index.is_file()
    index.rename(folder / "diffusion_pytorch_model.safetensors.fp16.index.json")
    cls = diffusers.UNet2DConditionModel
    with pytest.warns(FutureWarning, match="This serialization format is now deprecated"):
        ours = fastload.from_pretrained(cls, folder, variant="fp16")
    with pytest.warns(FutureWarning):
        theirs = cls.from_pretrained(folder, variant="fp16")
    _same(ours, theirs)


def test_a_model_id_resolves_in_the_hugging_face_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_cache import add_snapshot, directory_files

    folder = _save("vae", tmp_path / "saved" / "vae")
    cache = tmp_path / "hub"
    add_snapshot(cache, "tiny/pipe", directory_files(folder.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    cls = diffusers.AutoencoderKL
    ours = fastload.from_pretrained(cls, "tiny/pipe", subfolder="vae")
    _same(ours, cls.from_pretrained(folder))
    assert ours.config._name_or_path == "tiny/pipe"


def test_missing_and_unused_tensors_are_reported_and_warned_as_diffusers_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from safetensors.torch import load_file, save_file

    folder = _save("vae", tmp_path / "vae")
    weights = folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    tensors.pop("decoder.conv_out.bias")
    tensors["decoder.extra.weight"] = torch.ones(2)
    save_file(tensors, weights, metadata={"format": "pt"})
    cls = diffusers.AutoencoderKL
    with caplog.at_level(logging.WARNING, logger="diffusers"):
        ours, report = fastload.from_pretrained(cls, folder, output_loading_info=True)
    assert report.missing == ["decoder.conv_out.bias"]
    assert report.unexpected == ["decoder.extra.weight"]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("diffusers")]
    assert any("were not used when initializing AutoencoderKL" in m and "extra" in m for m in said)
    assert any("newly initialized" in m and "decoder.conv_out.bias" in m for m in said)
    assert not ours.decoder.conv_out.bias.is_meta
    # fastload's own policies, when asked for, replace diffusers' words
    with pytest.raises(CheckpointError, match="decoder.conv_out.bias"):
        fastload.from_pretrained(cls, folder, missing="error")


def test_a_shard_named_in_the_index_but_missing_is_named(tmp_path: Path) -> None:
    folder = _save("unet", tmp_path / "unet", max_shard_size="4KB")
    shard = sorted(folder.glob("diffusion_pytorch_model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        fastload.from_pretrained(diffusers.UNet2DConditionModel, folder)


def test_a_variant_that_does_not_exist_is_named(tmp_path: Path) -> None:
    folder = _save("unet", tmp_path / "unet")
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.fp8\.safetensors"):
        fastload.from_pretrained(diffusers.UNet2DConditionModel, folder, variant="fp8")


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    folder = _save("vae", tmp_path / "vae")
    weights = folder / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="diffusion_pytorch_model.safetensors"):
        fastload.from_pretrained(diffusers.AutoencoderKL, folder)


def test_a_config_that_does_not_fit_the_tensors_names_the_tensor(tmp_path: Path) -> None:
    folder = _save("vae", tmp_path / "vae")
    config = json.loads((folder / "config.json").read_text())
    config["latent_channels"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelMismatchError, match=r"encoder\.conv_out\.weight"):
        fastload.from_pretrained(diffusers.AutoencoderKL, folder)
    with pytest.raises(ValueError):  # what diffusers raises too
        diffusers.AutoencoderKL.from_pretrained(folder)


def test_an_option_fastload_does_not_serve_is_refused_by_name(tmp_path: Path) -> None:
    folder = _save("vae", tmp_path / "vae")
    with pytest.raises(fastload.UnsupportedError, match="quantization_config"):
        fastload.from_pretrained(diffusers.AutoencoderKL, folder, quantization_config={"a": 1})


def test_a_users_script_loads_a_unet_with_only_fastload_and_diffusers(tmp_path: Path) -> None:
    from fresh import run_script

    folder = _save("unet", tmp_path / "pipe" / "unet", max_shard_size="4KB")
    out = run_script(
        """
        import sys
        import torch
        import diffusers
        import fastload

        path = sys.argv[1]
        cls = diffusers.UNet2DConditionModel
        ours, report = fastload.from_pretrained(
            cls, path, subfolder="unet", dtype=torch.float16, output_loading_info=True
        )
        theirs = cls.from_pretrained(path, subfolder="unet", torch_dtype=torch.float16)
        a, b = ours.state_dict(), theirs.state_dict()
        assert list(a) == list(b)
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
        assert not report.missing and not report.unexpected
        print("loaded", type(ours).__name__, len(a), "transformers" in sys.modules)
        """,
        folder.parent,
    )
    assert out.startswith("loaded UNet2DConditionModel")


def test_importing_fastload_imports_no_diffusers() -> None:
    from fresh import run_script

    out = run_script(
        """
        import sys
        import fastload
        print("diffusers" in sys.modules, "fastload.diffusion" in sys.modules)
        """
    )
    assert out.split() == ["False", "False"]
