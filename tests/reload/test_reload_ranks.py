"""``fastload.reload(..., process_group=pg)``: the ranks of a group reload one checkpoint together,
each reading about 1/N of the changed bytes from storage and receiving the rest; tensors unchanged
by their digests are read by no rank; a rank that refuses stops every rank with one error.

Two gloo ranks on CPU, spawned here (loopback only, bounded by TIMEOUT_S). Storage reads are
measured from outside fastload: each rank reloads from its own copy of the checkpoint, evicted
from the page cache first, and the kernel counts the bytes the process fetched from storage
(``read_bytes`` of ``/proc/self/io``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import free_port, leave_group, run_ranks
from torch import nn

import fastload
from fastload.core.basics import errors
from fastload.core.memory.page_cache import evict

WORLD = 2
TIMEOUT_S = 240
PLAN = {"fc1": "colwise", "fc2": "rowwise"}
#: the reloads each rank makes in turn: (checkpoint, options); "b" changes fc1 only
RELOADS = [("b", {}), ("c", {"atomic": True}), ("a", {"atomic": True, "verify": True})]


class MLP(nn.Module):
    """About 33 MB: fc1 and fc2 of 16 MB each, so page rounding and headers are small beside
    a rank's share."""

    def __init__(self, hidden: int = 4096) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1024, hidden)
        self.fc2 = nn.Linear(hidden, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def _digests(model: nn.Module) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in model.state_dict().items()
    }


def _storage_reads() -> int:
    """Bytes this process has fetched from storage, as the kernel counts them."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _evict(directory: Path) -> None:
    for path in directory.glob("*.safetensors"):
        evict(path)


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S // 2)
    )


def _reload_rank(rank: int, port: int, root: str, tp: bool) -> None:
    """Loads ``a`` (collectively, or tensor-parallel), then reloads each of :data:`RELOADS` with
    the group, measuring this rank's storage reads; under tensor parallelism, a second model
    reloaded alone (without the group) is the reference."""
    _init(rank, port)
    own = Path(root) / f"rank{rank}"
    load: dict[str, Any] = {"tp_plan": PLAN} if tp else {"process_group": dist.group.WORLD}
    out: dict[str, Any] = {}
    try:
        model = fastload.from_pretrained(MLP, own / "a", progress=False, **load)
        alone = fastload.from_pretrained(MLP, own / "a", progress=False, **load) if tp else None
        ptrs = {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}
        for name, options in RELOADS:
            _evict(own / name)
            dist.barrier()  # every copy is evicted before any rank reads
            before = _storage_reads()
            report = fastload.reload(model, own / name, process_group=dist.group.WORLD, **options)
            storage = _storage_reads() - before
            out[name] = {
                "storage": storage,
                "digests": _digests(model),
                "read": [report.tensors_read, report.bytes_read],
                "unchanged": [report.tensors_unchanged, report.bytes_unchanged],
                "verified": report.tensors_verified,
            }
            if alone is not None:
                fastload.reload(alone, own / name, **options)
                out[name]["alone"] = _digests(alone)
        out["same_memory"] = ptrs == {
            n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()
        }
    finally:
        torch.save(out, Path(root) / f"out{rank}.pt")
        leave_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``a``; ``b``: ``a`` with fc1 changed; ``c``: all new; ``wrong``: fc1 of another shape;
    ``other``: ``c``'s layout, other values; ``sharded``: ``c`` in two files. All with digests."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    root = tmp_path_factory.mktemp("reload_ranks")
    torch.manual_seed(1)
    a = MLP()
    fastload.save_pretrained(a, root / "a", digests=True)
    torch.manual_seed(2)
    b = MLP()
    b.fc2.load_state_dict(a.fc2.state_dict())
    fastload.save_pretrained(b, root / "b", digests=True)
    for seed, name, model in ((3, "c", MLP), (4, "other", MLP), (5, "wrong", lambda: MLP(2048))):
        torch.manual_seed(seed)
        fastload.save_pretrained(model(), root / name, digests=True)
    c = fastload.load_file(root / "c" / "model.safetensors")
    model = MLP()
    model.load_state_dict(c)
    fastload.save_pretrained(model, root / "sharded", digests=True, max_shard_size="20MB")
    return root


def _copies(checkpoints: Path, tmp: Path) -> None:
    for rank in range(WORLD):
        shutil.copytree(checkpoints, tmp / f"rank{rank}")


def _sizes(checkpoints: Path) -> tuple[int, int]:
    """Bytes of every tensor, and of fc1's (what ``b`` changes)."""
    state = MLP().state_dict()
    total = sum(t.nbytes for t in state.values())
    return total, state["fc1.weight"].nbytes + state["fc1.bias"].nbytes


