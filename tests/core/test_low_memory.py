"""Models larger than memory: the memory budget (fastload.core.memory.budget), read-ahead within it,
copies refused before allocating, and device_map="auto" sized by it; in a real memory cgroup where
the machine allows one (tests/support/memory_cgroup.py), else skipped with the reason."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from memory_cgroup import baseline_bytes, needs_memory_cgroup, run_in_cgroup
from torch import nn

import fastload
from fastload.core.memory import budget as memory
from fastload.core.memory import paced
from fastload.core.memory.budget import MemoryBudget
from fastload.core.memory.page_cache import evict
from fastload.safetensors.saving import save_file

LAYERS, WIDTH = 32, 2048  # 32 fp32 2048x2048 layers: 512 MiB of weights
MODEL_BYTES = LAYERS * WIDTH * WIDTH * 4


def stack() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("low_memory") / "stack.safetensors"
    state = {f"{i}.weight": torch.randn(WIDTH, WIDTH) * 0.02 for i in range(LAYERS)}
    save_file(state, path)
    return path


# The child: loads the stack from argv[1] (options as JSON in argv[2]), runs one forward, prints
# a digest of the output, the report's memory figures and where the tensors went.
CHILD = """
import hashlib, json, sys
import torch
from torch import nn
import fastload, fastload.api

LAYERS, WIDTH = @LAYERS@, @WIDTH@

def stack():
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))

options = json.loads(sys.argv[2])
try:
    model, report = fastload.from_pretrained(
        stack, sys.argv[1], progress=False, output_loading_info=True, **options
    )
except fastload.MemoryBudgetError as e:
    print(json.dumps({"refused": str(e), "is_memory_error": isinstance(e, MemoryError)}))
    sys.exit(0)
torch.manual_seed(1)
with torch.inference_mode():
    out = model(torch.randn(4, WIDTH))
