"""What opening a checkpoint in object storage fetches: its headers, exactly (the 8-byte length,
then the header), and nothing of the tensor data, which the reads after it fetch once. Counted
outside fastload, at a proxy in front of the S3-compatible server (tests/support/s3_server.py):
the byte ranges each request asked for, and the response bytes the proxy forwarded.

Before, the open read the length with the 256 KiB after it in one request and dropped the
tensor bytes among them, which the data reads then fetched again: on every rank of a collective
load, for every shard."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, FaultProxy, S3Server
from spawn_ranks import free_port, init_store_rank, leave_group, run_ranks
from torch import nn

import fastload

pytest.importorskip("boto3")

TIMEOUT_S = 240
#: the most bytes of one HTTP answer's own headers (status line, ETag, dates, ranges)
HTTP_HEADERS = 1024


def _sequential() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))


def _header_end(path: Path) -> int:
    """Where the tensor data of the safetensors file ``path`` starts: 8 + its header's length."""
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _asked(proxy: FaultProxy, sizes: dict[str, int]) -> dict[str, list[tuple[int, int]]]:
    """``[start, stop)`` of each GET the proxy forwarded for each file of ``sizes``, in order."""
    out: dict[str, list[tuple[int, int]]] = {name: [] for name in sizes}
    for method, path, start, end in proxy.requests:
        name = path.split("?")[0].rsplit("/", 1)[-1]
        if method == "GET" and name in sizes:
            stop = sizes[name] if end is None else min(end + 1, sizes[name])
            out[name].append((start, stop))
    return out


def _tiles(ranges: list[tuple[int, int]], start: int, stop: int) -> bool:
    """Whether the sorted ``ranges`` cover ``[start, stop)`` with no gap and no overlap."""
    ends = [start] + [b for a, b in ranges]
    return bool(ranges) and [a for a, _ in ranges] == ends[:-1] and ends[-1] == stop


def _body_bytes(proxy: FaultProxy, sizes: dict[str, int]) -> int:
    return sum(stop - start for ranges in _asked(proxy, sizes).values() for start, stop in ranges)


@pytest.fixture(scope="module")
def sharded(server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Three shards or more, each larger than the 256 KiB the open read before."""
    local = tmp_path_factory.mktemp("open-bytes") / "sharded"
    fastload.save_pretrained(_sequential(), local, max_shard_size="600KB")
    shards = list(local.glob("*.safetensors"))
    assert len(shards) >= 3 and all(p.stat().st_size > 300 << 10 for p in shards)
    return local, server.upload(local, "models", "open-bytes")


def _sizes(local: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(local.glob("*.safetensors"))}


def test_a_load_fetches_every_byte_of_every_shard_once(env, sharded) -> None:
    local, url = sharded
    sizes = _sizes(local)
    proxy = FaultProxy(env.port)
    try:
        options = {"aws_endpoint": proxy.endpoint}
        remote = fastload.from_pretrained(
            _sequential, url, storage_options=options, threads=4, progress=False
        )
    finally:
        proxy.close()
    here = fastload.from_pretrained(_sequential, local, mmap="copy", progress=False)
    for (name, a), b in zip(remote.state_dict().items(), here.state_dict().values(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    asked = _asked(proxy, sizes)
    for name, ranges in asked.items():
        # the header: its length, then exactly the header; then the data, each byte once
        end = _header_end(local / name)
        assert sorted(ranges)[:2] == [(0, 8), (8, end)], (name, ranges)
        assert _tiles(sorted(ranges)[2:], end, sizes[name]), (name, ranges)
    fetched = {name: sum(stop - start for start, stop in r) for name, r in asked.items()}
    assert fetched == sizes  # 256 KiB + 8 - header more of each shard before
    # what the proxy forwarded: those bodies, the index's, and each answer's HTTP headers
    bodies = _body_bytes(proxy, {**sizes, "model.safetensors.index.json": _index_size(local)})
    assert bodies <= proxy.sent <= bodies + HTTP_HEADERS * len(proxy.requests), proxy.sent


def _index_size(local: Path) -> int:
    return (local / "model.safetensors.index.json").stat().st_size


def test_opening_a_file_fetches_its_header_and_a_tensor_only_its_bytes(env, sharded) -> None:
    local, url = sharded
    name = sorted(_sizes(local))[0]
    proxy = FaultProxy(env.port)
    try:
        options = {"aws_endpoint": proxy.endpoint}
        with fastload.safe_open(f"{url}{name}", storage_options=options) as f:
            opened = _body_bytes(proxy, {name: 1 << 40})
            key = sorted(f.keys())[0]
            got = f.get_tensor(key)
        total = _body_bytes(proxy, {name: 1 << 40})
    finally:
        proxy.close()
    with fastload.safe_open(local / name) as f:
        want = f.get_tensor(key)
    assert torch.equal(got, want)
    assert opened == _header_end(local / name)  # 8 + 256 KiB before, whatever the header
    assert total - opened == want.numel() * want.element_size()


# --- a collective load: two ranks, each through its own proxy ------------------------------------


def _digests(model: nn.Module) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in model.state_dict().items()
    }


def _rank(rank: int, world: int, port: int, root: str, url: str, endpoints: list[str]) -> None:
    init_store_rank(rank, world, port, TIMEOUT_S // 2)
    options = {
        "aws_endpoint": endpoints[rank],
        "aws_region": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
        "max_retries": "0",  # a range retried would be counted twice at the proxy
        "connect_timeout": "60s",  # no limit a busy machine reaches
        "timeout": "600s",
    }
    out: dict[str, Any] = {}
    try:
        model = fastload.from_pretrained(
            _sequential, url, process_group=dist.group.WORLD, storage_options=options,
            progress=False,
        )  # fmt: skip
        out["digests"] = _digests(model)
    except Exception as e:  # recorded for the test to show
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
        leave_group()


def test_a_collective_load_fetches_the_checkpoint_once_and_each_rank_the_headers(
    server, sharded, tmp_path: Path
) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    local, url = sharded
    sizes = _sizes(local)
    world = 2
    proxies = [FaultProxy(server.port) for _ in range(world)]
    try:
        endpoints = [p.endpoint for p in proxies]
        args = (world, free_port(), str(tmp_path), url, endpoints)
        run_ranks(_rank, args, world=world, timeout_s=TIMEOUT_S, what="open-bytes")
    finally:
        for p in proxies:
            p.close()
    here = fastload.from_pretrained(_sequential, local, mmap="copy", progress=False)
    for r in range(world):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got.get("digests") == _digests(here), (r, got.get("error"))
    headers = {name: _header_end(local / name) for name in sizes}
    data: dict[str, list[tuple[int, int]]] = {name: [] for name in sizes}
    for p in proxies:
        for name, ranges in _asked(p, sizes).items():
            # every rank reads each header (its length, then exactly the header) ...
            assert sorted(ranges)[:2] == [(0, 8), (8, headers[name])], (name, ranges)
            data[name] += sorted(ranges)[2:]
    for name, ranges in data.items():
        # ... and the ranks together each data byte once
        assert _tiles(sorted(ranges), headers[name], sizes[name]), (name, ranges)
    fetched = sum(_body_bytes(p, sizes) for p in proxies)
    assert fetched == sum(sizes.values()) + (world - 1) * sum(headers.values()), fetched