def _single_process(checkpoints: Path) -> dict[str, dict[str, str]]:
    """The model's tensors after each reload of :data:`RELOADS` on one process."""
    model = fastload.from_pretrained(MLP, checkpoints / "a", progress=False)
    out = {}
    for name, options in RELOADS:
        fastload.reload(model, checkpoints / name, **options)
        out[name] = _digests(model)
    return out


def _run(checkpoints: Path, tmp: Path, tp: bool) -> list[dict[str, Any]]:
    _copies(checkpoints, tmp)
    run_ranks(_reload_rank, (free_port(), str(tmp), tp), world=WORLD, timeout_s=TIMEOUT_S,
              what="reload")  # fmt: skip
    return [torch.load(tmp / f"out{r}.pt", weights_only=True) for r in range(WORLD)]


def _assert_shares(ranks: list[dict[str, Any]], total: int, fc1: int) -> None:
    """Each rank read about 1/N of the bytes that changed, and the unchanged fc2 no rank."""
    slack = 2 << 20  # headers, page rounding, the kernel's read-ahead around them
    for rank, got in enumerate(ranks):
        assert abs(got["b"]["storage"] - fc1 / WORLD) <= slack, (rank, got["b"]["storage"])
        assert got["b"]["unchanged"][0] == 2, got["b"]["unchanged"]  # fc2.weight and fc2.bias
        for name in ("c", "a"):
            assert abs(got[name]["storage"] - total / WORLD) <= slack, (rank, name, got[name])
    # fc2 (16 MB) read by any rank would show here
    assert sum(got["b"]["storage"] for got in ranks) <= fc1 + WORLD * slack


def test_ranks_of_a_collective_load_reload_together_each_reading_its_share(
    checkpoints: Path, tmp_path: Path
) -> None:
    total, fc1 = _sizes(checkpoints)
    ranks = _run(checkpoints, tmp_path, tp=False)
    expected = _single_process(checkpoints)
    for rank, got in enumerate(ranks):
        assert got["same_memory"], rank
        for name, _ in RELOADS:
            assert got[name]["digests"] == expected[name], (rank, name)
        assert got["a"]["verified"] == 4
    _assert_shares(ranks, total, fc1)


def test_tensor_parallel_ranks_reload_together_and_keep_their_slices(
    checkpoints: Path, tmp_path: Path
) -> None:
    total, fc1 = _sizes(checkpoints)
    ranks = _run(checkpoints, tmp_path, tp=True)
    for rank, got in enumerate(ranks):
        assert got["same_memory"], rank
        for name, _ in RELOADS:
            # what each rank holds is what it gets reloading alone, bitwise
            assert got[name]["digests"] == got[name]["alone"], (rank, name)
        assert got["a"]["verified"] == 4
    # the slices differ between the ranks, the replicated fc2.bias does not
    assert ranks[0]["c"]["digests"]["fc1.weight"] != ranks[1]["c"]["digests"]["fc1.weight"]
    assert ranks[0]["c"]["digests"]["fc2.bias"] == ranks[1]["c"]["digests"]["fc2.bias"]
    _assert_shares(ranks, total, fc1)


