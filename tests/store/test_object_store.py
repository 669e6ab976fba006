"""Loading straight from object storage: a real S3-compatible server on 127.0.0.1 (s3s-fs, see
tests/support/s3_server.py), checkpoints uploaded with boto3, and a proxy that cuts or stalls its
connections. Every load is compared byte for byte with the local load of the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fresh import run_script
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, FaultProxy, S3Server
from tensor_samples import every_dtype_tensors
from torch import nn

import fastload
from fastload.core.basics.errors import (
    CheckpointError,
    FastloadIOError,
    MemoryBudgetError,
    RequestError,
)
from fastload.core.memory.budget import MemoryBudget

pytest.importorskip("boto3")

#: retry and timeout settings that keep the fault tests short (the defaults are minutes)
QUICK = {
    "max_retries": "3",
    "retry_init_backoff": "20ms",
    "retry_max_backoff": "100ms",
    "read_timeout": "1s",
}
#: for the faults a load must get over: a response slower than QUICK's 1 s on a busy machine is
#: not taken for a stall, and there are retries to spare (the stall injected lasts 12 s)
RESUMING = {**QUICK, "max_retries": "6", "read_timeout": "4s"}


@pytest.fixture
def proxy(env: S3Server, monkeypatch: pytest.MonkeyPatch):
    p = FaultProxy(env.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    yield p
    p.close()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(flat[0], flat[1])


def big_tensors() -> dict[str, torch.Tensor]:
    """4 MiB, 2 MiB and a few small tensors: a cut after 1 MiB is in the middle of a tensor."""
    gen = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(1024, 1024, generator=gen),
        "bf16": torch.randn(1024, 1024, generator=gen).to(torch.bfloat16),
        "bias": torch.randn(1024, generator=gen),
        "steps": torch.arange(7, dtype=torch.int64),
    }


@pytest.fixture(scope="module")
def big_file(server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    local = tmp_path_factory.mktemp("big") / "model.safetensors"
    fastload.save_file(big_tensors(), local)
    return local, server.upload(local, "models", "big/model.safetensors")


# --- what users get -----------------------------------------------------------------------------


def test_every_dtype_loads_from_s3_bitwise_equal_to_the_local_file(env, tmp_path):
    tensors = every_dtype_tensors(seed=5)
    local = tmp_path / "every.safetensors"
    fastload.save_file(tensors, local, metadata={"format": "pt"})
    url = env.upload(local, "models", "dtypes/every.safetensors")
    remote, here = fastload.load_file(url), fastload.load_file(local)
    assert list(remote) == list(here)
    assert all(same_bytes(remote[k], here[k]) for k in here)
    with fastload.safe_open(url) as f, fastload.safe_open(local) as g:
        assert f.file.mode == "ranged-get" and f.path == url
        assert f.keys() == g.keys() and f.metadata() == g.metadata() == {"format": "pt"}
        for name in g.keys():
            assert same_bytes(f.get_tensor(name), g.get_tensor(name)), name
        assert same_bytes(f.get_slice("t_F32")[1:3, ::2], g.get_slice("t_F32")[1:3, ::2])


def test_a_conversion_during_the_ranged_reads_equals_the_local_conversion(env, big_file):
    local, url = big_file
    for dtype in (torch.float16, torch.float32, torch.bfloat16, torch.float64):
        remote = fastload.load_file(url, dtype=dtype)
        here = fastload.load_file(local, dtype=dtype)
        assert all(same_bytes(remote[k], here[k]) for k in here), dtype


def _sequential() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))


def test_a_sharded_checkpoint_reads_its_shards_in_parallel_and_equals_the_local_load(
    env, proxy, tmp_path
):
    local = tmp_path / "sharded"
    fastload.save_pretrained(_sequential(), local, max_shard_size="600KB")
    shards = sorted(p.name for p in local.glob("*.safetensors"))
    assert len(shards) >= 3
    url = env.upload(local, "models", "sharded")
    # the first shard's data is held back until a data request for the last one arrives: a
    # load that reads the shards one after the other cannot make that happen
    proxy.hold(shards[0], shards[-1])
    remote, report = fastload.from_pretrained(
        _sequential, url, threads=4, progress=False, output_loading_info=True
    )
    assert proxy.overlapped is True
    here = fastload.from_pretrained(_sequential, local, mmap="copy", progress=False)
    pairs = zip(remote.state_dict().values(), here.state_dict().values(), strict=True)
    assert all(same_bytes(a, b) for a, b in pairs)
    assert report.read_mode == "ranged-get"
    assert sorted(report.files) == [f"{url}{name}" for name in shards]


def test_a_shards_small_share_of_a_fetch_is_not_cut_into_small_gets(env, proxy, tmp_path):
    # the shards of one fetch share its threads: a small shard's requests are sized for the
    # whole fetch (one 2 MiB GET here), not for its own bytes alone (1 MiB ones, each a request)
    from fastload.core.reads.reading import fill_many
    from fastload.core.store.object_store import open_file

    gen = torch.Generator().manual_seed(5)
    shards = {
        "large.safetensors": {"a": torch.randn(14, 1 << 18, generator=gen)},  # 14 MiB
        "small.safetensors": {"b": torch.randn(2, 1 << 18, generator=gen)},  # 2 MiB
    }
    for name, tensors in shards.items():
        fastload.save_file(tensors, tmp_path / name)
    url = env.upload(tmp_path, "models", "shares")
    data_gets: dict[str, int] = {}

    def count(path: str, start: int) -> None:
        if start > 8:  # past the header's two requests (its length at 0, the header at 8)
            key = path.rsplit("/", 1)[-1]
            data_gets[key] = data_gets.get(key, 0) + 1

    files = {name: open_file(f"{url}{name}") for name in shards}
    proxy.on_get = count
    out = {name: torch.empty_like(t) for ts in shards.values() for name, t in ts.items()}
    work = [(files[name], [(n, out[n], None) for n in ts]) for name, ts in shards.items()]
    fill_many(work, threads=4)  # 16 MiB on 4 threads: 4 MiB a request
    assert all(torch.equal(out[n], t) for ts in shards.values() for n, t in ts.items())
    assert data_gets == {"large.safetensors": 4, "small.safetensors": 1}


def test_from_pretrained_of_a_transformers_model_in_s3_matches_the_local_load(env, tmp_path):
    """As a user runs it: a fresh interpreter, the AWS variables, a prefix URL."""
    pytest.importorskip("transformers")
    from tiny_models import make_model, save_checkpoint

    local = save_checkpoint(
        make_model("LlamaForCausalLM"), tmp_path / "llama", max_shard_size="40KB"
    )
    (local / "generation_config.json").write_text(json.dumps({"max_length": 17}))
    url = env.upload(local, "models", "llama")
    out = run_script(
        """
        import json, sys, torch, fastload
        from transformers import LlamaForCausalLM
        remote = fastload.from_pretrained(LlamaForCausalLM, sys.argv[1], progress=False)
        by_config = fastload.from_pretrained(sys.argv[1], progress=False)
        here = fastload.from_pretrained(LlamaForCausalLM, sys.argv[2], progress=False)
        def same(a, b):
            sa, sb = a.state_dict(), b.state_dict()
            return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
        print(json.dumps({
            "same": same(remote, here), "by_config": same(by_config, here),
            "class": type(by_config).__name__,
            "max_length": remote.generation_config.max_length,
        }))
        """,
        url,
        local,
        env={**_clean_env(), **env.env()},
    )
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"same": True, "by_config": True, "class": "LlamaForCausalLM", "max_length": 17}


def _clean_env() -> dict[str, str]:
    import os

    keep = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    keep["AWS_SHARED_CREDENTIALS_FILE"] = "/nonexistent/credentials"
    keep["AWS_CONFIG_FILE"] = "/nonexistent/config"
    return keep


def test_endpoint_and_credentials_come_from_the_aws_profile_files(
    server, big_file, tmp_path, monkeypatch
):
    local, url = big_file
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "credentials").write_text(
        f"[loader]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    (tmp_path / "config").write_text(
        f"[profile loader]\nregion = {REGION}\nendpoint_url = {server.endpoint}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "loader")
    remote, here = fastload.load_file(url), fastload.load_file(local)
    assert all(same_bytes(remote[k], here[k]) for k in here)


def test_storage_options_win_over_the_environment(env, big_file, monkeypatch):
    local, url = big_file
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    remote = fastload.load_file(url, storage_options={"aws_endpoint": env.endpoint})
    assert all(same_bytes(remote[k], t) for k, t in fastload.load_file(local).items())


def test_a_long_load_from_s3_shows_progress(env, big_file, monkeypatch, capsys):
    monkeypatch.setattr("fastload.core.basics.progress.PROGRESS_MIN_BYTES", 1 << 20)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    fastload.load_file(big_file[1])
    err = capsys.readouterr().err
    assert "fastload" in err and "MiB" in err and "100%" in err


def test_a_plain_http_server_with_ranges_is_a_store_too(server, big_file):
    local, url = big_file
    anonymous = S3Server(server.root, anonymous=True)  # the same objects, no credentials asked
    try:
        http = f"{anonymous.endpoint}/models/big/model.safetensors"
        remote = fastload.load_file(http)
        assert all(same_bytes(remote[k], t) for k, t in fastload.load_file(local).items())
    finally:
        anonymous.stop()


def test_the_files_beside_the_weights_download_without_the_weights(env, tmp_path):
    from fastload.core.store.object_store import download_files

    local = tmp_path / "model"
    local.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer.model", "merges.txt"):
        (local / name).write_text(name)
    fastload.save_file({"w": torch.ones(4)}, local / "model.safetensors")
    url = env.upload(local, "models", "side-files")
    got = download_files(url, tmp_path / "out")
    names = sorted(p.name for p in got)
    assert names == ["config.json", "merges.txt", "tokenizer.json", "tokenizer.model"]
    assert all((tmp_path / "out" / n).read_text() == n for n in names)


# --- faults --------------------------------------------------------------------------------------


def test_a_missing_object_bucket_or_checkpoint_is_file_not_found_naming_the_url(env):
    for url in (
        "s3://models/nothing/here.safetensors",
        "s3://no-such-bucket/model.safetensors",
    ):
        with pytest.raises(FileNotFoundError, match=f"{url}: \\[store-not-found\\]") as caught:
            fastload.load_file(url)
        assert isinstance(caught.value, FastloadIOError) and caught.value.filename == url
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
        fastload.from_pretrained(_sequential, "s3://models/empty-prefix/", progress=False)


def test_denied_access_is_a_permission_error_that_never_shows_the_secret(env, big_file):
    url = big_file[1]
    wrong = "not-the-secret-" + "x" * 8
    with pytest.raises(PermissionError, match=f"{url}: \\[store-denied\\]") as caught:
        fastload.load_file(url, storage_options={"aws_secret_access_key": wrong})
    assert wrong not in str(caught.value) and SECRET_KEY not in str(caught.value)
    with pytest.raises(RequestError, match="unknown option 'no_such_option'") as caught:
        fastload.load_file(url, storage_options={"no_such_option": wrong})
    assert wrong not in str(caught.value)


def test_a_wrong_endpoint_fails_after_the_bounded_retries_naming_the_url(env, big_file):
    url = big_file[1]
    options = {**QUICK, "aws_endpoint": "http://127.0.0.1:9", "connect_timeout": "1s"}
    with pytest.raises(FastloadIOError, match="store-unavailable") as caught:
        fastload.load_file(url, storage_options=options)
    assert url in str(caught.value) and "after 3 retries" in str(caught.value)


def test_a_connection_cut_in_the_middle_of_a_tensor_is_resumed_bitwise_equal(proxy, big_file):
    local, url = big_file
    proxy.arm("cut", after=1 << 20, times=1)
    remote = fastload.load_file(url, storage_options=RESUMING, threads=2)
    assert proxy.faults == 1
    assert all(same_bytes(remote[k], t) for k, t in fastload.load_file(local).items())


def test_a_stalled_response_times_out_and_is_read_again(proxy, big_file):
    local, url = big_file
    proxy.arm("stall", after=1 << 20, times=1, stall_seconds=12)
    remote = fastload.load_file(url, storage_options=RESUMING, threads=2)
    assert proxy.faults == 1
    assert all(same_bytes(remote[k], t) for k, t in fastload.load_file(local).items())


def _holder() -> nn.Module:
    module = nn.Module()
    for name, t in big_tensors().items():
        module.register_buffer(name, torch.zeros_like(t))
    return module


@pytest.mark.parametrize("mode", ["cut", "stall"])
def test_a_store_that_keeps_failing_is_an_error_naming_the_url_and_tensor_and_no_model(
    proxy, big_file, mode
):
    url = big_file[1]
    model = _holder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # past a header's requests (its length, the header and their HTTP headers), inside every
    # data request
    proxy.arm(mode, after=300 << 10, times=-1, stall_seconds=3)
    options = {**QUICK, "max_retries": "1"}
    with pytest.raises(FastloadIOError, match="store-unavailable") as caught:
        fastload.from_pretrained(model, url, storage_options=options, progress=False)
    message = str(caught.value)
    assert url in message and "tensor '" in message
    assert proxy.faults >= 2  # the first try and the retry
    # the module passed in is left as it was: no tensor of it half filled
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_an_object_that_does_not_match_its_header_is_a_checkpoint_error(env, proxy, tmp_path):
    good = tmp_path / "good.safetensors"
    fastload.save_file(big_tensors(), good)
    data = good.read_bytes()
    cases = {
        "truncated.safetensors": (data[: len(data) // 2], "offsets-past-eof"),
        "not-safetensors.safetensors": (b"PK\x03\x04" + b"\0" * 64, "not-safetensors"),
        "huge-header.safetensors": ((1 << 40).to_bytes(8, "little") + b"{}", "header-too-large"),
    }
    for name, (content, rule) in cases.items():
        (tmp_path / name).write_bytes(content)
        url = env.upload(tmp_path / name, "models", f"bad/{name}")
        before = proxy.sent
        with pytest.raises(CheckpointError, match=f"{url}: \\[{rule}\\]"):
            fastload.load_file(url)
        # only the header's requests: the 8-byte length, then the header where the length is
        # inside the object (and their HTTP headers); nothing was allocated or read after that
        header = 8 + int.from_bytes(content[:8], "little")
        assert proxy.sent - before <= (header if header <= len(content) else 8) + 2 * 4096


def test_an_object_replaced_after_it_was_opened_is_refused_not_mixed(env, big_file, tmp_path):
    local, url = big_file
    other = tmp_path / "other.safetensors"
    fastload.save_file(
        {k: v + 1 if v.is_floating_point() else v for k, v in big_tensors().items()}, other
    )
    with fastload.safe_open(url) as f:
        env.upload(other, "models", "big/model.safetensors")
        try:
            with pytest.raises(CheckpointError, match="object-changed"):
                f.get_tensor("big")
        finally:
            env.upload(local, "models", "big/model.safetensors")


# --- memory --------------------------------------------------------------------------------------


def test_a_model_larger_than_the_budget_is_refused_before_a_tensor_byte_is_fetched(
    proxy, big_file, monkeypatch
):
    local, url = big_file
    nbytes = sum(t.numel() * t.element_size() for t in big_tensors().values())
    monkeypatch.setattr(
        "fastload.core.loading.memory_budget", lambda: MemoryBudget(nbytes // 2, "a test budget")
    )
    with pytest.raises(MemoryBudgetError, match="object storage") as caught:
        fastload.from_pretrained(_holder, url, progress=False)
    assert caught.value.needed == nbytes
    assert proxy.sent <= 4 * 4096  # the header's two requests, nothing more


def test_peak_memory_of_a_load_from_s3_is_the_model_and_a_small_bounded_buffer(env, tmp_path):
    """Measured by the kernel in a fresh interpreter: the peak resident memory (VmHWM, reset
    before the load) less what was resident before it, for a 64 MiB load. A load that buffered
    the object before copying it would need twice the model."""
    local = tmp_path / "m.safetensors"
    gen = torch.Generator().manual_seed(0)
    fastload.save_file({f"w{i}": torch.randn(1024, 2048, generator=gen) for i in range(8)}, local)
    url = env.upload(local, "models", "rss/model.safetensors")
    out = run_script(
        """
        import json, sys
        import torch, fastload
        def status(field):
            for line in open("/proc/self/status"):
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        fastload.load_file(sys.argv[2])  # what a first load imports, on a local file
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from what is resident now
        before = status("VmRSS:")
        out = fastload.load_file(sys.argv[1])
        hwm = status("VmHWM:")
        print(json.dumps({"grew": hwm - before,
                          "model": sum(t.numel() * t.element_size() for t in out.values())}))
        """,
        url,
        _tiny_local(tmp_path),
        env={**_clean_env(), **env.env()},
    )
    got = json.loads(out.strip().splitlines()[-1])
    assert got["model"] == 64 << 20
    assert got["model"] <= got["grew"] <= got["model"] + (48 << 20), got


def _tiny_local(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.safetensors"
    fastload.save_file({"x": torch.ones(4)}, path)
    return path


def test_the_url_checks_need_no_server():
    from fastload.core.store.object_store import is_url

    assert is_url("s3://b/k") and is_url("gs://b/k") and is_url("az://c/k")
    assert not is_url("/local/s3://x") and not is_url("model-id/name") and not is_url(Path("x"))
    with pytest.raises(RequestError, match="storage_options apply to object storage URLs"):
        fastload.load_file(__file__, storage_options={"aws_region": "x"})
    with pytest.raises(RequestError, match="read_mode='mmap' needs a local file"):
        fastload.load_file("s3://b/k.safetensors", read_mode="mmap")


def test_the_staged_path_of_gpu_loads_fills_from_s3_within_its_pool(env, big_file):
    """Accelerator destinations are filled through the staging pool: run here with CPU
    destinations (the same code without a GPU), two 1 MiB slots for tensors of up to 4 MiB."""
    from fastload.core.memory.staging import StagingPool
    from fastload.core.reads.streaming import stream_into

    local, url = big_file
    here = fastload.load_file(local)
    out = {k: torch.empty_like(v) for k, v in here.items()}
    pool = StagingPool(1 << 20, 2)
    with fastload.safe_open(url) as f:
        stream_into(f.file, [(k, t, None) for k, t in out.items()], pool=pool)
    assert all(same_bytes(out[k], here[k]) for k in here)
    assert pool.peak_bytes == 2 << 20


# --- vLLM's weights from object storage, and `fastload fetch` -----------------------------------


def _remote_weights(url: str, **kwargs: object):
    from fastload.integrations.vllm.remote import RemoteWeights

    return RemoteWeights(url, **kwargs)  # type: ignore[arg-type]


def _reader_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name == "fastload-remote-weights"]


def test_vllm_weights_from_s3_are_every_stored_tensor_bitwise_in_small_batches(env, tmp_path):
    local = tmp_path / "sharded"
    fastload.save_pretrained(_sequential(), local, max_shard_size="600KB")
    url = env.upload(local, "models", "vllm-sharded")
    here: dict[str, torch.Tensor] = {}
    for shard in local.glob("*.safetensors"):
        here.update(fastload.load_file(shard))
    stream = _remote_weights(url, batch_bytes=300_000, skip=lambda name: name == "5.bias")
    assert len(stream.paths) >= 3 and stream.total == sum(
        t.numel() * t.element_size() for n, t in here.items() if n != "5.bias"
    )
    got = dict(iter(stream))
    assert sorted(got) == sorted(n for n in here if n != "5.bias")
    assert all(same_bytes(got[n], here[n]) for n in got)
    assert stream.bytes == stream.total
    assert _reader_threads() == []


def test_vllm_weights_from_s3_dropped_early_stop_their_reader(env, big_file):
    stream = _remote_weights(big_file[1], batch_bytes=1 << 20)
    it = iter(stream)
    name, tensor = next(it)
    assert same_bytes(tensor, big_tensors()[name])
    it.close()  # what a weight loader failing on the first tensor does to the generator
    assert _reader_threads() == []


def test_vllm_weights_from_a_store_that_keeps_failing_name_the_url_and_tensor(proxy, big_file):
    url = big_file[1]
    proxy.arm("cut", after=300 << 10, times=-1)
    stream = _remote_weights(url, storage_options={**QUICK, "max_retries": "1"})
    with pytest.raises(FastloadIOError, match="store-unavailable") as caught:
        list(stream)
    assert url in str(caught.value) and "tensor '" in str(caught.value)
    assert _reader_threads() == []


def test_fastload_fetch_copies_the_config_and_tokenizer_never_the_weights(env, tmp_path, capsys):
    from fastload.tools.cli import main

    local = tmp_path / "model"
    local.mkdir()
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        (local / name).write_text(name)
    fastload.save_file({"w": torch.ones(4)}, local / "model.safetensors")
    url = env.upload(local, "models", "fetch-me")
    assert main(["fetch", url, str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "tokenizer.json",
    ]
    assert "config.json" in capsys.readouterr().out
    # bad input: one line on stderr, status 1
    assert main(["fetch", str(local), str(tmp_path / "no")]) == 1
    assert main(["fetch", "s3://models/nothing-here/", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not an object storage URL" in err[0] and "nothing-here" in err[1]


def test_fastload_inspect_and_verify_read_a_checkpoint_in_s3(env, tmp_path, capsys):
    from fastload.tools.cli import main

    local = tmp_path / "sharded"
    fastload.save_pretrained(_sequential(), local, max_shard_size="600KB")
    url = env.upload(local, "models", "cli-sharded")
    assert main(["inspect", url, "--json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(local), "--json"]) == 0
    here = json.loads(capsys.readouterr().out)
    assert remote["index"] == f"{url}model.safetensors.index.json"
    for key in ("tensors", "bytes", "parameters", "dtypes", "index_metadata"):
        assert remote[key] == here[key], key
    assert [f["tensors"] for f in remote["files"]] == [f["tensors"] for f in here["files"]]
    assert main(["verify", url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {url}model.safetensors.index.json:") and "read)" in out
    # a shard whose data is shorter than its header says: verify fails naming it, one line
    shard = sorted(local.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1000])
    env.upload(shard, "models", f"cli-sharded/{shard.name}")
    assert main(["verify", url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and shard.name in err[0], err
