"""A fleet started from one bucket: collective loads (``process_group``, ``tp_plan``) of a
checkpoint in object storage, with gloo ranks spawned on this machine and the S3-compatible
server of tests/support/s3_server.py.

Each rank reaches the store through its own proxy (tests/support/s3_server.py's ``FaultProxy``),
which counts the bytes the store sent that rank: measured outside fastload, each rank fetched about
1/N of the checkpoint, and together the ranks fetched it about once. The faults (a store this
rank cannot reach, credentials refused, another version on one rank, a connection cut under a
fetch, the object replaced mid-load, a rank killed) stop every rank with one error naming the
rank and the cause, within bounded waits: the ranks run under a deadline, and each scenario
writes what every rank raised."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from s3_server import SECRET_KEY, FaultProxy, S3Server, counting_proxies
from s3_server import patient_options as _options
from spawn_ranks import free_port, init_store_rank, leave_group, rank_results, run_ranks

import fastload
from fastload.distributed.object_reads import deal_objects

pytest.importorskip("boto3")

TIMEOUT_S = 240
#: a Llama of about 42 MB in two shards, whose projections 2 and 4 ranks divide
CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 16384,
}
# _options: no retries (a fault is an error at once, and no range is counted twice at the
# proxies), and no time limit a busy machine can reach: every fault here is refused at once (a
# closed port, a wrong key, another revision) or ends a rank, never a slow response


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in tensors.items()
    }


def _init(rank: int, world: int, port: int) -> None:
    # the backstop of a hang: a collective call waits at most TIMEOUT_S // 2
    init_store_rank(rank, world, port, TIMEOUT_S // 2)


def _load(kind: str, url: str, options: dict[str, str]) -> dict[str, torch.Tensor]:
    """One collective load of ``url`` on this rank; its tensors (a model's state dict)."""
    group = dist.group.WORLD
    if kind == "file":
        return fastload.load_file(url, process_group=group, storage_options=options)
    if kind == "safe_open":
        with fastload.safe_open(url, process_group=group, storage_options=options) as f:
            return {k: f.get_tensor(k) for k in f.offset_keys()}
    import transformers

    extra: dict[str, Any] = {"tp_plan": "llama"} if kind == "tp" else {"process_group": group}
    if kind == "local":  # a local checkpoint: no store options
        model = fastload.from_pretrained(
            transformers.LlamaForCausalLM, url, progress=False, **extra
        )
        return dict(model.state_dict())
    model = fastload.from_pretrained(
        transformers.LlamaForCausalLM, url, storage_options=options, progress=False, **extra
    )
    return dict(model.state_dict())


def _rank(rank: int, world: int, port: int, root: str, plan: list[dict[str, Any]]) -> None:
    """Runs each load of ``plan`` (kind, this rank's URL and endpoint, its secret) and writes
    what it got or raised to ``root/rank<r>.json``."""
    _init(rank, world, port)
    out: dict[str, Any] = {}
    broken = False
    try:
        for step in plan:
            mine = step["ranks"][rank]
            started = time.monotonic()
            try:
                got = _load(step["kind"], mine["url"], _options(mine["endpoint"], mine["secret"]))
                out[step["name"]] = {"digests": _digests(got)}
            except Exception as e:  # what the user sees, recorded for the test to check
                out[step["name"]] = {"error": str(e), "type": [c.__name__ for c in type(e).__mro__]}
                broken = "rank-lost" in str(e)
            out[step["name"]]["seconds"] = time.monotonic() - started
    finally:
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
    if broken:  # the group is gone: leave without tearing down connections to a dead peer
        os._exit(0)
    leave_group()


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory):
    """The S3 server with the checkpoint (two shards), a second revision of it (same layout,
    other values) and a single file, and the digests of single-process loads of each."""
    transformers = pytest.importorskip("transformers")
    from tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("fleet")
    (root / "s3").mkdir()
    s3 = S3Server(root / "s3")
    s3.bucket("models")
    one = make_checkpoint(root / "one", "LlamaForCausalLM", max_shard_size="25MB", **CONFIG)
    two = make_checkpoint(root / "two", "LlamaForCausalLM", seed=1, max_shard_size="25MB", **CONFIG)
    assert len(list(one.glob("*.safetensors"))) == 2
    shard = sorted(one.glob("*.safetensors"))[0]
    urls = {
        "one": s3.place(one, "models", "llama"),
        "two": s3.place(two, "models", "llama-v2"),
        "file": f"s3://models/llama/{shard.name}",
    }
    single = transformers.LlamaForCausalLM
    expected = {
        "one": _digests(dict(fastload.from_pretrained(single, one, progress=False).state_dict())),
        "file": _digests(fastload.load_file(shard)),
        "sizes": {
            "one": sum(p.stat().st_size for p in one.glob("*.safetensors")),
            "file": shard.stat().st_size,
        },
    }
    yield s3, urls, expected, shard
    s3.stop()


