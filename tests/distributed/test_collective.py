"""Collective loading over torch.distributed (gloo ranks on this machine's CPU): each rank reads
about 1/N of the checkpoint from storage and ends with the model a single-process load gives.

Storage reads are measured from outside the loader: each rank loads its own copy of the
checkpoint, evicted from the page cache first; the kernel counts the bytes the process fetched
from storage (``read_bytes`` of ``/proc/self/io``), and says afterwards how much of the copy is
in the page cache (``fincore``, i.e. ``mincore``)."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import free_port, leave_group, run_ranks

import fastload
from fastload.core.basics.errors import CheckpointError, RequestError
from fastload.core.memory.page_cache import evict
from fastload.distributed.collective import Chunk, deal, pages, spans

TIMEOUT_S = 300
#: a Llama of about 84 MB in three shards, whose projections 2 and 4 ranks divide
CONFIG = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
}


def _tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in tensors.items()
    }


def _digests(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of each tensor's bytes (a DTensor's: its local shard's)."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.to_local() if hasattr(v, "to_local") else v
        out[k] = hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return {k: h.hexdigest() for k, h in out.items()}


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def _evict(directory: Path) -> None:
    for path in _files(directory):
        evict(path)


def _cached_fraction(directory: Path) -> float:
    """The fraction of the checkpoint's bytes in the page cache, as the kernel reports it."""
    cached = size = 0
    for path in _files(directory):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        cached, size = cached + int(out[0]), size + int(out[1])
    return cached / size


def _storage_reads() -> int:
    """Bytes this process has fetched from storage, as the kernel counts them."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _rank(rank: int, world: int, port: int, root: str, what: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        # transformers' tensor parallelism sizes itself from the environment, as under torchrun
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S // 2)
    )
    import transformers

    # What a load imports lazily is read before any window opens: with the page cache under
    # pressure, a module file read from disk would count as checkpoint bytes.
    llama = transformers.LlamaForCausalLM
    for module in (
        "fastload.api",
        "fastload.hf.front",
        "fastload.hf.dtensor_tp",
        "fastload.distributed.collective",
        "fastload.distributed.tensor_parallel",
        "transformers.integrations.tensor_parallel",
    ):
        importlib.import_module(module)
    own = Path(root) / f"rank{rank}"
    out: dict[str, Any] = {}
    try:
        runs = {
            "full": {"process_group": dist.group.WORLD},
            "tp": {"tp_plan": "llama"},
            "auto": {"tp_plan": "auto"},
        }
        for name in what.split(","):
            _evict(own)
            dist.barrier()  # every copy is evicted before any rank reads
            before = _storage_reads()
            if name == "file":  # load_file of the largest shard
                largest = max(_files(own), key=lambda p: p.stat().st_size)
                tensors = fastload.load_file(largest, process_group=dist.group.WORLD)
                out[name] = {"storage": _storage_reads() - before, "file": largest.name}
                out[name]["digests"] = _tensor_digests(tensors)
                _evict(own)
                dist.barrier()
                before = _storage_reads()
                with fastload.safe_open(largest, process_group=dist.group.WORLD) as f:
                    one_by_one = {k: f.get_tensor(k) for k in f.offset_keys()}
                out[name]["safe_open"] = {
                    "storage": _storage_reads() - before,
                    "digests": _tensor_digests(one_by_one),
                }
                continue
            try:
                model, report = fastload.from_pretrained(
                    llama,
                    own,
                    output_loading_info=True,
                    progress=False,
                    **runs[name],
                )
            except CheckpointError as e:
                out[name] = {"error": str(e)}
                continue
            out[name] = {
                "storage": _storage_reads() - before,
                "cached": _cached_fraction(own),
                "digests": _digests(model),
                "report": [
                    report.rank,
                    report.world_size,
                    report.bytes_read,
                    report.bytes_received,
                ],
            }
            if name == "auto":  # transformers' own tensor-parallel model, to compare with
                out[name]["like_transformers"] = _like_transformers(model, own)
    finally:
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
        leave_group()


def _like_transformers(model: torch.nn.Module, directory: Path) -> bool:
    """Whether ``model`` is what transformers' ``from_pretrained(tp_plan="auto")`` gives on this
    rank: names, DTensor placements and meshes, local shards, forwards (test_dtensor_tp's
    comparison), and the same logits; also under fastload's patch of transformers."""
    import transformers

    hf_tests = str(Path(__file__).resolve().parents[1] / "hf")  # test_dtensor_tp's folder: on a
    sys.path += [] if hf_tests in sys.path else [hf_tests]  # rank's path if tests/hf was collected
    from test_dtensor_tp import _assert_like_transformers
    from tiny_models import example_inputs

    cls = transformers.LlamaForCausalLM
    expected = cls.from_pretrained(directory, tp_plan="auto")
    with fastload.patch_transformers():
        patched = cls.from_pretrained(directory, tp_plan="auto")
    inputs = example_inputs(expected)
    for ours in (model, patched):
        _assert_like_transformers(ours, expected)
        with torch.no_grad():
            assert torch.equal(ours(**inputs).logits, expected(**inputs).logits)
    return True


