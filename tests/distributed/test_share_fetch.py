"""``share_fetch``: processes that are not one ``torch.distributed`` job (vLLM replicas, the pods
of a fleet) meet at a rendezvous and share the fetch of one checkpoint from object storage.

Each peer is a process of its own with no default process group, reaching the S3-compatible
test server through its own proxy (tests/support/s3_server.py's ``FaultProxy``, which counts the
bytes the store sent it): measured outside fastload, each fetched about 1/N of the checkpoint and
the peers together about once, and each got every tensor bitwise as stored. The weight stream is
the one vLLM's ``--load-format fastload`` iterates (``RemoteWeights``, with the group
``share_fetch`` makes); the rendezvous' faults (a peer expecting another number, peers that
never come, a peer killed mid-fetch, another revision) stop every waiting peer with one error
within bounded waits."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, FaultProxy, S3Server
from spawn_ranks import free_port, tcp_connections

import fastload

pytest.importorskip("boto3")

#: the harness' deadline for every peer of a test to end: reached only by a hang (a peer left
#: waiting), never by a slow start on a busy machine; the rendezvous and group timeouts of the
#: tests that show "no peer waits" are longer still (HANG_S), so a peer that waited for them
#: fails the test here instead of raising a timeout's error
TIMEOUT_S = 900
HANG_S = 3600.0
#: a Llama of about 21 MB in several shards
CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 16384,
}
#: no retries (a retried range would be counted twice at the proxies); time limits far above
#: what a request to the local store takes on a busy machine
QUICK = {"max_retries": "0", "connect_timeout": "60s", "timeout": "600s"}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _peer(index: int, root: str, plan: dict[str, Any]) -> None:
    """One peer: joins the rendezvous, streams the checkpoint as vLLM's loader does, writes the
    tensors' digests (or the error it raised) to ``root/peer<index>.json``."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        del os.environ[key]
    os.environ.update(FASTLOAD_DISABLE_PROGRESS_BARS="1", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    from fastload.distributed.rendezvous import Rendezvous, join
    from fastload.integrations.vllm.remote import RemoteWeights

    mine = plan["peers"][index]
    options = {
        "aws_endpoint": mine["endpoint"],
        "aws_region": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
        **QUICK,
    }
    if mine.get("die"):  # stops in the middle of its first fetch, as a killed pod would
        from fastload.distributed import object_reads

        def die(*args: Any, **kwargs: Any) -> int:
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

        object_reads.copy_into = die  # type: ignore[assignment]
    out: dict[str, Any] = {}
    try:
        rdv = Rendezvous(
            "127.0.0.1",
            plan["port"],
            mine["peers"],
            plan.get("timeout", TIMEOUT_S * 2 / 3),
            mine.get("node"),
        )
        group = join(rdv, f"node:{plan['key']}")
        out["rank"] = group.rank
        skip = set(mine.get("skip", ()))
        stream = RemoteWeights(
            mine["url"],
            storage_options=options,
            skip=lambda name: name in skip,
            batch_bytes=plan.get("batch_bytes", 8 << 20),
            group=group,
        )
        out["digests"] = {name: _digest(t) for name, t in stream}
        out["fetched"], out["received"] = stream.fetched_bytes, stream.received_bytes
        if plan.get("connections"):  # every peer's sockets still open while each looks
            group.gather(None)
            out["pid"], out["connections"] = os.getpid(), tcp_connections()
            group.gather(None)
    except Exception as e:  # what the user sees, recorded for the test to check
        out["error"] = str(e)
        out["type"] = [c.__name__ for c in type(e).__mro__]
    (Path(root) / f"peer{index}.json").write_text(json.dumps(out))
    os._exit(0)  # no teardown of a group whose peers may be gone


def _run(tmp: Path, plan: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Every peer of ``plan`` in its own process; what each wrote (``None``: it died)."""
    n = len(plan["peers"])
    context = mp.spawn(_peer, args=(str(tmp), plan), nprocs=n, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for process in context.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            assert not process.is_alive(), "a peer still waits"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    out = []
    for i in range(n):
        path = tmp / f"peer{i}.json"
        out.append(json.loads(path.read_text()) if path.exists() else None)
    return out


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory):
    """The S3 server with a checkpoint (several shards) and a second revision of it, and the digests
    of every stored tensor of the first."""
    pytest.importorskip("transformers")
    from tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("share")
    (root / "s3").mkdir()
    s3 = S3Server(root / "s3")
    s3.bucket("models")
    one = make_checkpoint(root / "one", "LlamaForCausalLM", max_shard_size="12MB", **CONFIG)
    two = make_checkpoint(root / "two", "LlamaForCausalLM", seed=1, max_shard_size="12MB", **CONFIG)
    shards = sorted(one.glob("*.safetensors"))
    assert len(shards) > 1
    expected, data = {}, 0
    for shard in shards:
        tensors = fastload.load_file(shard)
        expected.update({k: _digest(v) for k, v in tensors.items()})
        data += sum(v.numel() * v.element_size() for v in tensors.values())
    urls = {"one": s3.place(one, "models", "llama"), "two": s3.place(two, "models", "llama-v2")}
    yield s3, urls, expected, data
    s3.stop()


@contextmanager
def _proxies(s3: S3Server, n: int) -> Iterator[list[FaultProxy]]:
    """``n`` counting proxies in front of the store, one per peer, closed after."""
    proxies = [FaultProxy(s3.port) for _ in range(n)]
    try:
        yield proxies
    finally:
        for p in proxies:
            p.close()


def _plan(urls: list[str], proxies: list[FaultProxy], peers: list[int], **extra: Any):
    return {
        "port": free_port(),
        "key": "s3://models/llama/",
        "peers": [
            {"url": u, "endpoint": p.endpoint, "peers": n}
            for u, p, n in zip(urls, proxies, peers, strict=True)
        ],
        **extra,
    }


@pytest.mark.parametrize("n", [2, 3])
def test_each_peer_fetches_about_its_share_and_gets_every_tensor_as_stored(
    bucket, tmp_path: Path, n: int
) -> None:
    s3, urls, expected, size = bucket
    with _proxies(s3, n) as proxies:
        plan = _plan([urls["one"]] * n, proxies, [n] * n)
        # one peer's model leaves a tensor out (vLLM's skip): it still fetches its share of it
        skipped = "model.layers.0.mlp.up_proj.weight"
        plan["peers"][0]["skip"] = [skipped]
        got = _run(tmp_path, plan)
        sent = [p.sent for p in proxies]
    assert all(g is not None and "error" not in g for g in got), got
    assert sorted(g["rank"] for g in got) == list(range(n))  # type: ignore[index]
    for i, g in enumerate(got):
        assert g is not None
        wanted = {k: v for k, v in expected.items() if not (i == 0 and k == skipped)}
        assert g["digests"] == wanted
        # every tensor byte fetched by this peer or received from the others
        assert g["fetched"] + g["received"] == size
        # what it says it fetched is what the store sent it (counted at its proxy), less the
        # shards' headers and the HTTP headers of its requests
        assert g["fetched"] <= sent[i] < g["fetched"] + (1 << 20), (g, sent)
    # the tensors fetched once in all, each peer about 1/N of them (chunks of at most 16 MiB,
    # dealt by bytes); counted outside fastload, each peer's share plus the shards' headers
    # (the open reads each file's length, then exactly its header) and its requests' HTTP
    # headers
    assert sum(g["fetched"] for g in got) == size  # type: ignore[index]
    for share in sent:
        assert share < size / n + (2 << 20), (sent, size)
    assert sum(sent) < size + n * (1 << 20), (sent, size)


def test_a_peer_expecting_another_number_of_peers_stops_every_peer_at_once(
    bucket, tmp_path: Path
) -> None:
    s3, urls, _, _ = bucket
    with _proxies(s3, 2) as proxies:
        # peers that waited for the others would wait past the harness' deadline (a hang)
        got = _run(tmp_path, _plan([urls["one"]] * 2, proxies, [2, 3], timeout=HANG_S))
    for g in got:
        assert g is not None and "RequestError" in g["type"], got
        assert "disagree on their number" in g["error"] and "2" in g["error"], g


def test_peers_that_never_come_stop_the_one_waiting_after_its_timeout(
    bucket, tmp_path: Path
) -> None:
    s3, urls, _, _ = bucket
    proxy = FaultProxy(s3.port)
    try:
        [got] = _run(tmp_path, _plan([urls["one"]], [proxy], [3], timeout=3.0))
    finally:
        proxy.close()
    assert got is not None and "FastloadIOError" in got["type"], got
    assert "1 of 3 peers joined the rendezvous" in got["error"], got
    assert proxy.sent == 0  # nothing fetched before every peer came


def test_a_peer_with_another_revision_stops_every_peer_before_any_tensor_byte(
    bucket, tmp_path: Path
) -> None:
    s3, urls, _, size = bucket
    with _proxies(s3, 2) as proxies:
        got = _run(tmp_path, _plan([urls["one"], urls["two"]], proxies, [2, 2]))
        sent = [p.sent for p in proxies]
    for g in got:
        assert g is not None and "CheckpointError" in g["type"], got
        assert "version-mismatch" in g["error"], g
        assert urls["one"] in g["error"] and urls["two"] in g["error"], g
    assert max(sent) < 0.05 * size, sent  # headers and the index only


def test_a_peer_killed_mid_fetch_stops_the_others_at_once(bucket, tmp_path: Path) -> None:
    s3, urls, _, _ = bucket
    with _proxies(s3, 2) as proxies:
        # a survivor that waited for its group's timeout would outlive the harness' deadline
        plan = _plan([urls["one"]] * 2, proxies, [2, 2], timeout=HANG_S)
        plan["peers"][1]["die"] = True
        survivor, killed = _run(tmp_path, plan)
    assert killed is None
    assert survivor is not None and "FastloadIOError" in survivor["type"], survivor
    assert "rank-lost" in survivor["error"], survivor


def test_the_share_fetch_options_are_checked_where_they_enter() -> None:
    from fastload import RequestError
    from fastload.integrations.vllm.options import parse_options

    url = "s3://models/llama/"
    good = parse_options(
        {"weights": url, "share_fetch": "world", "share_fetch_address": "[::1]:29700",
         "share_fetch_peers": 8, "share_fetch_timeout": 30, "share_fetch_node": "rack1-n3"}
    )  # fmt: skip
    assert (good.share_fetch, good.share_fetch_peers, good.share_fetch_timeout) == ("world", 8, 30)
    for bad, says in [
        ({"share_fetch": "node"}, "set 'weights'"),
        ({"weights": url, "share_fetch": "cluster"}, "'node' or 'world'"),
        ({"weights": url, "share_fetch": True}, "'node' or 'world'"),
        ({"weights": url, "share_fetch_peers": 2}, "applies to 'share_fetch', which is not set"),
        ({"weights": url, "share_fetch": "node", "share_fetch_peers": 0}, "positive integer"),
        ({"weights": url, "share_fetch": "node", "share_fetch_peers": True}, "positive integer"),
        ({"weights": url, "share_fetch": "node", "share_fetch_address": "host"}, "'host:port'"),
        ({"weights": url, "share_fetch": "node", "share_fetch_address": "h:99999"}, "1 to 65535"),
        ({"weights": url, "share_fetch": "node", "share_fetch_timeout": -1}, "positive number"),
        ({"weights": url, "share_fetch": "world", "share_fetch_node": ""}, "non-empty string"),
    ]:
        with pytest.raises(RequestError, match=re.escape(says)):
            parse_options(bad)


def test_peers_on_two_machines_send_each_chunk_across_once(bucket, tmp_path: Path) -> None:
    # four peers, two on each of two machines (named by share_fetch_node): the two-tier exchange
    # sends each chunk to the other machine once, where a flat one sends it to both peers there
    s3, urls, expected, size = bucket
    with _proxies(s3, 4) as proxies:
        plan = _plan([urls["one"]] * 4, proxies, [4] * 4, connections=True)
        for peer, node in zip(plan["peers"], "aabb", strict=True):
            peer["node"] = node
        got = _run(tmp_path, plan)
        sent = [p.sent for p in proxies]
    assert all(g is not None and "error" not in g for g in got), got
    assert all(g["digests"] == expected for g in got)  # type: ignore[index]
    assert sum(g["fetched"] for g in got) == size  # type: ignore[index]
    assert max(sent) < size / 4 + (2 << 20), sent
    # counted by the kernel at each peer's TCP sockets: the bytes each received from a peer of
    # the other machine (its connection's far end, a port another peer holds)
    node_of_pid = {g["pid"]: n for g, n in zip(got, "aabb", strict=True)}  # type: ignore[index]
    owner = {local: g["pid"] for g in got for local, _, _ in g["connections"]}  # type: ignore[index]
    across = 0
    for g in got:
        for _, remote, received in g["connections"]:  # type: ignore[index]
            if remote in owner and node_of_pid[owner[remote]] != node_of_pid[g["pid"]]:  # type: ignore[index]
                across += received
    # once per chunk to the other machine: the checkpoint once (each machine receives the other's
    # half), plus the small exchanges (versions, statuses); flat, it would be twice that
    assert 0.9 * size < across < 1.2 * size, (across, size)