def _spawn(tmp: Path, world: int, plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    run_ranks(_rank, (world, free_port(), str(tmp), plan), world=world, timeout_s=TIMEOUT_S,
              what="fleet")  # fmt: skip
    return rank_results(tmp, world)


def _step(name: str, kind: str, world: int, url: str, proxies: list[FaultProxy], **per_rank: Any):
    """A load of ``url`` by every rank through its own proxy; ``per_rank``: ``{rank: {key:
    value}}`` overrides (another URL, endpoint or secret on one rank)."""
    ranks = []
    for r in range(world):
        entry = {"url": url, "endpoint": proxies[r].endpoint, "secret": SECRET_KEY}
        entry.update(per_rank.get(f"rank{r}", {}))
        ranks.append(entry)
    return {"name": name, "kind": kind, "ranks": ranks}


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_fetches_about_its_share_from_the_bucket_and_gets_the_single_process_model(
    bucket, tmp_path: Path, world: int
) -> None:
    s3, urls, expected, _ = bucket
    with counting_proxies(s3.port, world) as proxies:
        ranks = _spawn(tmp_path, world, [_step("full", "full", world, urls["one"], proxies)])
    total = expected["sizes"]["one"]
    for rank, got in enumerate(ranks):
        assert got["full"].get("digests") == expected["one"], (rank, got["full"].get("error"))
    fetched = [p.sent for p in proxies]
    # counted at each rank's proxy: its share of the tensors, plus the headers, the config and
    # the HTTP answers' own headers, at most one chunk more (chunks are dealt round robin)
    chunk = max(1 << 20, min(16 << 20, total // (world * 8)))
    for rank, nbytes in enumerate(fetched):
        assert nbytes <= total / world + chunk + (2 << 20), (rank, fetched)
    # every byte from the store once (independent loads would fetch world x the checkpoint)
    assert sum(fetched) <= 1.05 * total + world * (1 << 20), fetched


def test_load_file_safe_open_and_tensor_parallel_from_a_url(bucket, tmp_path: Path) -> None:
    s3, urls, expected, _ = bucket
    proxies = [[FaultProxy(s3.port) for _ in range(2)] for _ in range(3)]
    plan = [
        _step("file", "file", 2, urls["file"], proxies[0]),
        _step("safe_open", "safe_open", 2, urls["file"], proxies[1]),
        _step("tp", "tp", 2, urls["one"], proxies[2]),
    ]
    try:
        ranks = _spawn(tmp_path, 2, plan)
    finally:
        for p in [p for row in proxies for p in row]:
            p.close()
    size = expected["sizes"]["file"]
    for rank, got in enumerate(ranks):
        assert got["file"].get("digests") == expected["file"], (rank, got["file"])
        assert got["safe_open"].get("digests") == expected["file"], (rank, got["safe_open"])
        assert "digests" in got["tp"], (rank, got["tp"])
        # a tensor-parallel rank keeps its shards: each is a part of the full tensor
        assert set(got["tp"]["digests"]) == set(expected["one"])
    for row in proxies[:2]:  # load_file, then safe_open tensor by tensor: each about half
        assert all(p.sent <= 0.5 * size + (3 << 20) for p in row), [p.sent for p in row]
    assert all(p.sent <= 0.5 * expected["sizes"]["one"] + (5 << 20) for p in proxies[2])


def test_a_fault_on_one_rank_stops_every_rank_with_one_error_naming_it(
    bucket, tmp_path: Path
) -> None:
    s3, urls, expected, shard = bucket
    proxies = [[FaultProxy(s3.port) for _ in range(2)] for _ in range(4)]
    # rank 1's connections cut after 1 MiB of answers each (the headers' requests are less)
    proxies[3][1].arm("cut", after=1 << 20, times=-1)
    dead = "http://127.0.0.1:9"  # nothing listens there
    plan = [
        _step("unreachable", "full", 2, urls["one"], proxies[0], rank1={"endpoint": dead}),
        _step("denied", "file", 2, urls["file"], proxies[1], rank1={"secret": "wrong-secret"}),
        _step("revision", "full", 2, urls["one"], proxies[2], rank1={"url": urls["two"]}),
        _step("cut", "full", 2, urls["one"], proxies[3]),
        # after every fault the group is whole: the same ranks load again, bitwise
        _step("after", "file", 2, urls["file"], proxies[0]),
    ]
    try:
        ranks = _spawn(tmp_path, 2, plan)
    finally:
        for p in [p for row in proxies for p in row]:
            p.close()
    causes = {
        # from_pretrained fetches the config first, load_file opens the file
        "unreachable": ("config files failed on rank 1, so every rank stops", "FastloadIOError"),
        "denied": ("opening the file failed on rank 1, so every rank stops", "PermissionError"),
        "revision": ("[version-mismatch]", "CheckpointError"),
        "cut": ("reading its share of the checkpoint failed on rank 1", "FastloadIOError"),
    }
    for name, (words, cls) in causes.items():
        errors = [got[name].get("error") for got in ranks]
        assert errors[0] is not None and errors[0] == errors[1], (name, errors)  # one error
        assert words in errors[0], (name, errors[0])
        assert all(cls in got[name]["type"] for got in ranks), (name, ranks[0][name]["type"])
    assert "127.0.0.1:9" in ranks[0]["unreachable"]["error"]
    revision = ranks[0]["revision"]["error"]
    assert "rank 0: s3://models/llama/" in revision and "rank 1: s3://models/llama-v2/" in revision
    assert "s3://models/llama/" in ranks[0]["cut"]["error"]
    assert proxies[3][1].faults > 0
    # nothing past the headers was fetched by anyone before the versions were compared
    assert all(p.sent <= (1 << 20) for p in proxies[2]), [p.sent for p in proxies[2]]
    for rank, got in enumerate(ranks):
        assert got["after"].get("digests") == expected["file"], (rank, got["after"])


def test_an_object_replaced_mid_load_stops_every_rank_naming_the_url(
    bucket, tmp_path: Path
) -> None:
    s3, urls, _, shard = bucket
    key = f"llama/{shard.name}"
    original = (s3.root / "models" / key).read_bytes()
    proxies = [FaultProxy(s3.port) for _ in range(2)]
    replaced: list[bool] = []

    def replace_once(path: str, start: int) -> None:
        # the first request for tensor bytes (the header's requests start at 0 and 8)
        if start > 8 and shard.name in path and not replaced:
            replaced.append(True)
            changed = bytearray(original)
            changed[-64:] = bytes(64)  # same size, other bytes: another version
            s3.rewrite("models", key, bytes(changed))

    proxies[0].on_get = replace_once
    try:
        ranks = _spawn(tmp_path, 2, [_step("replaced", "file", 2, urls["file"], proxies)])
    finally:
        for p in proxies:
            p.close()
        s3.rewrite("models", key, original)
    assert replaced
    errors = [got["replaced"].get("error") for got in ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "replaced while loading" in errors[0] and urls["file"] in errors[0], errors[0]
    assert "failed on rank" in errors[0]
    assert all("CheckpointError" in got["replaced"]["type"] for got in ranks)


def _spawn_faulty(fn: Any, tmp: Path, plan: list[dict[str, Any]]) -> list[Any]:
    """Two ranks of ``fn`` (a rank function that breaks rank 1), each given at most
    :data:`TIMEOUT_S` to end; the processes, ended (any still alive then was killed)."""
    context = mp.spawn(fn, args=(2, free_port(), str(tmp), plan), nprocs=2, join=False)
    try:
        for process in context.processes:
            process.join(TIMEOUT_S)
        assert not any(p.is_alive() for p in context.processes), "a rank still waits"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return list(context.processes)


def _killed_rank(rank: int, world: int, port: int, root: str, plan: list[dict[str, Any]]) -> None:
    if rank == 1:  # stops in the middle of its first fetch, as a killed node would
        from fastload.distributed import object_reads

        original = object_reads.copy_into

        def die(*args: Any, **kwargs: Any) -> int:
            os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        object_reads.copy_into = die  # type: ignore[assignment]
    _rank(rank, world, port, root, plan)


def test_a_rank_killed_mid_load_stops_the_others_at_once(bucket, tmp_path: Path) -> None:
    s3, urls, _, _ = bucket
    proxies = [FaultProxy(s3.port) for _ in range(2)]
    plan = [_step("killed", "full", 2, urls["one"], proxies)]
    try:
        _, killed = _spawn_faulty(_killed_rank, tmp_path, plan)
        assert killed.exitcode == -signal.SIGKILL
    finally:
        for p in proxies:
            p.close()
    got = json.loads((tmp_path / "rank0.json").read_text())["killed"]
    assert "rank-lost" in got.get("error", ""), got
    assert "FastloadIOError" in got["type"]
    # bounded by the connection to the dead rank, not by the process group's timeout
    assert got["seconds"] < TIMEOUT_S // 2


def _failing_disk_rank(
    rank: int, world: int, port: int, root: str, plan: list[dict[str, Any]]
) -> None:
    if rank == 1:  # its disk fails under its chunks: every read is an I/O error
        from fastload.core.basics.errors import FastloadIOError
        from fastload.distributed import file_reads

        def broken(path: str, *args: Any) -> None:
            raise FastloadIOError(f"{path}: reading failed: [Errno 5] Input/output error")

        file_reads._pread = broken  # type: ignore[assignment]
    _rank(rank, world, port, root, plan)


def test_a_local_read_failing_on_one_rank_stops_every_rank_naming_it(
    bucket, tmp_path: Path
) -> None:
    # the same exchange for local files: the failing rank tells the others before its chunk
    shard = bucket[3]
    mine = {"url": str(shard.parent), "endpoint": "", "secret": ""}
    plan = [{"name": "disk", "kind": "local", "ranks": [mine, mine]}]
    _spawn_faulty(_failing_disk_rank, tmp_path, plan)
    ranks = rank_results(tmp_path, 2)
    errors = [got["disk"].get("error") for got in ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "reading its share of the checkpoint failed on rank 1" in errors[0]
    assert "Input/output error" in errors[0]
    assert all("FastloadIOError" in got["disk"]["type"] for got in ranks)
    # bounded by the exchange, not by the process group's timeout
    assert all(got["disk"]["seconds"] < TIMEOUT_S // 2 for got in ranks)


def _failing_plan_rank(
    rank: int, world: int, port: int, root: str, plan: list[dict[str, Any]]
) -> None:
    if rank == 1:  # fails after opening, before reading: its memory budget is too small
        from fastload.core import loading
        from fastload.core.basics.errors import MemoryBudgetError

        def refused(*args: Any, **kwargs: Any) -> None:
            raise MemoryBudgetError("the load must own 42.0 MiB; this process may make 1.0 MiB")

        loading.allocate = refused  # type: ignore[assignment]
    _rank(rank, world, port, root, plan)


def test_a_rank_failing_while_planning_stops_every_rank_naming_it(bucket, tmp_path: Path) -> None:
    # the others are in the read's first exchange: the failing rank joins it with its failure
    s3, urls, _, _ = bucket
    proxies = [FaultProxy(s3.port) for _ in range(2)]
    plan = [_step("plan", "full", 2, urls["one"], proxies)]
    try:
        _spawn_faulty(_failing_plan_rank, tmp_path, plan)
    finally:
        sent = [p.sent for p in proxies]
        for p in proxies:
            p.close()
    ranks = rank_results(tmp_path, 2)
    errors = [got["plan"].get("error") for got in ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "planning the load failed on rank 1" in errors[0], errors
    assert "1.0 MiB" in errors[0], errors
    assert all("MemoryBudgetError" in got["plan"]["type"] for got in ranks)
    # the error of the exchange the failing rank joined (a rank left waiting would have raised
    # the process group's timeout instead); no tensor byte fetched
    assert max(sent) < bucket[2]["sizes"]["one"] // 20, sent


def test_chunks_from_object_storage_are_cut_between_elements_and_dealt_round_robin() -> None:
    extents = [
        (0, 100, 100 + 3_000_003 * 4, "a", "F32"),  # 4-byte elements
        (0, 12_000_112, 12_000_112 + 5_000_001 * 2, "b", "BF16"),
        (0, 22_000_114, 22_000_114 + 700_000, "packed", "F4"),  # never cut
        (1, 64, 64 + 9_000_000, "c", "U8"),
    ]
    for world in (1, 2, 3, 4):
        chunks = deal_objects(extents, world)
        # interleaved: any N chunks in a row (of equal sizes) go to N ranks
        assert [c[3] for c in chunks[:world]] == list(range(world))
        assert len({c[3] for c in chunks[world : 2 * world]}) == world
        covered = sum(stop - start for _, start, stop, _ in chunks)
        assert covered == sum(stop - start for _, start, stop, _, _ in extents)
        for file, start, stop, _ in chunks:
            for f, t_start, t_stop, name, st_dtype in extents:
                item = {"F32": 4, "BF16": 2, "U8": 1, "F4": None}[st_dtype]
                for cut in (start, stop):
                    if f == file and t_start < cut < t_stop:
                        assert item is not None, (name, cut)
                        assert (cut - t_start) % item == 0, (name, cut)
        shares = [sum(b - a for _, a, b, o in chunks if o == r) for r in range(world)]
        assert max(shares) - min(shares) <= max(b - a for _, a, b, _ in chunks)


class _Gathered:
    """A group of ranks whose gather answers ``everyone`` (what each rank would send)."""

    def __init__(self, everyone: list[Any]) -> None:
        self.everyone = everyone

    def gather(self, value: Any) -> list[Any]:
        return self.everyone


def test_the_ranks_agree_on_one_version_of_each_object_or_all_refuse() -> None:
    from fastload.core.basics.errors import CheckpointError
    from fastload.distributed.pinning import agree_on_versions

    a, b = "s3://eu/m.safetensors", "s3://us/m.safetensors"
    v1, v2 = (100, '"e1"', "2026-01-01T00:00:00+00:00"), (100, '"e2"', None)
    dated = (100, None, "2026-01-01T00:00:00+00:00")
    agreed = [
        [[(a, v1)], [(a, v1)]],
        [[(a, v1)], [(b, (100, '"e1"', None))]],  # each node's replica: one ETag, one version
        [[(a, dated)], [(a, dated)]],
        [[("/x/m.safetensors", None)], [("/y/m.safetensors", None)]],  # local: headers decide
    ]
    for everyone in agreed:
        agree_on_versions(_Gathered(everyone), [])  # type: ignore[arg-type]
    refused = {
        "different versions": [[(a, v1)], [(a, v2)]],
        "without an ETag at different URLs": [[(a, dated)], [(b, dated)]],
        "locally on others": [[(a, v1)], [("/x/m.safetensors", None)]],
    }
    for words, everyone in refused.items():
        with pytest.raises(CheckpointError, match=r"\[version-mismatch\]") as caught:
            agree_on_versions(_Gathered(everyone), [])  # type: ignore[arg-type]
        assert words in str(caught.value) and "rank 1: " in str(caught.value)


def test_a_column_wise_slice_is_dealt_to_the_rank_that_keeps_it_cut_at_its_bounds() -> None:
    from fastload.distributed.object_reads import FORWARD_CHUNK_BYTES, MIN_OBJECT_CHUNK

    mib = 1 << 20
    extents = [
        (0, 0, 8 * mib, "replicated", "BF16"),
        (0, 8 * mib, 16 * mib, "colwise", "BF16"),
        (0, 16 * mib, 16 * mib + 2 * (MIN_OBJECT_CHUNK // 2), "small", "BF16"),
        (0, 20 * mib, 26 * mib, "rowwise", "BF16"),
    ]
    half = MIN_OBJECT_CHUNK // 2
    keepers = {
        "colwise": [(0, 4 * mib, 1), (4 * mib, 8 * mib, 0)],
        "small": [(0, half, 0), (half, 2 * half, 1)],  # below a request's worth: not cut out
    }
    chunks = deal_objects(extents, 2, 0, keepers, forwarded={"colwise", "small", "rowwise"})
    assert sum(b - a for _, a, b, _ in chunks) == sum(b - a for _, a, b, _, _ in extents)
    # a row-wise weight's chunks are small (their owner holds the others' parts until it has
    # sent them), the others' as large as a checkpoint of that size has them
    big = [(0, 0, 96 * mib, "replicated", "BF16"), (0, 96 * mib, 108 * mib, "rowwise", "BF16")]
    dealt = deal_objects(big, 2, 0, {}, forwarded={"rowwise"})
    rows = [(a, b) for _, a, b, _ in dealt if b > 96 * mib]  # those holding some of its bytes
    assert all(b - a <= FORWARD_CHUNK_BYTES for a, b in rows) and len(rows) >= 3, rows
    assert max(b - a for _, a, b, _ in dealt) > FORWARD_CHUNK_BYTES
    for _, a, b, owner in chunks:
        for lo, hi, keeper in [(8 * mib, 12 * mib, 1), (12 * mib, 16 * mib, 0)]:
            if a < hi and lo < b:  # within the slice, whole, and its keeper's
                assert lo <= a and b <= hi and owner == keeper, (a, b, owner)
    small = [c for c in chunks if c[1] < 16 * mib + 2 * half and 16 * mib < c[2]]
    assert all(c[1] <= 16 * mib < 16 * mib + half < c[2] for c in small), small
    shares = [sum(b - a for _, a, b, o in chunks if o == r) for r in range(2)]
    assert max(shares) - min(shares) <= max(b - a for _, a, b, _ in chunks)
    # without keepers, the same bytes as before
    assert [c[:3] for c in deal_objects(extents, 2)] != [c[:3] for c in chunks]
    assert sum(b - a for _, a, b, _ in deal_objects(extents, 2)) == sum(shares)