def _run(tmp: Path, world: int, what: str, *, other: dict[int, Path] | None = None) -> list[dict]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if shutil.which("fincore") is None:
        pytest.skip("fincore (util-linux) is needed to read page-cache residency")
    for rank in range(world):
        shutil.copytree((other or {}).get(rank, tmp / "llama"), tmp / f"rank{rank}")
    run_ranks(_rank, (world, free_port(), str(tmp), what), world=world, timeout_s=TIMEOUT_S,
              what="collective")  # fmt: skip
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The checkpoint (three shards) and the digests of a single-process load of it."""
    transformers = pytest.importorskip("transformers")
    from tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("collective")
    directory = make_checkpoint(root / "llama", "LlamaForCausalLM", max_shard_size="30MB", **CONFIG)
    assert len(_files(directory)) == 3
    single = fastload.from_pretrained(transformers.LlamaForCausalLM, directory, progress=False)
    return directory, _digests(single)


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_about_its_share_and_gets_the_single_process_model(
    llama: tuple[Path, dict[str, str]], tmp_path: Path, world: int
) -> None:
    directory, expected = llama
    shutil.copytree(directory, tmp_path / "llama")
    ranks = _run(tmp_path, world, "full")
    total = sum(p.stat().st_size for p in _files(directory))
    for rank, got in enumerate(ranks):
        run = got["full"]
        assert run["digests"] == expected, rank
        # measured by the kernel: this rank fetched about its share from storage, and its copy
        # is not cached beyond that
        assert abs(run["storage"] - total / world) <= 0.03 * total, (rank, run["storage"])
        assert run["cached"] <= 1 / world + 0.05, (rank, run["cached"])
        r, size, read, received = run["report"]
        assert (r, size) == (rank, world)
        # the report says what happened (the kernel also counts headers and files the process
        # happens to read meanwhile)
        assert abs(read - run["storage"]) <= 0.03 * total
    # every byte was read by exactly one rank: the received bytes are the others' reads
    reads = [got["full"]["report"][2] for got in ranks]
    assert sum(reads) == pytest.approx(total, abs=world * 3 * 8192 + (64 << 10))
    received = [got["full"]["report"][3] for got in ranks]
    assert all(reads[r] + received[r] == pytest.approx(total, abs=1 << 20) for r in range(world))


def test_two_ranks_loading_tensor_parallel_each_read_about_half(
    llama: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    # fastload's own plan (plain local shards) and transformers' call shape (DTensors)
    directory, _ = llama
    shutil.copytree(directory, tmp_path / "llama")
    total = sum(p.stat().st_size for p in _files(directory))
    for rank, got in enumerate(_run(tmp_path, 2, "tp,auto")):
        for name in ("tp", "auto"):
            assert got[name]["storage"] <= 0.55 * total, (rank, name, got[name]["storage"])
            assert got[name]["cached"] <= 0.55, (rank, name, got[name]["cached"])
            assert got[name]["report"][:2] == [rank, 2]
        assert got["auto"]["like_transformers"]


def test_load_file_and_safe_open_with_a_process_group_give_every_rank_every_tensor(
    llama: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    directory, _ = llama
    shutil.copytree(directory, tmp_path / "llama")
    for rank, got in enumerate(_run(tmp_path, 2, "file")):
        path = directory / got["file"]["file"]
        expected = _tensor_digests(load_file(path))
        assert got["file"]["digests"] == expected, rank
        assert got["file"]["storage"] <= 0.55 * path.stat().st_size, rank
        # safe_open(process_group=...).get_tensor: one collective read per tensor
        assert got["file"]["safe_open"]["digests"] == expected, rank
        assert got["file"]["safe_open"]["storage"] <= 0.6 * path.stat().st_size, rank


def test_ranks_with_different_checkpoints_all_refuse_naming_the_files(
    llama: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    from tiny_models import make_checkpoint

    directory, _ = llama
    shutil.copytree(directory, tmp_path / "llama")
    other = make_checkpoint(
        tmp_path / "other", "LlamaForCausalLM", **{**CONFIG, "vocab_size": 8200}
    )
    ranks = _run(tmp_path, 2, "full", other={1: other})
    for got in ranks:
        message = got["full"]["error"]
        assert "ranks opened different checkpoints" in message
        assert str(tmp_path / "rank1") in message


def test_a_process_group_without_torch_distributed_is_refused(
    llama: tuple[Path, dict[str, str]],
) -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process has torch.distributed initialized")
    with pytest.raises(RequestError, match="init_process_group"):
        fastload.from_pretrained(llama[0], process_group=object(), progress=False)


def test_chunks_are_dealt_in_contiguous_balanced_runs_at_page_boundaries() -> None:
    span_list = [(0, 100, 10_000_000), (1, 64, 5_000_064)]
    for world in (1, 2, 3, 4):
        chunks = deal(span_list, world)
        owners = [c.owner for c in chunks]
        assert owners == sorted(owners) and set(owners) == set(range(world))
        covered = {(c.file, c.start, c.stop) for c in chunks}
        assert (
            sum(c.nbytes for c in chunks)
            == 9_999_900 + 5_000_000
            == sum(stop - start for _, start, stop in covered)
        )
        for c in chunks:  # every cut inside a span is on a page boundary
            assert c.stop % 4096 == 0 or (c.file, c.stop) in {(0, 10_000_000), (1, 5_000_064)}
        shares = [sum(c.nbytes for c in chunks if c.owner == r) for r in range(world)]
        assert max(shares) - min(shares) <= 2 * max(c.nbytes for c in chunks)


def test_spans_merge_adjacent_tensors_of_a_file_and_pages_count_whole_pages() -> None:
    class T:
        def __init__(self, file: int, begin: int, nbytes: int) -> None:
            self.file, self.begin, self.nbytes = file, begin, nbytes

    needed = [(T(0, 0, 10), 8), (T(0, 10, 20), 8), (T(0, 100, 4), 8), (T(1, 0, 4), 16)]
    assert spans(needed) == [(0, 8, 38), (0, 108, 112), (1, 16, 20)]  # type: ignore[arg-type]
    assert pages([Chunk(0, 4000, 4200), Chunk(0, 4200, 8193)]) == 3 * 4096


@pytest.mark.parametrize(
    "shape,selection",
    [
        ((64, 48), [0, 16, 48]),  # rows: one range
        ((64, 48), [1, 12, 24]),  # a part of each row
        ((4, 6, 10), [1, 2, 5]),  # a middle dimension
        ((64, 48), [100, 900]),  # a flat range of elements
        ((64, 48), None),  # the whole tensor
    ],
)
def test_the_bytes_a_rank_keeps_of_each_chunk_are_those_of_its_selection(
    shape: tuple[int, ...], selection: list[int] | None
) -> None:
    from fastload.distributed.needs import Routes, need_of, pack, unpack

    # a bf16 tensor at byte 1000 of its file, behind another one the rank does not keep
    tensor = torch.randn(shape).to(torch.bfloat16)
    raw = tensor.view(-1).view(torch.uint8)
    start = 1000
    file = torch.zeros(start + raw.numel() + 500, dtype=torch.uint8)
    file[start : start + raw.numel()] = raw
    routes = Routes(
        [{"t": need_of(shape, "BF16", [selection])}, {}],
        {0: [("t", start, start + raw.numel()), ("u", 0, start)]},
    )
    assert not routes.broadcast(0, 0, file.numel())
    received = torch.zeros(raw.numel(), dtype=torch.uint8)
    # chunks of odd sizes, cut anywhere: the owner packs, the receiver unpacks
    cuts = [0] + [c for c in (700, 1333, 1501, 2100, 4000, 5555) if c < file.numel()]
    cuts.append(file.numel())
    for a, b in zip(cuts, cuts[1:], strict=False):
        assert routes.of(1, 0, a, b) == []  # the other rank keeps nothing
        ranges = routes.of(0, 0, a, b)
        image = torch.zeros(b - a, dtype=torch.uint8)
        unpack(pack(file[a:b], ranges), image, ranges)
        lo, hi = max(a, start), min(b, start + raw.numel())
        if lo < hi:
            received[lo - start : hi - start] = image[lo - a : hi - a]
    got = received.view(torch.bfloat16).view(shape)
    if selection is None:
        want, kept = tensor, got
    elif len(selection) == 2:
        want, kept = (
            tensor.reshape(-1)[selection[0] : selection[1]],
            got.reshape(-1)[selection[0] : selection[1]],
        )
    else:
        dim, a, b = selection
        want, kept = tensor.narrow(dim, a, b - a), got.narrow(dim, a, b - a)
    assert torch.equal(kept, want)
    # and nothing else: the bytes outside the selection were never sent
    sent = sum(
        b - a for x, y in zip(cuts, cuts[1:], strict=False) for a, b in routes.of(0, 0, x, y)
    )
    assert sent == want.numel() * 2


def test_a_chunk_every_rank_keeps_whole_is_broadcast() -> None:
    from fastload.distributed.needs import Routes, need_of

    whole = need_of((8, 8), "F32", [None])
    half = need_of((8, 8), "F32", [[0, 0, 4]])
    routes = Routes(
        [{"a": whole, "b": whole}, {"a": whole, "b": half}], {0: [("a", 0, 256), ("b", 256, 512)]}
    )
    assert routes.broadcast(0, 0, 256)  # only "a": kept whole by both
    assert not routes.broadcast(0, 200, 300)  # "b" too, of which rank 1 keeps half
    assert routes.of(1, 0, 200, 300) == [(0, 100)]  # a's last 56 bytes, b's first 44 (its rows 0-3)


@pytest.mark.parametrize(
    "shape,selections,dtype",
    [
        ((64, 48), ([0, 0, 32], [0, 32, 64]), torch.bfloat16),  # column-wise: rows
        ((64, 48), ([1, 0, 24], [1, 24, 48]), torch.bfloat16),  # row-wise: a part of each row
        ((4, 6, 10), ([1, 0, 3], [1, 3, 6]), torch.bfloat16),  # a middle dimension
        ((64, 48), ([0, 1000], [1000, 3072]), torch.bfloat16),  # flat ranges
        ((64, 48), ([1, 0, 24], None), torch.bfloat16),  # one rank keeps all of it
        ((64, 48), ([1, 0, 24], [1, 24, 48]), torch.float32),  # converted: assembled
    ],
)
def test_each_rank_lands_only_its_slice_and_the_owner_holds_only_what_it_sends(
    shape: tuple[int, ...],
    selections: tuple[Any, Any],
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 fetches every chunk (its own slice to its tensor, rank 1's to a scratch buffer) and
    sends rank 1 its ranges, in the messages of a chunk; each rank ends with its selection,
    bitwise, and no tensor of a slice is assembled whole."""
    from fastload.core.checkpoint.opened import StoredTensor
    from fastload.distributed import landings
    from fastload.distributed.needs import Routes, need_of, size, without

    # a bf16 tensor at byte 1000 of its file, behind one every rank keeps whole
    tensor = torch.randn(shape).to(torch.bfloat16)
    raw = tensor.view(-1).view(torch.uint8)
    start = 1000
    file = torch.randint(0, 255, (start + raw.numel(),), dtype=torch.uint8)
    file[start:] = raw
    head = StoredTensor("u", 0, "U8", (start,), start, 0)
    stored = StoredTensor("t", 0, "BF16", shape, raw.numel(), start)
    assembled: dict[int, int] = {}  # id(target) -> bytes of its assembly when complete
    finish = landings.finish

    def finishing(target: Any) -> None:
        assembled[id(target)] = target.whole.numel()
        finish(target)

    monkeypatch.setattr(landings, "finish", finishing)
    ranks = []
    for selection in selections:
        if selection is None:
            dest = torch.empty(shape, dtype=dtype)
        elif len(selection) == 2:
            dest = torch.empty(selection[1] - selection[0], dtype=dtype)
        else:
            dim, a, b = selection
            dest = torch.empty(tensor.narrow(dim, a, b - a).shape, dtype=dtype)
        target = landings.Target(stored, start, [(dest, selection)])
        target.needs = need_of(shape, "BF16", [selection])
        first = landings.Target(head, 0, [(torch.empty(start, dtype=torch.uint8), None)])
        ranks.append(([first, target], dest))
    routes = Routes(
        [{"u": need_of((start,), "U8", [None]), "t": t.needs} for (_, t), _ in ranks],
        {0: [("u", 0, start), ("t", start, file.numel())]},
    )
    cuts = [0, 700, 1333, 1501, 2100, 4000, 5555, file.numel()]
    cuts = sorted({min(c, file.numel()) for c in cuts})
    for a, b in zip(cuts, cuts[1:], strict=False):
        parts = [landings.pieces(a, b, targets) for targets, _ in ranks]
        assert parts[0] is not None and parts[1] is not None
        theirs = routes.of(1, 0, a, b)
        forward = without(theirs, routes.of(0, 0, a, b))
        owner = landings.landing(parts[0], [forward] if forward else [], a)
        # the owner holds its own bytes where they land and rank 1's others in the scratch only
        assert sum(r.hi - r.lo for r in owner if not r.kept) == size(forward)
        for run in owner:  # the fetch, each run straight where it is held
            run.view.copy_(file[run.lo : run.hi])
        held = landings.landing(parts[1])
        for message in landings.messages(parts[1], a, theirs):
            landings.put(held, a, message, landings.take(owner, a, message))
        landings.settle(owner)
        landings.settle(held)
    for (targets, dest), selection in zip(ranks, selections, strict=True):
        target = targets[1]
        assert target.received == target.kept and target.whole is None
        want = tensor
        if selection is not None and len(selection) == 2:
            want = tensor.reshape(-1)[selection[0] : selection[1]]
        elif selection is not None:
            want = tensor.narrow(selection[0], selection[1], selection[2] - selection[1])
        assert torch.equal(dest, want.to(dtype))
        if dtype == torch.bfloat16:  # no assembly: the bytes went straight into the tensor
            assert id(target) not in assembled
        else:  # assembled (to be converted): of the slice's bytes only
            assert assembled[id(target)] == want.numel() * 2


