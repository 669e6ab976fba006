"""diffusers models and pipelines from object storage (``s3://`` on the S3-compatible test server,
``http://`` on a plain HTTP server that cannot list) and across ranks.

A tiny UNet (about 12 MB, one file or sharded, a float16 variant, in a pipeline's ``unet/``
folder), a tiny Stable Diffusion pipeline (UNet, VAE, CLIP text encoder and tokenizer, DDIM
scheduler) and a DDPM pipeline are saved by diffusers, placed in the bucket, then loaded from the
URL by ``fastload.from_pretrained`` and, under ``fastload.patch_diffusers()``, by diffusers' own
``from_pretrained``: every tensor bitwise equal to diffusers' own load of the local copy. What the
store sends is counted at a proxy in front of it (tests/support/s3_server.py's ``FaultProxy``);
what lands on disk during a load is watched from that proxy too: only ``config.json``, never the
weights. Bad buckets raise errors naming the URL and the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import fastload  # noqa: E402
from fastload.core.basics.errors import CheckpointError, FastloadFileNotFoundError  # noqa: E402

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from http_store import HttpStore  # noqa: E402
from s3_server import S3Server, counting_proxies  # noqa: E402
from s3_server import patient_options as _options  # noqa: E402
from spawn_ranks import (  # noqa: E402
    free_port,
    init_store_rank,
    leave_group,
    rank_results,
    run_ranks,
)

UNET = {
    "block_out_channels": (64, 128),
    "norm_num_groups": 8,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 32,
    "attention_head_dim": 8,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 1,
    "sample_size": 8,
}


def _digests(model: torch.nn.Module) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in model.state_dict().items()
    }


def _same(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    assert type(ours) is type(theirs)
    x, y = ours.state_dict(), theirs.state_dict()
    assert list(x) == list(y)
    for key in y:
        assert x[key].dtype == y[key].dtype, key
        assert torch.equal(x[key], y[key]), key


def _shard_bytes(folder: Path) -> int:
    """The bytes of the shards the (not variant) index of ``folder`` names."""
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    return sum((folder / shard).stat().st_size for shard in set(index["weight_map"].values()))


def _ddpm(where: Path) -> None:
    torch.manual_seed(1)
    unet = diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler()).save_pretrained(where)


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory):
    """The S3 server and an HTTP server over the same files: ``unet`` (one file), ``sharded``
    (four shards, and a float16 variant), ``pipe/unet`` (a subfolder), ``sd`` (a Stable Diffusion
    pipeline, and its float16 variant), ``ddpm`` (a DDPM pipeline)."""
    root = tmp_path_factory.mktemp("d-store")
    local = root / "local"
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**UNET)
    unet.save_pretrained(local / "unet")
    unet.save_pretrained(local / "sharded", max_shard_size="4MB")
    unet.to(torch.float16).save_pretrained(local / "sharded", max_shard_size="2MB", variant="fp16")
    shutil.copytree(local / "unet", local / "pipe" / "unet")
    from tiny_pipelines import make_pipeline

    pipe = make_pipeline(root)
    pipe.save_pretrained(local / "sd")
    pipe.to(torch.float16).save_pretrained(local / "sd", variant="fp16")
    _ddpm(local / "ddpm")
    (root / "s3").mkdir()
    s3 = S3Server(root / "s3")
    s3.bucket("models")
    for name in ("unet", "sharded", "pipe", "sd", "ddpm"):
        s3.place(local / name, "models", name)
    http = HttpStore(local)
    yield s3, http, local
    http.close()
    s3.stop()


@pytest.fixture
def proxy(bucket):
    with counting_proxies(bucket[0].port, 1) as (p,):
        yield p


@pytest.mark.parametrize(
    "where, kw",
    [
        ("unet", {}),
        ("sharded", {}),
        ("sharded", {"variant": "fp16"}),
        ("pipe", {"subfolder": "unet"}),
        ("sharded", {"variant": "fp16", "torch_dtype": torch.float32}),
    ],
    ids=["one-file", "sharded", "variant", "subfolder", "variant-as-float32"],
)
def test_a_model_from_s3_is_diffusers_load_of_the_local_copy(bucket, proxy, where, kw) -> None:
    s3, _, local = bucket
    cls = diffusers.UNet2DConditionModel
    theirs = cls.from_pretrained(local / where, **kw)
    url = f"s3://models/{where}"
    ours = fastload.from_pretrained(
        cls, url, storage_options=_options(proxy.endpoint), progress=False, **kw
    )
    _same(ours, theirs)
    assert ours.config._name_or_path == url


def test_a_local_sharded_variant_index_is_an_index(bucket) -> None:
    """diffusers names a variant's index ``...safetensors.index.fp16.json`` (the variant before
    the last suffix): read as an index locally as well as from the store."""
    _, _, local = bucket
    cls = diffusers.UNet2DConditionModel
    theirs = cls.from_pretrained(local / "sharded", variant="fp16")
    _same(fastload.from_pretrained(cls, local / "sharded", variant="fp16"), theirs)


@pytest.mark.parametrize("where", ["unet", "sharded"])
def test_a_model_over_plain_http_is_diffusers_load_of_the_local_copy(bucket, where) -> None:
    _, http, local = bucket
    cls = diffusers.UNet2DConditionModel
    ours = fastload.from_pretrained(cls, http.url(f"{where}/"), progress=False)
    _same(ours, cls.from_pretrained(local / where))


def test_the_weights_stream_into_the_tensors_and_never_land_on_disk(
    bucket, proxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the store answers each GET, what the load has written to the temporary directory
    is looked at from the proxy: ``config.json`` only, never a shard."""
    _, _, local = bucket
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen: dict[str, int] = {}
    looks: list[str] = []

    def look(path: str, first: int) -> None:
        looks.append(path)
        for f in scratch.rglob("*"):
            seen[f.name] = max(seen.get(f.name, 0), f.stat().st_size if f.is_file() else 0)

    proxy.on_get = look
    model = fastload.from_pretrained(
        diffusers.UNet2DConditionModel,
        "s3://models/sharded/",
        storage_options=_options(proxy.endpoint),
        progress=False,
    )
    weights = _shard_bytes(local / "sharded")
    # the side files' directory was made there, and looked at while each shard was read
    assert any(name.startswith("fastload-side-files-") for name in seen), seen
    assert set(seen) - {"config.json"} == {n for n in seen if n.startswith("fastload-side")}
    assert len({p for p in looks if "-of-" in p}) == 4, looks
    # every byte of the weights once, and the store's bytes went into the model's tensors
    assert weights <= proxy.sent <= weights + (1 << 20), (proxy.sent, weights)
    assert not list(scratch.iterdir())  # the fetched config is gone too
    _same(model, diffusers.UNet2DConditionModel.from_pretrained(local / "sharded"))