print(json.dumps({
    "digest": hashlib.sha256(out.numpy().tobytes()).hexdigest(),
    "budget": report.memory_budget,
    "source": report.memory_source,
    "read_ahead": report.bytes_read_ahead,
    "device_map": report.device_map,
    "offloaded": report.bytes_offloaded,
    "summary": report.summary(),
}))
""".replace("@LAYERS@", str(LAYERS)).replace("@WIDTH@", str(WIDTH))


def _limit() -> int:
    """A cgroup limit that leaves half the model's bytes above what a child holds once torch and
    fastload are imported: the model is twice the memory the load may use."""
    return baseline_bytes() + MODEL_BYTES // 2


@needs_memory_cgroup
def test_a_model_twice_the_cgroup_budget_loads_and_computes_as_an_unconstrained_load(big):
    import json

    reference = run_in_cgroup(CHILD, big, "{}", limit=None).json()
    evict(big)  # read from storage inside the cgroup, charged to it
    child = run_in_cgroup(CHILD, big, "{}", limit=_limit())
    got = child.json()
    assert got["digest"] == reference["digest"]
    assert got["source"].startswith("cgroup")
    assert got["budget"] < MODEL_BYTES
    # read ahead no more than can stay resident: at most the budget, not the whole model
    assert got["read_ahead"] <= got["budget"] < MODEL_BYTES
    assert "memory budget:" in got["summary"]
    assert json.loads(json.dumps(got))  # plain data


@needs_memory_cgroup
def test_copy_mode_in_the_cgroup_is_refused_with_the_bytes_and_the_alternatives(big):
    evict(big)
    child = run_in_cgroup(CHILD, big, '{"mmap": "copy"}', limit=_limit())
    got = child.json()  # exits normally: no OOM kill
    message = got["refused"]
    assert got["is_memory_error"]
    assert f"({MODEL_BYTES} bytes)" in message  # the bytes needed
    assert "is available" in message and "cgroup" in message  # the bytes available, and whence
    assert "mmap='copy'" in message
    assert "mmap='auto'" in message and "offload_folder" in message  # what would work


@needs_memory_cgroup
def test_device_map_auto_puts_no_more_on_the_cpu_than_the_cgroup_allows(big, tmp_path):
    pytest.importorskip("accelerate")
    import json

    evict(big)
    options = {"device_map": "auto", "offload_folder": str(tmp_path / "offload")}
    child = run_in_cgroup(CHILD, big, json.dumps(options), limit=_limit())
    got = child.json()
    reference = run_in_cgroup(CHILD, big, "{}", limit=None).json()
    assert got["digest"] == reference["digest"]
    assert got["offloaded"] > 0  # what does not fit stays on disk
    cpu = MODEL_BYTES - got["offloaded"]
    assert cpu <= got["budget"]
    assert set(got["device_map"].values()) == {"cpu", "disk"}


# --- without a cgroup: the budget's figures and the refusal -------------------------------------


def test_a_v1_cgroup_budget_is_the_limit_less_what_the_cgroup_holds_but_its_file_cache(
    tmp_path, monkeypatch
):
    (tmp_path / "memory.limit_in_bytes").write_text(str(1 << 30))
    (tmp_path / "memory.usage_in_bytes").write_text(str(700 << 20))
    (tmp_path / "memory.stat").write_text(
        f"hierarchical_memory_limit {1 << 30}\ntotal_inactive_file {200 << 20}\n"
        f"total_active_file {100 << 20}\n"
    )
    monkeypatch.setattr(memory, "cgroup_dir", lambda v: tmp_path if v == 1 else None)
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemAvailable": 8 << 30, "SwapFree": 0})
    budget = memory.memory_budget()
    assert budget.limit == 1 << 30
    assert budget.source == "cgroup v1 memory.limit_in_bytes"
    assert budget.available == (1 << 30) - (400 << 20)
    # at most what the host has
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemAvailable": 100 << 20})
    assert memory.memory_budget().available == 100 << 20


def test_a_v2_cgroup_budget_takes_the_tightest_level(tmp_path, monkeypatch):
    outer, inner = tmp_path / "outer", tmp_path / "outer" / "inner"
    inner.mkdir(parents=True)
    for level, limit, current in ((outer, 900 << 20, 500 << 20), (inner, "max", 500 << 20)):
        (level / "memory.max").write_text(f"{limit}\n")
        (level / "memory.current").write_text(f"{current}\n")
        (level / "memory.stat").write_text(f"inactive_file {100 << 20}\nactive_file 0\n")
    monkeypatch.setattr(memory, "cgroup_dir", lambda v: inner if v == 2 else None)
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemAvailable": 8 << 30})
    budget = memory.memory_budget()
    assert (budget.source, budget.limit) == ("cgroup v2 memory.max", 900 << 20)
    assert budget.available == (900 << 20) - (400 << 20)


def test_without_a_cgroup_limit_the_budget_is_mem_available(monkeypatch):
    monkeypatch.setattr(memory, "cgroup_dir", lambda v: None)
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemAvailable": 3 << 30, "SwapFree": 1 << 30})
    budget = memory.memory_budget()
    assert (budget.source, budget.available, budget.limit) == ("MemAvailable", 3 << 30, None)
    assert budget.swap == 1 << 30  # counts for memory a load owns, not for read-ahead
    assert budget.read_ahead_room() == (3 << 30) // 2
    memory.check_owned(4 << 30, budget, "a test")  # fits with the swap
    with pytest.raises(fastload.MemoryBudgetError, match=r"only 3.0 GiB .* plus 1.0 GiB of swap"):
        memory.check_owned(5 << 30, budget, "a test")


def _small_budget(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    monkeypatch.setattr(
        "fastload.core.loading.memory_budget", lambda: MemoryBudget(nbytes, "a test budget")
    )


def test_a_conversion_larger_than_the_budget_is_refused_before_allocating(big, monkeypatch):
    _small_budget(monkeypatch, MODEL_BYTES // 2)
    with pytest.raises(fastload.MemoryBudgetError, match="conversion to float64") as caught:
        fastload.from_pretrained(stack, big, dtype=torch.float64, progress=False)
    assert caught.value.needed == 2 * MODEL_BYTES
    assert isinstance(caught.value, MemoryError)
    assert f"{MODEL_BYTES // 2} bytes" in str(caught.value)


def test_views_larger_than_the_budget_are_read_ahead_paced_by_the_first_forward(big, monkeypatch):
    _small_budget(monkeypatch, MODEL_BYTES // 2)
    evict(big)
    model, report = fastload.from_pretrained(stack, big, progress=False, output_loading_info=True)
    assert report.bytes_shared == MODEL_BYTES
    assert report.memory_budget == MODEL_BYTES // 2
    assert report.read_ahead.startswith("paced by the first forward")
    assert "memory budget: 256.0 MiB (a test budget)" in report.summary()
    expected = fastload.load_file(big)
    with torch.inference_mode():
        x = torch.randn(2, WIDTH)
        assert torch.equal(model(x), _reference(expected)(x))


def test_views_larger_than_the_budget_on_one_thread_read_ahead_only_the_first_that_fit(
    big, monkeypatch
):
    _small_budget(monkeypatch, MODEL_BYTES // 2)
    evict(big)  # read-ahead reads what is not cached
    model, report = fastload.from_pretrained(
        stack, big, progress=False, output_loading_info=True, threads=1
    )
    # the read-ahead room: half the budget (the file's pages around the views rounded in)
    assert 0 < report.bytes_read_ahead <= MODEL_BYTES // 4 + (1 << 20)
    assert report.read_ahead.startswith("the first 8 views")
    assert torch.equal(model[31].weight, fastload.load_file(big)["31.weight"])


def _reference(state: dict[str, torch.Tensor]) -> nn.Module:
    model = stack()
    model.load_state_dict(state)
    return model


@pytest.mark.skipif(not paced.supported(), reason="needs /proc/self/pagemap (Linux)")
def test_the_paced_read_ahead_waits_for_the_forward_to_reach_what_it_read(tmp_path):
    from fastload.core.memory.sharing import SharedMapping
    from fastload.core.reads.reading import open_file

    path = tmp_path / "paced.safetensors"
    names = [f"{i:02d}" for i in range(6)]
    save_file({n: torch.full((4 << 20,), float(i)) for i, n in enumerate(names)}, path)  # 16 MiB
    evict(path)
    f = open_file(path)
    mapping = SharedMapping(f)
    order = names[::-1]  # the model uses them last first
    views = {n: mapping.view(n, torch.float32) for n in order}
    offsets = {n: f.data_start + begin for n, _, _, begin, _ in f.tensors()}

    def cached(name: str) -> bool:
        return not f.mostly_uncached(offsets[name], 16 << 20)

    def wait_for(condition) -> bool:
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        return condition()

    reader = paced.PacedReadAhead([(mapping, offsets[n], 16 << 20) for n in order], 32 << 20)
    assert wait_for(lambda: cached(order[1]))  # the first two: one being used, one ahead
    time.sleep(0.3)
    assert not cached(order[2])  # no further: the forward has not reached them
    float(views[order[0]].sum())  # the forward uses the first
    float(views[order[1]].sum())  # and the second
    assert wait_for(lambda: cached(order[3]))
    for n in order:
        float(views[n].sum())
    reader.join(timeout=30)
    assert reader.read == 6 * (16 << 20)  # each byte read once
    assert [float(views[n][0]) for n in order] == [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