def test_the_ranges_one_rank_alone_keeps_are_column_wise_slices_alike_on_every_rank() -> None:
    from fastload.distributed.needs import need_of, sole_keepers

    shape, nbytes = (64, 48), 64 * 48 * 2  # bf16: rows of 96 bytes

    def everyone(*selections: Any) -> list[dict[str, Any]]:
        return [{"t": need_of(shape, "BF16", [s])} for s in selections]

    # column-wise: each rank's rows, one run of bytes no other rank keeps
    assert sole_keepers(everyone([0, 0, 32], [0, 32, 64]), "t", nbytes) == [
        (0, 3072, 0),
        (3072, nbytes, 1),
    ]
    assert sole_keepers(everyone([0, 1000], [1000, 3072]), "t", nbytes) == [
        (0, 2000, 0),
        (2000, nbytes, 1),
    ]
    assert sole_keepers(everyone([1, 0, 24], [1, 24, 48]), "t", nbytes) == []  # a part of each row
    assert sole_keepers(everyone(None, None), "t", nbytes) == []  # replicated
    assert sole_keepers(everyone([0, 0, 40], [0, 24, 64]), "t", nbytes) == []  # rows 24-39 twice
    assert sole_keepers(everyone([0, 0, 32], None), "t", nbytes) == []  # rank 1 keeps it all


