"""A diffusers pipeline from object storage loaded by the ranks of a group, under
``fastload.patch_diffusers()``: ``DiffusionPipeline.from_pretrained(url, process_group=pg)``.

Two gloo ranks, each reading the project's S3 test server through a counting proxy of its own
(tests/support/s3_server.py's ``FaultProxy``): each fetches about half the bytes of the weights of
every component (the UNet and the VAE by the diffusers patch, the CLIP text encoder by the
transformers patch; the text encoder is made large here, so a rank that fetched all of it would be
seen), and each gets the pipeline diffusers loads from a local copy, every tensor bitwise.

And what a URL pipeline's component that fastload does not serve does: a clear error naming the
component, its URL and why, not transformers' confusion at a temporary folder without weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

import fastload  # noqa: E402
from fastload.core.basics.errors import UnsupportedError  # noqa: E402

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from s3_server import S3Server, counting_proxies  # noqa: E402
from s3_server import patient_options as _options  # noqa: E402
from spawn_ranks import (  # noqa: E402
    free_port,
    init_store_rank,
    leave_group,
    rank_results,
    run_ranks,
)

#: the components whose weights the ranks share
MODELS = ("text_encoder", "unet", "vae")


def _digests(pipe: Any) -> dict[str, Any]:
    """Each component's class, and each tensor's dtype and bytes' digest."""
    out: dict[str, Any] = {}
    for name, component in sorted(pipe.components.items()):
        out[name] = type(component).__name__
        if isinstance(component, torch.nn.Module):
            for key, t in component.state_dict().items():
                raw = t.detach().contiguous().view(torch.uint8).numpy().tobytes()
                out[f"{name}.{key}"] = f"{t.dtype} {hashlib.sha256(raw).hexdigest()}"
    return out


class _Components:
    """What :func:`_digests` reads of a pipeline, for one model."""

    def __init__(self, **components: Any) -> None:
        self.components = components


def _weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for m in MODELS for f in (folder / m).glob("*.safetensors"))


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory):
    """The S3 server holding ``big``: a Stable Diffusion pipeline of a few MiB whose CLIP text
    encoder holds about half the weights; ``quantized``: ``big`` with a text encoder config that
    asks for a quantization method fastload does not read."""
    from tiny_pipelines import make_pipeline

    root = tmp_path_factory.mktemp("d-ranks")
    pipe = make_pipeline(root, larger=True)
    torch.manual_seed(2)
    pipe.text_encoder = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=514,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=8,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        )
    )
    local = root / "local"
    pipe.save_pretrained(local / "big")
    shutil.copytree(local / "big", local / "quantized")
    config = local / "quantized" / "text_encoder" / "config.json"
    data = json.loads(config.read_text())
    data["quantization_config"] = {"quant_method": "not-a-method", "bits": 4}
    config.write_text(json.dumps(data))
    (root / "s3").mkdir()
    s3 = S3Server(root / "s3")
    s3.bucket("models")
    for name in ("big", "quantized"):
        s3.place(local / name, "models", name)
    yield s3, local
    s3.stop()


def _rank(rank: int, world: int, port: int, root: str, endpoints: list[str]) -> None:
    import torch.distributed as dist

    init_store_rank(rank, world, port, 120)
    out: dict[str, Any] = {}
    try:
        with fastload.patch_diffusers():
            pipe = diffusers.DiffusionPipeline.from_pretrained(
                "s3://models/big/",
                storage_options=_options(endpoints[rank]),
                process_group=dist.group.WORLD,
            )
        out["digests"] = _digests(pipe)
        out["name"] = pipe.name_or_path
        # one model under the patch takes process_group= with a URL too (read past the proxies)
        with fastload.patch_diffusers():
            unet = diffusers.UNet2DConditionModel.from_pretrained(
                "s3://models/big/",
                subfolder="unet",
                storage_options=_options(endpoints[-1]),
                process_group=dist.group.WORLD,
            )
        out["unet"] = _digests(_Components(unet=unet))
    except Exception as e:  # what the user sees, for the test to show
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
    leave_group()


def test_two_ranks_each_fetch_about_half_of_a_pipeline_and_get_the_single_load(
    bucket, tmp_path: Path
) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    s3, local = bucket
    single = _digests(diffusers.DiffusionPipeline.from_pretrained(local / "big"))
    with counting_proxies(s3.port, 2) as proxies:
        run_ranks(
            _rank,
            (2, free_port(), str(tmp_path), [p.endpoint for p in proxies] + [s3.endpoint]),
            world=2,
            timeout_s=300,
            what="diffusers pipeline",
        )
    for r, got in enumerate(rank_results(tmp_path, 2)):
        assert got.get("digests") == single, (r, got.get("error"))
        assert got["name"] == "s3://models/big/"
        assert got["unet"] == {k: v for k, v in single.items() if k.startswith("unet")}
    total = _weight_bytes(local / "big")
    text_encoder = (local / "big" / "text_encoder" / "model.safetensors").stat().st_size
    fetched = [p.sent for p in proxies]
    # each rank its half, give or take one chunk (1 MiB here) per component, plus the headers
    # and the small files (model_index.json, configs, the tokenizer's vocabulary)
    slack = len(MODELS) * (1 << 20) + (256 << 10)
    assert text_encoder / 2 > slack  # a rank that fetched all of it would be seen
    assert all(abs(n - total / 2) <= slack for n in fetched), (fetched, total)
    assert sum(fetched) <= 1.02 * total + (512 << 10), (fetched, total)


def test_a_text_encoder_fastload_does_not_serve_is_named_not_left_to_transformers(
    bucket,
) -> None:
    """transformers' own loader would see the pipeline's temporary folder, without weights."""
    s3, _ = bucket
    with counting_proxies(s3.port, 1) as (proxy,):
        with fastload.patch_diffusers(), pytest.raises(UnsupportedError) as caught:
            diffusers.DiffusionPipeline.from_pretrained(
                "s3://models/quantized/", storage_options=_options(proxy.endpoint)
            )
        text = str(caught.value)
        assert text.startswith("text_encoder (CLIPTextModel) of the pipeline at "), text
        assert "s3://models/quantized/text_encoder/" in text, text
        assert "quant_method='not-a-method'" in text, text
        assert "transformers itself cannot read object storage" in text, text
        assert "fastload-pipeline-" not in text, text  # the temporary folder is not named
        # refused from its config: not one byte of its weights was fetched
        assert proxy.sent < 256 << 10, proxy.sent
    assert not fastload.diffusers_patched()


def test_process_group_for_a_local_pipeline_is_refused_by_name(bucket) -> None:
    """diffusers would take it for a pipeline argument and ignore it, with a warning."""
    _, local = bucket
    with fastload.patch_diffusers(), pytest.raises(UnsupportedError, match="process_group="):
        diffusers.DiffusionPipeline.from_pretrained(local / "big", process_group=object())


def test_process_group_with_a_device_map_is_refused_before_anything_is_fetched(bucket) -> None:
    s3, _ = bucket
    with counting_proxies(s3.port, 1) as (proxy,):
        with fastload.patch_diffusers(), pytest.raises(UnsupportedError, match="device_map"):
            diffusers.DiffusionPipeline.from_pretrained(
                "s3://models/big/",
                storage_options=_options(proxy.endpoint),
                process_group=object(),
                device_map="balanced",
            )
        assert proxy.sent == 0