def test_a_model_from_s3_under_the_patch(bucket, proxy, caplog) -> None:
    _, _, local = bucket
    cls = diffusers.UNet2DConditionModel
    with caplog.at_level(logging.INFO, logger="fastload"), fastload.patch_diffusers():
        ours = cls.from_pretrained(
            "s3://models/sharded", variant="fp16", storage_options=_options(proxy.endpoint)
        )
    assert any("fastload served UNet2DConditionModel" in r.getMessage() for r in caplog.records)
    _same(ours, cls.from_pretrained(local / "sharded", variant="fp16"))


@pytest.mark.parametrize(
    "kw",
    [{}, {"variant": "fp16", "torch_dtype": torch.float16}],
    ids=["default", "fp16-variant"],
)
def test_a_pipeline_from_s3_under_the_patch_is_diffusers_load_of_the_local_copy(
    bucket, proxy, caplog, kw
) -> None:
    from tiny_pipelines import same_pipeline, step

    _, _, local = bucket
    theirs = diffusers.DiffusionPipeline.from_pretrained(local / "sd", **kw)
    url = "s3://models/sd/"
    with caplog.at_level(logging.INFO, logger="fastload"), fastload.patch_diffusers():
        ours = diffusers.DiffusionPipeline.from_pretrained(
            url, storage_options=_options(proxy.endpoint), **kw
        )
    assert not fastload.diffusers_patched()
    same_pipeline(ours, theirs)
    lines = [r.getMessage() for r in caplog.records]
    served = [line for line in lines if "fastload served" in line]
    # the UNet and the VAE by the diffusers patch, the CLIP text encoder by the transformers one,
    # each read from its folder in the bucket (the load's report names what it read)
    for name, cls in [("unet", "UNet2DCond"), ("vae", "AutoencoderKL"), ("text_encoder", "CLIP")]:
        assert any(f"served {cls}" in line for line in served), served
        assert any(f"into {cls}" in x and f"from: {url}{name}/" in x for x in lines), lines
    assert len(served) == 3, served
    assert ours.name_or_path == url
    assert ours.unet.config._name_or_path == f"{url}unet/"
    dtypes = {
        p.dtype for n in ("unet", "vae", "text_encoder") for p in getattr(ours, n).parameters()
    }
    if len(dtypes) == 1:  # a pipeline of mixed dtypes does not run
        assert torch.equal(step(ours), step(theirs))