class _Alone:
    """Rank 0 of 2 whose collective calls are recorded (the other rank's answers: nothing
    failed there); a chunk this rank alone keeps must need none but the read's last check."""

    rank, world_size, device = 0, 2, torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[str] = []

    def largest(self, flag: torch.Tensor) -> None:
        self.calls.append("largest")

    def gather(self, value: Any) -> list[Any]:
        self.calls.append("gather")
        return [value, None]

    def __getattr__(self, name: str) -> Any:  # broadcast, send_each, receive: not for these
        raise AssertionError(f"{name}: a chunk only its owner keeps crossed the group")


class _Fetching:
    """Rank 0's reader of a read whose chunks are column-wise slices: fetches each of its
    chunks where it lands (or fails the first, ``fail``), counting the fetches."""

    def __init__(self, group: Any, by_file: Any, routes: Any, raw: torch.Tensor, mine: list[Any],
                 fail: bool) -> None:  # fmt: skip
        self.args, self.raw, self.mine, self.fail, self.fetched = (
            (group, by_file, routes), raw, list(mine), fail, 0)  # fmt: skip

    def next(self) -> Any:
        from fastload.distributed.moves import owner_landing
        from fastload.distributed.object_reads import Fetched

        self.fetched += 1
        if self.fail:
            raise OSError("connection cut under the fetch")
        chunk = self.mine.pop(0)
        held = owner_landing(*self.args, chunk.file, chunk.start, chunk.stop)
        for run in held:
            run.view.copy_(self.raw[run.lo : run.hi])
        return Fetched(held, torch.empty(0, dtype=torch.uint8))

    def release(self, got: Any) -> None:
        pass


