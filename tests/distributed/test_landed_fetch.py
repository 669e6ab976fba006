"""The owner of an exchanged chunk fetches it with the engine straight where its bytes are held
(:func:`fastload.distributed.object_reads.landed_jobs`): its own slice into its tensor, the
others' into its scratch. A row-wise shard is a part of every row, one run per row; the runs of
one place are fetched as one item of rows, not one item per row, and every byte lands where it
belongs, whatever rows a chunk cuts through."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

from fastload import _core
from fastload.core.basics.engine import copy_into
from fastload.core.basics.errors import FastloadError
from fastload.core.checkpoint.opened import StoredTensor
from fastload.core.checkpoint.pickle_file import StateDictFile
from fastload.distributed import landings
from fastload.distributed.file_reads import Chunk
from fastload.distributed.moves import owner_landing, sends_of
from fastload.distributed.needs import Routes, need_of
from fastload.distributed.object_reads import landed_jobs

WORLD = 4
SHAPE = (64, 48)  # bf16 rows of 96 bytes; each rank keeps 24 bytes of each


def _checkpoint(tmp_path: Path) -> tuple[_core.SafetensorsFile, torch.Tensor, int]:
    tensor = torch.randn(SHAPE).to(torch.bfloat16)
    head = torch.arange(1000, dtype=torch.int64).to(torch.uint8)  # a tensor before it
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"a": head, "t": tensor}, str(path))
    file = _core.SafetensorsFile(str(path))
    _, _, begin, _ = file.info("t")
    return file, tensor, file.data_start + begin


def _owner(file: _core.SafetensorsFile, t_start: int) -> tuple[Routes, dict, list[torch.Tensor]]:
    """Rank 0's targets, every rank's needs: a row-wise slice each (dim 1)."""
    cols = SHAPE[1] // WORLD
    selections = [[1, r * cols, (r + 1) * cols] for r in range(WORLD)]
    stored = StoredTensor("t", 0, "BF16", SHAPE, SHAPE[0] * SHAPE[1] * 2, t_start)
    dest = torch.empty(SHAPE[0], cols, dtype=torch.bfloat16)
    target = landings.Target(stored, t_start, [(dest, selections[0])])
    target.needs = need_of(SHAPE, "BF16", [selections[0]])
    everyone = [{"t": need_of(SHAPE, "BF16", [s])} for s in selections]
    routes = Routes(everyone, {0: [("t", t_start, t_start + stored.nbytes)]})
    return routes, {0: [target]}, [dest]


@pytest.mark.parametrize("cuts", [(0, 6144), (0, 1000, 3010, 6144), (50, 98, 5000)])
def test_a_row_wise_chunk_is_fetched_as_one_item_of_rows_per_place(
    tmp_path: Path, cuts: tuple[int, ...]
) -> None:
    file, tensor, t_start = _checkpoint(tmp_path)
    routes, by_file, (dest,) = _owner(file, t_start)
    group = SimpleNamespace(rank=0, world_size=WORLD)
    raw = tensor.view(-1).view(torch.uint8)
    cols = SHAPE[1] // WORLD
    for a, b in zip(cuts, cuts[1:], strict=False):
        start, stop = t_start + a, t_start + b
        held = owner_landing(group, by_file, routes, 0, start, stop)  # type: ignore[arg-type]
        assert held is not None
        items = landed_jobs(held)
        # one item per place (rank 0's tensor, each other rank's part of the scratch), and at
        # most a partial row before and after it where the chunk cuts through rows
        assert len(items) <= min(len(held), 3 * WORLD)
        if b - a >= 10 * 96:  # many rows: far fewer items than runs
            assert len(held) >= 10 * WORLD
        assert sum(1 for item in items if item[3] is not None and len(item[3]) == 5) <= WORLD
        copy_into(file, items)
        chunk = Chunk(0, start, stop, 0)
        for rank, ranges in sends_of(group, routes, chunk).items():  # type: ignore[arg-type]
            sent = landings.take(held, start, ranges)
            want = torch.cat([raw[a + lo : a + hi] for lo, hi in ranges])
            assert torch.equal(sent, want), f"rank {rank}'s bytes of chunk [{a}, {b})"
        landings.settle(held)
    # rank 0's own part of every row the chunks covered whole
    full = slice(-(-cuts[0] // 96), cuts[-1] // 96)
    assert torch.equal(dest[full], tensor[full, :cols])


@pytest.mark.parametrize("source", ["safetensors", "state dict"])
def test_a_block_of_rows_is_checked_against_the_tensor_and_names_it(
    tmp_path: Path, source: str
) -> None:
    file, tensor, _ = _checkpoint(tmp_path)
    if source == "state dict":  # the pickle and state-dict files take the same selections
        file = StateDictFile({"t": tensor})
    read = [
        ([10, 2, 48, 4, 8], tensor[10:12, 4:8]),  # rows 10-11, elements 4-7
        ([4, 3, 96, 48, 96], tensor[9:15:2]),  # rows of two rows: every second row
        ([63, 1, 48, 0, 48], tensor[63]),  # the last row, whole
        ([5, 0, 48, 0, 8], tensor[:0, :8]),
    ]
    for selection, want in read:
        out = torch.empty(want.numel(), dtype=torch.bfloat16)
        copy_into(file, [("t", out, "BF16", selection)])
        assert torch.equal(out, want.reshape(-1)), selection
    for bad in ([63, 2, 48, 4, 8], [0, 1, 48, 40, 56], [0, 1, 0, 0, 0], [0, 1, 48, 9, 8]):
        with pytest.raises(FastloadError, match="'t'"):
            copy_into(file, [("t", torch.empty(8, dtype=torch.bfloat16), "BF16", bad)])