#: (what rank 1 is given instead of "c", its options): each must stop both ranks
MISMATCHES = [
    ("wrong", {}),  # a checkpoint that does not fit rank 1's model
    ("other", {}),  # the same layout, other values (their digests differ)
    ("missing", {}),  # nothing there
    ("c", {"atomic": True}),  # other options
    ("sharded", {}),  # the tensors of "c" in two files: another layout, the same digests
]


def _flip_last_byte(path: Path) -> str:
    """Inverts the last byte of the file's data (in the last chunk, which the last rank reads);
    returns the tensor it belongs to."""
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        name = max(header, key=lambda k: header[k]["data_offsets"][1])
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    return name


def _mismatch_rank(rank: int, port: int, root: str) -> None:
    _init(rank, port)
    own = Path(root) / f"rank{rank}"
    out: dict[str, Any] = {"errors": []}
    try:
        model = fastload.from_pretrained(
            MLP, own / "a", process_group=dist.group.WORLD, progress=False
        )
        old = _digests(model)
        for name, options in MISMATCHES:
            source, given = (own / name, options) if rank == 1 else (own / "c", {})
            try:
                fastload.reload(model, source, process_group=dist.group.WORLD, **given)
                out["errors"].append(None)
            except fastload.FastloadError as exc:
                out["errors"].append((type(exc).__name__, str(exc)))
            out.setdefault("unchanged", []).append(_digests(model) == old)
        # rank 1's copy is corrupt where rank 1 reads for the group: both ranks check the
        # bytes exchanged, so both refuse
        try:
            fastload.reload(
                model, own / "corrupt", atomic=True, verify=True, process_group=dist.group.WORLD
            )
            out["corrupt"] = None
        except fastload.CheckpointError as exc:
            out["corrupt"] = str(exc)
        out["corrupt unchanged"] = _digests(model) == old
        # rank 1 reloads alone: its model's digests now differ from rank 0's, and the ranks
        # would skip other tensors of "b"
        if rank == 1:
            fastload.reload(model, own / "b")
        try:
            fastload.reload(model, own / "b", process_group=dist.group.WORLD)
            out["skips"] = None
        except fastload.FastloadError as exc:
            out["skips"] = (type(exc).__name__, str(exc))
        # the group is still in step: a reload every rank agrees on goes through
        fastload.reload(model, own / "c", process_group=dist.group.WORLD)
        out["after"] = _digests(model)
    finally:
        torch.save(out, Path(root) / f"out{rank}.pt")
        leave_group()