@pytest.mark.parametrize("fail", [False, True])
def test_a_chunk_only_its_owner_keeps_crosses_nothing_and_a_failed_fetch_of_it_stops_the_read(
    fail: bool,
) -> None:
    """Rank 0 fetches its rows of a column-wise weight into its tensor and skips rank 1's, with
    no collective call but the read's last check; a fetch of its rows that fails is told there
    (every rank raises one error naming it), and nothing more is fetched after it."""
    from fastload.core.basics.errors import FastloadIOError
    from fastload.core.checkpoint.opened import StoredTensor
    from fastload.distributed.collective import _exchange
    from fastload.distributed.landings import Target
    from fastload.distributed.moves import alone
    from fastload.distributed.needs import Routes, need_of

    shape = (64, 48)
    tensor = torch.randn(shape).to(torch.bfloat16)
    raw = tensor.view(-1).view(torch.uint8)
    stored = StoredTensor("t", 0, "BF16", shape, raw.numel(), 0)
    selections = [[0, 0, 32], [0, 32, 64]]
    dest = torch.empty(32, 48, dtype=torch.bfloat16)
    target = Target(stored, 0, [(dest, selections[0])])
    target.needs = need_of(shape, "BF16", [selections[0]])
    routes = Routes([{"t": need_of(shape, "BF16", [s])} for s in selections],
                    {0: [("t", 0, raw.numel())]})  # fmt: skip
    chunks = [Chunk(0, 0, 2048, 0), Chunk(0, 2048, 3072, 0), Chunk(0, 3072, raw.numel(), 1)]
    group = _Alone()
    reader = _Fetching(group, {0: [target]}, routes, raw, chunks[:2], fail)
    solo = [alone(group, routes, c) for c in chunks]  # type: ignore[arg-type]
    assert solo == [True, True, True]  # each chunk's rows are one rank's alone
    if not fail:
        assert _exchange(group, chunks, solo, reader, {0: [target]}, routes) == 0  # none received
        assert torch.equal(dest, tensor[:32]) and target.received == target.kept
        assert group.calls == ["largest"] and reader.fetched == 2
        return
    with pytest.raises(FastloadIOError, match="rank 0: .*connection cut under the fetch"):
        _exchange(group, chunks, solo, reader, {0: [target]}, routes)
    assert group.calls == ["largest", "gather"] and reader.fetched == 1