def test_a_pipeline_over_plain_http_under_the_patch(bucket) -> None:
    _, http, local = bucket
    theirs = diffusers.DiffusionPipeline.from_pretrained(local / "ddpm")
    with fastload.patch_diffusers():
        ours = diffusers.DiffusionPipeline.from_pretrained(http.url("ddpm/"))
    assert type(ours) is type(theirs) and type(ours.scheduler) is type(theirs.scheduler)
    assert dict(ours.scheduler.config) == dict(theirs.scheduler.config)
    _same(ours.unet, theirs.unet)


# ---- bad buckets ----


def _bad_copy(s3: S3Server, local: Path, name: str, change: Any) -> str:
    where = local.parent / "bad" / name
    shutil.copytree(local / "sharded", where)
    change(where)
    return s3.place(where, "models", f"bad/{name}")


def test_a_shard_missing_from_the_bucket_is_named(bucket, proxy) -> None:
    s3, _, local = bucket

    def drop(folder: Path) -> None:
        sorted(folder.glob("diffusion_pytorch_model-0000*-of-*[0-9].safetensors"))[-1].unlink()

    url = _bad_copy(s3, local, "missing-shard", drop)
    with pytest.raises(CheckpointError) as caught:
        fastload.from_pretrained(
            diffusers.UNet2DConditionModel, url, storage_options=_options(proxy.endpoint)
        )
    text = str(caught.value)
    assert f"{url}diffusion_pytorch_model.safetensors.index.json" in text, text
    assert "[missing-shard]" in text, text


def test_a_variant_not_in_the_bucket_is_named(bucket, proxy) -> None:
    with pytest.raises(CheckpointError) as caught:
        fastload.from_pretrained(
            diffusers.UNet2DConditionModel,
            "s3://models/unet/",
            variant="fp8",
            storage_options=_options(proxy.endpoint),
        )
    text = str(caught.value)
    assert "s3://models/unet/" in text and "diffusion_pytorch_model.fp8.safetensors" in text, text
    assert proxy.sent < 4096  # nothing but the HEAD answers


def test_a_prefix_without_config_json_is_named(bucket, proxy) -> None:
    s3, _, local = bucket
    url = _bad_copy(s3, local, "no-config", lambda f: (f / "config.json").unlink())
    with pytest.raises(FastloadFileNotFoundError) as caught:
        fastload.from_pretrained(
            diffusers.UNet2DConditionModel, url, storage_options=_options(proxy.endpoint)
        )
    assert f"{url}: no config.json there" in str(caught.value)
    assert proxy.sent < 4096  # refused before any weight was read


def test_a_pipeline_without_model_index_or_variant_is_named(bucket, proxy) -> None:
    options = _options(proxy.endpoint)
    with fastload.patch_diffusers():
        with pytest.raises(FastloadFileNotFoundError, match=r"s3://models/unet/: no model_index"):
            diffusers.DiffusionPipeline.from_pretrained(
                "s3://models/unet/", storage_options=options
            )
        with pytest.raises(CheckpointError, match=r"s3://models/sd/: no component .*'fp8'"):
            diffusers.DiffusionPipeline.from_pretrained(
                "s3://models/sd/", variant="fp8", storage_options=options
            )


# ---- across ranks ----


def _rank(rank: int, world: int, port: int, root: str, endpoints: list[str]) -> None:
    import torch.distributed as dist

    init_store_rank(rank, world, port, 120)
    out: dict[str, Any] = {}
    try:
        model = fastload.from_pretrained(
            diffusers.UNet2DConditionModel,
            "s3://models/sharded/",
            storage_options=_options(endpoints[rank]),
            process_group=dist.group.WORLD,
            progress=False,
        )
        out["digests"] = _digests(model)
    except Exception as e:  # what the user sees, for the test to show
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
    leave_group()


def test_two_ranks_each_fetch_about_half_and_get_the_single_load(bucket, tmp_path: Path) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    s3, _, local = bucket
    single = _digests(fastload.from_pretrained(diffusers.UNet2DConditionModel, local / "sharded"))
    with counting_proxies(s3.port, 2) as proxies:
        run_ranks(
            _rank,
            (2, free_port(), str(tmp_path), [p.endpoint for p in proxies]),
            world=2,
            timeout_s=300,
            what="diffusers",
        )
    for r, got in enumerate(rank_results(tmp_path, 2)):
        assert got.get("digests") == single, (r, got.get("error"))
    total = _shard_bytes(local / "sharded")
    fetched = [p.sent for p in proxies]
    # each rank its half, plus the headers, the config and at most one chunk more
    assert all(n <= total / 2 + (1 << 20) + (256 << 10) for n in fetched), (fetched, total)
    assert sum(fetched) <= 1.05 * total + (512 << 10), (fetched, total)