def test_one_rank_given_another_checkpoint_stops_every_rank_with_one_error(
    checkpoints: Path, tmp_path: Path
) -> None:
    _copies(checkpoints, tmp_path)
    for rank in range(WORLD):
        shutil.copytree(checkpoints / "c", tmp_path / f"rank{rank}" / "corrupt")
    last = _flip_last_byte(tmp_path / "rank1" / "corrupt" / "model.safetensors")
    run_ranks(_mismatch_rank, (free_port(), str(tmp_path)), world=WORLD, timeout_s=TIMEOUT_S,
              what="mismatch")  # fmt: skip
    ranks = [torch.load(tmp_path / f"out{r}.pt", weights_only=True) for r in range(WORLD)]
    c = fastload.from_pretrained(MLP, checkpoints / "c", progress=False)
    for rank, got in enumerate(ranks):
        assert got["unchanged"] == [True] * len(MISMATCHES), rank
        assert got["after"] == _digests(c), rank
    wrong, other, missing, options, sharded = zip(*(got["errors"] for got in ranks), strict=True)
    for both in (wrong, other, missing, options, sharded):
        assert both[0] == both[1], both  # one error: the same class and message on both
    assert wrong[0][0] == "ModelMismatchError"
    assert "rank 1 of 2 failed" in wrong[0][1] and "'fc1.weight'" in wrong[0][1]
    assert str(tmp_path / "rank1" / "wrong") in wrong[0][1]
    assert other[0][0] == "CheckpointError"
    assert "checkpoint of rank 1 records other digests than rank 0's" in other[0][1]
    assert issubclass(getattr(errors, missing[0][0]), OSError), missing[0]
    assert "rank 1 of 2 failed" in missing[0][1] and "missing" in missing[0][1]
    assert options[0][0] == "RequestError" and "rank 1 passed other options" in options[0][1]
    assert sharded[0][0] == "CheckpointError"
    assert "ranks opened different checkpoints" in sharded[0][1]
    assert str(tmp_path / "rank1" / "sharded") in sharded[0][1]
    for got in ranks:
        assert "do not match the digest" in got["corrupt"] and repr(last) in got["corrupt"]
        assert got["corrupt unchanged"]
    assert ranks[0]["skips"] == ranks[1]["skips"]
    assert ranks[0]["skips"][0] == "CheckpointError"
    # rank 0 reads fc1 (changed since "a"), rank 1 nothing ("b" is what it holds)
    assert "rank 1 would read other tensors than rank 0" in ranks[0]["skips"][1]
    assert "only rank 0: fc1.bias, fc1.weight)" in ranks[0]["skips"][1]
    assert all("Nothing was written on any rank" in e[1] or "nothing was written" in e[1]
               for e in (wrong[0], other[0], missing[0], options[0], sharded[0]))  # fmt: skip


def test_a_process_group_without_torch_distributed_is_refused() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process has torch.distributed initialized")
    model = nn.Linear(2, 2)
    with pytest.raises(fastload.RequestError, match="init_process_group"):
        fastload.reload(model, {"weight": torch.zeros(2, 2)}, process_group=object())


def _dies_rank(rank: int, port: int, root: str) -> None:
    """Rank 1 dies as it reads its first chunk; rank 0 must stop (not wait) and mark its model."""
    from fastload.distributed import file_reads

    _init(rank, port)
    own = Path(root) / f"rank{rank}"
    model = fastload.from_pretrained(MLP, own / "a", process_group=dist.group.WORLD, progress=False)
    if rank == 1:
        file_reads.FileReader._read = lambda *a: os._exit(0)  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        fastload.reload(model, own / "c", process_group=dist.group.WORLD)
    except fastload.ReloadError as exc:
        out["error"] = str(exc)
        try:
            model(torch.ones(1, 1024))
        except fastload.ReloadError as refused:
            out["refused"] = str(refused)
    torch.save(out, Path(root) / f"out{rank}.pt")
    os._exit(0)  # the group lost a rank: tearing it down could abort this process


def test_a_rank_dying_while_the_group_reads_stops_the_others_with_their_model_marked(
    checkpoints: Path, tmp_path: Path
) -> None:
    _copies(checkpoints, tmp_path)
    run_ranks(_dies_rank, (free_port(), str(tmp_path)), world=WORLD, timeout_s=TIMEOUT_S,
              what="dying")  # fmt: skip
    got = torch.load(tmp_path / "out0.pt", weights_only=True)
    assert "fastload.reload failed while reading" in got["error"], got
    assert "fc1.weight" in got["error"]
    assert "refuses to run" in got["refused"]


def _url_rank(rank: int, port: int, root: str) -> None:
    """Each rank serves its own copy over HTTP: rank 1 alone given the URL, then both."""
    from http_store import HttpStore

    _init(rank, port)
    own = Path(root) / f"rank{rank}"
    store = HttpStore(own)
    url = store.url("c/model.safetensors")
    out: dict[str, Any] = {}
    try:
        model = fastload.from_pretrained(
            MLP, own / "a", process_group=dist.group.WORLD, progress=False
        )
        for name, source in (("mixed", url if rank == 1 else own / "c"), ("urls", url)):
            try:
                fastload.reload(model, source, process_group=dist.group.WORLD)
                out[name] = None
            except fastload.FastloadError as exc:
                out[name] = (type(exc).__name__, str(exc))
            with torch.no_grad():
                model(torch.ones(1, 1024))  # not marked torn
            out[f"{name} digests"] = _digests(model)
    finally:
        torch.save(out, Path(root) / f"out{rank}.pt")
        leave_group()
        store.close()


