"""Reliability, fifth round (issue 67): the attacks that failed, each now a regression test.

Multi-process tests run their ranks (gloo, loopback) or share_fetch peers in processes of their
own, each writing what it saw (its error's class lineage and message) to a JSON file; the harness
waits for every file, then kills whatever is left. A peer that hung would miss the harness'
deadline (:data:`DEADLINE_S`), which only a hang reaches: the process groups' own timeouts
(:data:`HANG_S`) are longer still, so no test passes by a timeout's error, and none asserts on
speed."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from http_store import HttpStore
from spawn_ranks import free_port
from torch import nn

import fastload
from fastload.core.basics.errors import (
    FastloadError,
    FastloadIOError,
    RequestError,
    UnsupportedError,
)

#: the harness' deadline for every process of a test to report: reached only by a hang
DEADLINE_S = 600
#: the process groups' and rendezvous' timeouts where a test shows that nobody waits for them
HANG_S = 3600.0


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))


def _outcome(error: BaseException | None, **more: Any) -> dict[str, Any]:
    if error is None:
        return {"error": None, **more}
    return {"error": str(error), "type": [c.__name__ for c in type(error).__mro__], **more}


def _spawn(target: Any, args: tuple[Any, ...], n: int, root: Path) -> list[dict[str, Any]]:
    """``n`` processes of ``target(index, *args)``; what each wrote to ``root/out<i>.json``.
    Every process is killed once all have written (or at the deadline: a hang, failing the
    test)."""
    context = mp.spawn(target, args=args, nprocs=n, join=False)
    paths = [root / f"out{i}.json" for i in range(n)]
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not all(p.exists() for p in paths):
            dead = [p for p, proc in zip(paths, context.processes, strict=True)
                    if not proc.is_alive() and not p.exists()]  # fmt: skip
            assert not dead, f"a process died without reporting: {dead}"
            assert time.monotonic() < deadline, "a process still waits (a hang)"
            time.sleep(0.2)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(30)
    return [json.loads(p.read_text()) for p in paths]


def _report(root: str, index: int, out: dict[str, Any], *, wait: bool = True) -> None:
    """Writes a process's outcome atomically, then waits for the harness to kill it (``wait``:
    a gloo group is never torn down under a peer still using it) or ends it at once, with
    nothing torn down."""
    path = Path(root) / f"out{index}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.rename(path)
    while wait:
        time.sleep(60)
    os._exit(0)


def _init_ranks(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(GLOO_SOCKET_IFNAME="lo", FASTLOAD_DISABLE_PROGRESS_BARS="1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=HANG_S),
    )


# -- 1. a URL's secrets in the error of a config naming no class --------------------------------


@pytest.fixture
def served(tmp_path: Path):
    """Checkpoints whose config.json names no class, or an unknown one, served over HTTP."""
    pytest.importorskip("transformers")
    configs = {"none": {"model_type": "bert"}, "unknown": {"architectures": ["Nope"]}}
    for name, config in configs.items():
        fastload.save_pretrained(_model(), tmp_path / "store" / name)
        (tmp_path / "store" / name / "config.json").write_text(json.dumps(config))
    store = HttpStore(tmp_path / "store")
    yield store
    store.close()


@pytest.mark.parametrize("name", ["none", "unknown"])
def test_a_config_naming_no_known_class_at_a_url_never_shows_its_password_or_query(
    served: HttpStore, name: str
) -> None:
    url = served.url(f"{name}/", user_info="user:PASSWORD", query="sig=SIGSECRET")
    with pytest.raises(FastloadError) as caught:
        fastload.from_pretrained(url, progress=False)
    text = str(caught.value)
    assert "architectures" in text, text  # the error is the one about the class
    assert "PASSWORD" not in text and "SIGSECRET" not in text, text
    assert "http://<credentials hidden>@127.0.0.1:" in text, text


def test_a_message_redacted_twice_reads_as_redacted_once() -> None:
    from fastload.core.basics.redaction import redact

    for text in [
        "'http://h/k?sig=S'",
        "(http://u:p@h/k?a=1&sig=S)",
        "http://h/k?sig=S: not found",
        '{"url": "s3://b/k?X-Amz-Signature=S"}',
    ]:
        once = redact(text)
        assert "sig=S" not in once and "Signature=S" not in once, once
        assert redact(once) == once, (text, once, redact(once))
    # a query that only begins like the placeholder is redacted by the one rule, as before
    from fastload import _core

    text = "http://h/k?<query hidden>&sig=SECRET"
    assert redact(text) == _core.redact_urls(text)


# -- 2, 5. a collective load_into checks its destinations as one process does -------------------


def _load_into_rank(rank: int, world: int, port: int, root: str, case: str) -> None:
    _init_ranks(rank, world, port)
    path = Path(root) / "w.safetensors"
    if case == "int32":
        dest = torch.zeros(8, 8, dtype=torch.int32)
    else:  # the wrong size on rank 1 only
        dest = torch.zeros(7 if rank == 1 else 8, 8)
    error = None
    try:
        import torch.distributed as dist

        with fastload.safe_open(path, process_group=dist.group.WORLD) as f:
            f.load_into({"w": dest})
    except Exception as e:
        error = e
    _report(root, rank, _outcome(error, sum=float(dest.double().sum())))


def _load_into_case(tmp_path: Path, case: str) -> list[dict[str, Any]]:
    fastload.save_file({"w": torch.full((8, 8), 2.75)}, tmp_path / "w.safetensors")
    return _spawn(_load_into_rank, (2, free_port(), str(tmp_path), case), 2, tmp_path)


def test_a_collective_load_into_refuses_to_truncate_floats_into_int32_as_one_process_does(
    tmp_path: Path,
) -> None:
    single = torch.zeros(8, 8, dtype=torch.int32)
    fastload.save_file({"w": torch.full((8, 8), 2.75)}, tmp_path / "one.safetensors")
    with (
        fastload.safe_open(tmp_path / "one.safetensors") as f,
        pytest.raises(UnsupportedError, match=r"\[unsupported-conversion\] tensor 'w'"),
    ):
        f.load_into({"w": single})
    for got in _load_into_case(tmp_path, "int32"):
        assert got["error"] is not None, got  # before: silently 2 in every element
        assert "UnsupportedError" in got["type"], got
        assert "[unsupported-conversion] tensor 'w'" in got["error"], got
        assert "w.safetensors" in got["error"] and got["sum"] == 0, got


def test_a_wrong_size_destination_on_one_rank_is_the_destination_size_error_on_every_rank(
    tmp_path: Path,
) -> None:
    zero, one = _load_into_case(tmp_path, "size")
    for got in (zero, one):
        assert got["error"] is not None and "RequestError" in got["type"], got
        assert "[destination-size] tensor 'w'" in got["error"], got
        assert "w.safetensors" in got["error"], got
    assert "rank-lost" not in zero["error"] and "rank 1" in zero["error"], zero
    assert "destination has 224 bytes, expected 256" in one["error"], one


# -- 4. a failure before the ranks open the checkpoint reaches every rank -----------------------


def _no_class_rank(rank: int, world: int, port: int, root: str) -> None:
    _init_ranks(rank, world, port)
    import torch.distributed as dist

    error = None
    try:
        fastload.from_pretrained(
            Path(root) / f"rank{rank}", process_group=dist.group.WORLD, progress=False
        )
    except Exception as e:
        error = e
    _report(root, rank, _outcome(error))


def test_one_rank_failing_before_the_checkpoint_is_opened_stops_every_rank_naming_its_cause(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    from tiny_models import make_checkpoint

    for rank in range(2):
        make_checkpoint(tmp_path / f"rank{rank}", "BertModel")
    config = tmp_path / "rank1" / "config.json"
    data = json.loads(config.read_text())
    del data["architectures"]
    config.write_text(json.dumps(data))
    got = _spawn(_no_class_rank, (2, free_port(), str(tmp_path)), 2, tmp_path)
    for outcome in got:
        assert outcome["error"] is not None and "CheckpointError" in outcome["type"], outcome
        assert "rank 1" in outcome["error"], outcome
        assert "no 'architectures' entry" in outcome["error"], outcome
        assert "rank-lost" not in outcome["error"], outcome


# -- 8. ranks given checkpoints of different file counts ----------------------------------------


def _file_count_rank(rank: int, world: int, port: int, root: str, urls: list[str]) -> None:
    _init_ranks(rank, world, port)
    import torch.distributed as dist

    error = None
    try:
        fastload.from_pretrained(_model, urls[rank], process_group=dist.group.WORLD, progress=False)
    except Exception as e:
        error = e
    _report(root, rank, _outcome(error))


def test_ranks_given_checkpoints_of_different_file_counts_are_told_which_rank_read_what(
    tmp_path: Path,
) -> None:
    fastload.save_pretrained(_model(), tmp_path / "store" / "sharded", max_shard_size="5KB")
    shards = sorted((tmp_path / "store" / "sharded").glob("*.safetensors"))
    assert len(shards) > 1
    store = HttpStore(tmp_path / "store")
    try:
        urls = [store.url("sharded/"), store.url(f"sharded/{shards[0].name}")]
        got = _spawn(_file_count_rank, (2, free_port(), str(tmp_path), urls), 2, tmp_path)
    finally:
        store.close()
    for outcome in got:
        assert outcome["error"] is not None and "CheckpointError" in outcome["type"], outcome
        assert "[version-mismatch]" in outcome["error"], outcome
        assert "rank 0" in outcome["error"] and "rank 1" in outcome["error"], outcome
        assert shards[-1].name in outcome["error"], outcome  # rank 0's files, named


# -- 3, 6, 7. share_fetch's rendezvous ----------------------------------------------------------


def test_a_rendezvous_port_held_by_another_program_fails_naming_the_port() -> None:
    from fastload.distributed.rendezvous import Rendezvous, join

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # takes every connection, never answers
        listener.settimeout(0.5)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    got: list[BaseException] = []

    def joining() -> None:
        try:
            join(Rendezvous("127.0.0.1", port, 2, timeout=2.0), "node")
        except BaseException as e:
            got.append(e)

    joiner = threading.Thread(target=joining, daemon=True)  # before the fix: waits forever
    joiner.start()
    try:
        joiner.join(DEADLINE_S)
        assert not joiner.is_alive(), "the rendezvous still waits on the port's program"
    finally:
        stop.set()
        acceptor.join(10)
        for s in (*held, listener):
            s.close()
    [error] = got
    assert isinstance(error, FastloadIOError), error
    assert f"port {port}" in str(error) and "2 s" in str(error), error


def _peer(index: int, root: str, port: int, plans: list[dict[str, Any]]) -> None:
    """A share_fetch peer: joins the rendezvous as its plan says, reports what it got."""
    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    from fastload.distributed.rendezvous import Rendezvous, join

    plan = plans[index]
    if plan.get("after"):  # joins once the peer serving the rendezvous listens
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
    error, rank = None, None
    try:
        rdv = Rendezvous("127.0.0.1", port, plan["peers"], plan["timeout"])
        given = {"source": plan["source"]} if "source" in plan else {}
        group = join(rdv, "node", **given)
        rank = group.rank
    except Exception as e:
        error = e
    # gone at once, as a peer that gave up exits (the rendezvous it served with it)
    _report(root, index, _outcome(error, rank=rank), wait=False)


def test_peers_given_different_urls_all_stop_at_once_with_a_version_mismatch(
    tmp_path: Path,
) -> None:
    urls = ["s3://models/llama/", "s3://models/llama-v2/"]
    plans = [{"peers": 2, "timeout": HANG_S, "source": u} for u in urls]
    got = _spawn(_peer, (str(tmp_path), free_port(), plans), 2, tmp_path)
    for outcome in got:
        assert outcome["error"] is not None and "CheckpointError" in outcome["type"], outcome
        assert "[version-mismatch]" in outcome["error"], outcome
        assert urls[0] in outcome["error"] and urls[1] in outcome["error"], outcome


def test_a_peer_waiting_when_the_serving_peer_gives_up_is_told_how_many_joined(
    tmp_path: Path,
) -> None:
    # peer 0 serves the rendezvous and gives up after its timeout; peer 1 waits much longer
    plans = [{"peers": 3, "timeout": 30.0}, {"peers": 3, "timeout": HANG_S, "after": True}]
    server, waiting = _spawn(_peer, (str(tmp_path), free_port(), plans), 2, tmp_path)
    assert server["error"] is not None and "2 of 3 peers joined" in server["error"], server
    assert waiting["error"] is not None and "FastloadIOError" in waiting["type"], waiting
    assert "2 of 3 peers joined" in waiting["error"], waiting


def test_a_share_fetch_timeout_too_long_to_wait_is_refused_where_the_options_enter() -> None:
    from fastload.integrations.vllm.options import parse_options

    url = "s3://models/llama/"
    for timeout in (1e15, float("inf"), float("nan")):
        with pytest.raises(RequestError, match="share_fetch_timeout"):
            parse_options({"weights": url, "share_fetch": "node", "share_fetch_timeout": timeout})


# -- 9. a corrupt copy on one rank of a verified reload is named --------------------------------


def _verify_rank(rank: int, world: int, port: int, root: str) -> None:
    _init_ranks(rank, world, port)
    import torch.distributed as dist

    own = Path(root) / f"rank{rank}"
    error = None
    try:
        model = fastload.from_pretrained(
            _model, own / "a", process_group=dist.group.WORLD, progress=False
        )
        fastload.reload(model, own / "b", atomic=True, verify=True, process_group=dist.group.WORLD)
    except Exception as e:
        error = e
    _report(root, rank, _outcome(error))


def test_a_verified_reload_across_ranks_names_the_rank_and_file_whose_copy_is_corrupt(
    tmp_path: Path,
) -> None:
    for rank in range(2):
        fastload.save_pretrained(_model(1), tmp_path / f"rank{rank}" / "a", digests=True)
        fastload.save_pretrained(_model(2), tmp_path / f"rank{rank}" / "b", digests=True)
    corrupt = tmp_path / "rank1" / "b" / "model.safetensors"
    with open(corrupt, "r+b") as f:  # the last byte of the data: in the chunk rank 1 reads
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    got = _spawn(_verify_rank, (2, free_port(), str(tmp_path)), 2, tmp_path)
    intact = str(tmp_path / "rank0" / "b" / "model.safetensors")
    for outcome in got:
        assert outcome["error"] is not None and "CheckpointError" in outcome["type"], outcome
        assert "do not match the digest" in outcome["error"], outcome
        assert f"read by rank 1 from {corrupt}" in outcome["error"], outcome
        assert intact not in outcome["error"], outcome  # before: rank 0 named its own file
    assert got[0]["error"] == got[1]["error"]


# -- 10. the patch's report after a call that raised --------------------------------------------


@pytest.mark.usefixtures("unpatched")
def test_after_a_patched_load_that_raises_last_report_is_none(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tiny_models import make_checkpoint, model_class

    from fastload.hf import patch

    path = make_checkpoint(tmp_path / "bert", "BertForSequenceClassification")
    cls = model_class("BertForSequenceClassification")
    with fastload.patch_transformers():
        cls.from_pretrained(path)
        assert patch.last_report is not None
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            cls.from_pretrained(path, num_labels=5)  # raised after fastload's load was done
        assert patch.last_report is None and patch.last_fallback is None
