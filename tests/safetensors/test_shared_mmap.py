"""mmap="shared": parameters are copy-on-write views of the file, shared across processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

import fastload
from fastload import _core
from fastload.core.memory import sharing
from fastload.core.memory.page_cache import evict
from fastload.core.memory.sharing import WarmUp
from fastload.safetensors.saving import save_file

MIB = 1 << 20


class Wide(nn.Module):
    """Four 8 MiB float32 layers: big enough that page-level sharing is measurable."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1448, 1448, bias=True) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("shared") / "wide.safetensors"
    save_file(Wide().state_dict(), path)
    return path


def test_shared_parameters_equal_copied_ones_and_view_the_file(checkpoint):
    copied = fastload.from_pretrained(Wide, checkpoint, progress=False, mmap="copy")
    shared, report = fastload.from_pretrained(
        Wide, checkpoint, mmap="shared", progress=False, output_loading_info=True
    )
    for (name, a), (_, b) in zip(copied.named_parameters(), shared.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert report.bytes_shared == sum(p.numel() * 4 for p in shared.parameters())
    assert "shared" in report.read_mode
    # A view of the file mapping, not a fresh allocation; each weight with a storage of its own.
    assert _views_of(checkpoint, shared.parameters())


def test_writing_a_shared_parameter_never_changes_the_file(checkpoint):
    before = checkpoint.read_bytes()
    model = fastload.from_pretrained(Wide, checkpoint, mmap="shared", progress=False)
    with torch.no_grad():
        model.layers[0].weight.add_(1.0)
    assert checkpoint.read_bytes() == before
    fresh = fastload.from_pretrained(Wide, checkpoint, progress=False, mmap="copy")
    assert torch.equal(fresh.layers[0].weight + 1.0, model.layers[0].weight)


def test_a_dtype_conversion_falls_back_to_copying(checkpoint):
    model, report = fastload.from_pretrained(
        Wide,
        checkpoint,
        mmap="shared",
        dtype=torch.bfloat16,
        progress=False,
        output_loading_info=True,
    )
    assert report.bytes_shared == 0
    assert model.layers[0].weight.dtype == torch.bfloat16


def test_an_unknown_mmap_mode_is_refused(checkpoint):
    with pytest.raises(fastload.RequestError, match="mmap"):
        fastload.from_pretrained(Wide, checkpoint, mmap="private")


_WORKER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    import fastload
    from test_shared_mmap import Wide

    def anonymous_kib():
        # Anonymous memory is what a process owns privately; page-cache pages of a file mapping
        # are not counted until written (copy-on-write).
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:"))

    before = anonymous_kib()
    model = fastload.from_pretrained(Wide, {path!r}, mmap={mode!r}, progress=False)
    total = sum(float(p.detach().sum()) for p in model.parameters())  # touch every page
    print(anonymous_kib() - before, flush=True)
    sys.stdin.readline()  # stay alive until every worker has measured
    """
)


def _private_kib_of_workers(path: Path, mode: str, n: int = 4) -> list[int]:
    """Private memory each of ``n`` concurrent workers gained by loading the checkpoint."""
    code = _WORKER.format(tests=str(Path(__file__).parent), path=str(path), mode=mode)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    try:
        lines = [p.stdout.readline().strip() for p in procs]
    finally:
        for p in procs:
            p.communicate(input="\n", timeout=60)
    assert all(line.lstrip("-").isdigit() for line in lines), lines
    return [int(line) for line in lines]


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux smaps")
def test_four_processes_sharing_a_checkpoint_use_far_less_private_memory(checkpoint):
    model_kib = checkpoint.stat().st_size // 1024
    shared = _private_kib_of_workers(checkpoint, "shared")
    copied = _private_kib_of_workers(checkpoint, "copy")
    print(f"model {model_kib} KiB; private KiB gained, shared: {shared}; copied: {copied}")
    # Copying: every worker privately holds the whole model. Sharing: the weights stay page-cache
    # pages common to all workers, so the sum of private memory stays far below 4 x model size.
    assert sum(copied) > 3.5 * model_kib
    assert sum(shared) < 0.5 * model_kib


def test_a_checkpoint_replaced_before_it_is_mapped_is_still_read_from_the_file_opened(tmp_path):
    # The mapping goes through the open file descriptor, not the path: the replacement (same
    # size, other values) is not what the views show.
    from fastload.core.memory.sharing import SharedMapping
    from fastload.core.reads.reading import open_file

    local = tmp_path / "w.safetensors"
    save_file({"w": torch.full((1024,), 1.0)}, local)
    opened = open_file(local)
    replacement = tmp_path / "new.safetensors"
    save_file({"w": torch.full((1024,), 2.0)}, replacement)
    replacement.replace(local)
    view = SharedMapping(opened).view("w", torch.float32)
    assert view is not None and torch.equal(view, torch.full((1024,), 1.0))


# --- the default: views on a local filesystem, copies elsewhere ---------------------------------


def test_the_default_load_views_a_file_on_a_local_filesystem(checkpoint):
    model, report = fastload.from_pretrained(
        Wide, checkpoint, progress=False, output_loading_info=True
    )
    assert report.bytes_shared == sum(p.numel() * 4 for p in model.parameters())
    assert report.bytes_written == 0
    assert report.sharing[str(checkpoint)].startswith("views of the file mapping")
    assert _views_of(checkpoint, model.parameters())


def test_mmap_copy_gives_private_copies_and_says_so(checkpoint):
    model, report = fastload.from_pretrained(
        Wide, checkpoint, mmap="copy", progress=False, output_loading_info=True
    )
    assert report.bytes_shared == 0
    assert report.sharing == {str(checkpoint): "copies (mmap='copy')"}
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 8
    assert not any(_mapped_file(p.data_ptr()) for p in model.parameters())


def test_the_default_copies_a_file_on_a_network_filesystem(checkpoint, monkeypatch):
    monkeypatch.setattr("fastload.core.memory.sharing.filesystem", lambda file: ("nfs", False))
    model, report = fastload.from_pretrained(
        Wide, checkpoint, progress=False, output_loading_info=True
    )
    assert report.bytes_shared == 0
    assert report.sharing[str(checkpoint)] == "copies (nfs is a network or FUSE filesystem)"
    assert torch.equal(model.layers[3].bias, fastload.load_file(checkpoint)["layers.3.bias"])


def test_mmap_shared_views_a_file_on_a_network_filesystem_when_asked(checkpoint, monkeypatch):
    monkeypatch.setattr("fastload.core.memory.sharing.filesystem", lambda file: ("nfs", False))
    _, report = fastload.from_pretrained(
        Wide, checkpoint, mmap="shared", progress=False, output_loading_info=True
    )
    assert report.sharing[str(checkpoint)] == "views of the file mapping (nfs)"
    assert report.bytes_shared > 0


def test_a_file_reports_the_local_filesystem_it_is_on(checkpoint):
    from fastload.core.reads.reading import open_file

    name, local = open_file(checkpoint).filesystem()
    assert local and name


def test_reading_ahead_an_unmapped_range_is_an_error_not_a_crash(checkpoint):
    from fastload.core.reads.reading import open_file

    opened = open_file(checkpoint)
    # An offset past the end is never cached, so the address range (page 0, never mapped in a
    # Linux process) is populated, and the kernel refuses.
    with pytest.raises(fastload.FastloadIOError):
        opened.read_ahead(0, opened.file_size + (1 << 20), 4096)


def test_views_read_ahead_after_eviction_hold_the_files_bytes(checkpoint, tmp_path):
    import shutil

    from fastload.core.memory.sharing import SharedMapping
    from fastload.core.reads.reading import open_file

    local = tmp_path / "cold.safetensors"
    shutil.copyfile(checkpoint, local)
    evict(local)
    mapping = SharedMapping(open_file(local))
    views = {name: mapping.view(name, torch.float32) for name in open_file(local).keys()}
    assert mapping.prefetch() <= local.stat().st_size + 4096
    copies = fastload.load_file(local)
    for name, view in views.items():
        assert torch.equal(view, copies[name]), name


def test_no_read_ahead_when_the_views_exceed_half_the_memory_budget(checkpoint):
    from fastload.core.memory.budget import MemoryBudget
    from fastload.core.memory.sharing import SharedMapping
    from fastload.core.reads.reading import open_file

    mapping = SharedMapping(open_file(checkpoint))
    view = mapping.view("layers.0.weight", torch.float32)
    small = MemoryBudget(view.numel() * 4, "a test budget")  # room: half the view
    assert mapping.prefetch(budget=small) == 0


@pytest.mark.skipif(sys.platform != "linux", reason="read-ahead into the mapping is Linux-only")
def test_a_budget_smaller_than_the_views_reads_ahead_the_first_ones_in_order(tmp_path: Path):
    from fastload.core.memory.budget import MemoryBudget
    from fastload.core.memory.sharing import SharedMapping, prefetch_in_order
    from fastload.core.reads.reading import open_file

    path = tmp_path / "order.safetensors"
    # stored in name order (a, b, c); handed out c, a, b, as a model's forward would use them
    sizes = {"a": 1 << 20, "b": 16 << 20, "c": 1 << 20}  # b: beyond the kernel's own read-ahead
    save_file({n: torch.full((k,), float(i)) for i, (n, k) in enumerate(sizes.items())}, path)
    evict(path)
    mapping = SharedMapping(open_file(path))
    views = [mapping.view(n, torch.float32) for n in "cab"]
    room = 2 * (4 << 20) + 4096  # the first two views
    read, how = prefetch_in_order([mapping], MemoryBudget(2 * room, "a test budget"), paced=False)
    assert how.startswith("the first 2 views")
    assert (4 << 20) * 2 <= read <= (4 << 20) * 2 + (1 << 20)
    f = open_file(path)
    offsets = {n: f.data_start + begin for n, _, _, begin, _ in f.tensors()}
    assert not f.mostly_uncached(offsets["c"], 4 << 20)
    assert not f.mostly_uncached(offsets["a"], 4 << 20)
    assert f.mostly_uncached(offsets["b"], 64 << 20)  # left to be read on first use
    assert [float(v[0]) for v in views] == [2.0, 0.0, 1.0]


# --- read-ahead while the skeleton is built -------------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="read-ahead into the mapping is Linux-only")
def test_an_evicted_file_is_read_ahead_from_the_moment_it_is_open(tmp_path: Path) -> None:
    path = tmp_path / "cold.safetensors"
    save_file({"a": torch.randn(3 << 20), "b": torch.randn(5 << 20)}, path)
    evict(path)
    file = _core.SafetensorsFile(str(path))
    warm_up = WarmUp([file], "auto", views=True)
    warm_up.join()
    data = file.file_size - file.data_start
    mapping = warm_up.mappings[0]
    assert warm_up.from_disk == data  # read from the disk by the warm-up
    assert warm_up.mapped >= data
    assert _resident_kib(mapping.address) * 1024 >= file.file_size - 4096
    assert torch.equal(mapping.view("b", torch.float32), fastload.load_file(path)["b"])


@pytest.mark.skipif(sys.platform != "linux", reason="read-ahead into the mapping is Linux-only")
def test_a_cached_file_is_mapped_in_pieces_shared_with_the_loading_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("fastload.core.memory.sharing.WARM_PIECE", 1 << 20)
    path = tmp_path / "warm.safetensors"
    tensors = {f"t{i}": torch.randn(3 << 16) for i in range(12)}  # 12 x 768 KiB
    save_file(tensors, path)
    path.read_bytes()  # cached
    file = _core.SafetensorsFile(str(path))
    warm_up = WarmUp([file], "auto", views=True)
    warm_up.join()  # the loading thread claims the pieces the helper has not taken
    data = file.file_size - file.data_start
    # each piece mapped once, by one thread or the other (whole pages: the ends round out)
    assert data <= warm_up.mapped <= data + 2 * 4096
    assert warm_up.from_disk == 0  # cached: nothing to read from the disk
    mapping = warm_up.mappings[0]
    assert _resident_kib(mapping.address) * 1024 >= file.file_size - 4096
    for name, tensor in tensors.items():
        assert torch.equal(mapping.view(name, torch.float32), tensor), name


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[WarmUp]:
    """The warm-ups the loads of the test start, in order."""
    started: list[WarmUp] = []

    class Recorded(WarmUp):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            started.append(self)

    monkeypatch.setattr("fastload.core.loading.WarmUp", Recorded)
    return started


def _mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``); None if anonymous."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, stop = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < stop:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def _views_of(path: Path, tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every tensor lies in a mapping of ``path`` and has a storage of exactly its own
    bytes (so that saving or sharing one tensor does not carry the rest of the file)."""
    return all(
        _mapped_file(t.data_ptr()) == str(path.resolve())
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and t.untyped_storage().data_ptr() == t.data_ptr()
        for t in tensors
    )


def _resident_kib(address: int) -> int:
    """Rss of the mapping of this process that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, stop = (int(x, 16) for x in head.split("-"))
            inside = start <= address < stop
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(sys.platform != "linux", reason="read-ahead into the mapping is Linux-only")
def test_the_views_of_a_load_come_from_the_mapping_the_warm_up_filled(
    checkpoint: Path, made: list[WarmUp]
) -> None:
    model = fastload.from_pretrained(Wide, checkpoint, progress=False)
    (warm_up,) = made
    mapping = warm_up.mappings[0]
    params = list(model.parameters())
    size = checkpoint.stat().st_size
    assert all(0 < p.data_ptr() - mapping.address < size for p in params)
    # every page was mapped before the load returned: nothing is left to fault on first use
    assert _resident_kib(mapping.address) * 1024 >= size - 4096
    assert warm_up.mapped >= sum(p.numel() * p.element_size() for p in params)


def test_files_that_will_not_be_mapped_are_not_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(1024)}, path)
    file = _core.SafetensorsFile(str(path))
    in_memory = _core.SafetensorsFile.from_bytes(path, path.read_bytes())

    def chosen(files: list[object], mmap: str, views: bool = True) -> list[object]:
        warm_up = WarmUp(files, mmap, views=views)
        warm_up.join()
        return warm_up.files

    assert chosen([file], "auto") == [file] and chosen([file], "shared") == [file]
    assert chosen([file], "copy") == []  # copies read the file themselves
    assert chosen([file], "auto", views=False) == []  # converted, or not for the CPU
    assert chosen([in_memory, object()], "shared") == []  # nothing on disk to read
    monkeypatch.setattr(sharing, "filesystem", lambda f: ("nfs", False))
    assert chosen([file], "auto") == [] and chosen([file], "shared") == [file]


def test_from_pretrained_reads_ahead_only_loads_that_give_views(
    checkpoint: Path, made: list[WarmUp]
) -> None:
    read_ahead = {}
    for label, kwargs in {
        "default": {},
        "stored dtype asked": {"dtype": torch.float32},
        "converted": {"dtype": torch.bfloat16},
        "copies": {"mmap": "copy"},
    }.items():
        fastload.from_pretrained(Wide, checkpoint, progress=False, **kwargs)
        read_ahead[label] = bool(made.pop().files)
    assert read_ahead == {
        "default": True,
        "stored dtype asked": True,
        "converted": False,
        "copies": False,
    }