def test_ranks_reload_from_urls_together_and_a_url_beside_local_files_is_refused(
    checkpoints: Path, tmp_path: Path
) -> None:
    _copies(checkpoints, tmp_path)
    run_ranks(_url_rank, (free_port(), str(tmp_path)), world=WORLD, timeout_s=TIMEOUT_S,
              what="url")  # fmt: skip
    ranks = [torch.load(tmp_path / f"out{r}.pt", weights_only=True) for r in range(WORLD)]
    a = _digests(fastload.from_pretrained(MLP, checkpoints / "a", progress=False))
    c = _digests(fastload.from_pretrained(MLP, checkpoints / "c", progress=False))
    assert ranks[0]["mixed"] == ranks[1]["mixed"]
    assert ranks[0]["mixed"][0] == "CheckpointError"
    assert "rank 1 reads an object storage URL, rank 0 local files" in ranks[0]["mixed"][1]
    assert all(got["mixed digests"] == a for got in ranks)
    # a URL on every rank (each its own server): read together, bitwise those of "c"
    assert [got["urls"] for got in ranks] == [None, None]
    assert all(got["urls digests"] == c for got in ranks)


def _failing_read_rank(rank: int, port: int, root: str) -> None:
    """Rank 1's disk fails under its chunks (it lives on): atomic, then in place."""
    from fastload.distributed import file_reads

    _init(rank, port)
    own = Path(root) / f"rank{rank}"
    out: dict[str, Any] = {}
    try:
        model = fastload.from_pretrained(
            MLP, own / "a", process_group=dist.group.WORLD, progress=False
        )
        old = _digests(model)
        if rank == 1:

            def broken(path: str, *args: Any) -> None:
                raise errors.FastloadIOError(f"{path}: reading failed: [Errno 5] I/O error")

            file_reads._pread = broken  # type: ignore[assignment]
        for name, atomic in (("atomic", True), ("in place", False)):
            try:
                fastload.reload(model, own / "c", atomic=atomic, process_group=dist.group.WORLD)
                out[name] = None
            except fastload.FastloadError as exc:
                out[name] = (type(exc).__name__, str(exc))
            out[f"{name} unchanged"] = _digests(model) == old
            try:
                model(torch.ones(1, 1024))
                out[f"{name} runs"] = True
            except fastload.ReloadError:
                out[f"{name} runs"] = False
    finally:
        torch.save(out, Path(root) / f"out{rank}.pt")
        leave_group()


def test_a_read_failing_on_one_rank_stops_every_rank_with_one_error(
    checkpoints: Path, tmp_path: Path
) -> None:
    _copies(checkpoints, tmp_path)
    run_ranks(_failing_read_rank, (free_port(), str(tmp_path)), world=WORLD,
              timeout_s=TIMEOUT_S, what="failing read")  # fmt: skip
    ranks = [torch.load(tmp_path / f"out{r}.pt", weights_only=True) for r in range(WORLD)]
    for got in ranks:
        # atomic: nothing written on any rank, every model runs
        assert got["atomic"][0] == "FastloadIOError", got["atomic"]
        assert "failed on rank 1" in got["atomic"][1] and "I/O error" in got["atomic"][1]
        assert got["atomic unchanged"] and got["atomic runs"]
        # in place: every rank's model marked torn, naming the cause on rank 1
        assert got["in place"][0] == "ReloadError", got["in place"]
        assert "failed on rank 1" in got["in place"][1] and "fc1.weight" in got["in place"][1]
        assert not got["in place runs"]
