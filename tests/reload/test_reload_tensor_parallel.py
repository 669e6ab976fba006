"""fastload.reload of a tensor-parallel model (issue 44): each rank writes its own part of the new
checkpoint into the shards the load made, the same memory, sliced as the load sliced. Two gloo
ranks on CPU (spawned here, loopback only, bounded by TIMEOUT_S)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import free_port, leave_group, run_ranks
from tensor_samples import flip_stored_byte
from torch import nn

import fastload

WORLD = 2
TIMEOUT_S = 120
PLAN = {"fc1": "colwise", "fc2": "rowwise"}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def _rank(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S // 2)
    )
    try:
        model = fastload.from_pretrained(MLP, Path(root) / "a", tp_plan=PLAN, progress=False)
        before = {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}
        report = fastload.reload(model, Path(root) / "b")
        after = {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}
        with torch.no_grad():
            out = model(torch.ones(2, 64))
        torch.save(
            {
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "same_memory": before == after,
                "out": out,
                "bytes_read": report.bytes_read,
            },
            Path(root) / f"rank{rank}.pt",
        )
    finally:
        leave_group()


def test_each_rank_reloads_its_shards_in_place(tmp_path: Path) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torch.manual_seed(1)
    fastload.save_pretrained(MLP(), tmp_path / "a")
    torch.manual_seed(2)
    new = MLP().eval()
    fastload.save_pretrained(new, tmp_path / "b")
    run_ranks(_rank, (free_port(), str(tmp_path)), world=WORLD, timeout_s=TIMEOUT_S, what="reload")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    full = new.state_dict()
    for r, saved in enumerate(ranks):
        assert saved["same_memory"]
        state = saved["state"]
        assert torch.equal(state["fc1.weight"], full["fc1.weight"].chunk(WORLD, 0)[r])
        assert torch.equal(state["fc1.bias"], full["fc1.bias"].chunk(WORLD, 0)[r])
        assert torch.equal(state["fc2.weight"], full["fc2.weight"].chunk(WORLD, 1)[r])
        assert torch.equal(state["fc2.bias"], full["fc2.bias"])
        # each rank read its half of the sliced tensors, and the replicated bias whole
        sliced = sum(full[k].nbytes for k in ("fc1.weight", "fc1.bias", "fc2.weight"))
        assert saved["bytes_read"] == sliced // WORLD + full["fc2.bias"].nbytes
    with torch.no_grad():
        want = new(torch.ones(2, 64))
    for saved in ranks:
        torch.testing.assert_close(saved["out"], want)


def _verify_rank(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S // 2)
    )
    try:
        model = fastload.from_pretrained(MLP, Path(root) / "a", tp_plan=PLAN, progress=False)
        old = {k: v.detach().clone() for k, v in model.state_dict().items()}
        try:
            fastload.reload(model, Path(root) / "bad", atomic=True, verify=True)
            refused = ""
        except fastload.CheckpointError as exc:
            refused = str(exc)
        unchanged = all(torch.equal(v, old[k]) for k, v in model.state_dict().items())
        report = fastload.reload(model, Path(root) / "b", atomic=True, verify=True)
        torch.save(
            {
                "refused": refused,
                "unchanged": unchanged,
                "verified": report.tensors_verified,
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            },
            Path(root) / f"verify{rank}.pt",
        )
    finally:
        leave_group()


def test_verify_checks_each_ranks_slices_against_the_whole_tensors_digest(tmp_path: Path) -> None:
    """A rank holds a slice of fc1 and fc2; verify=True reads each stored tensor whole (the
    digest covers it) and checks it before its slice is staged: a byte flipped in the half of
    fc2.weight that rank 0 does not take is refused on both ranks."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torch.manual_seed(1)
    fastload.save_pretrained(MLP(), tmp_path / "a", digests=True)
    torch.manual_seed(2)
    new = MLP()
    fastload.save_pretrained(new, tmp_path / "b", digests=True)
    fastload.save_pretrained(new, tmp_path / "bad", digests=True)
    flip_stored_byte(tmp_path / "bad" / "model.safetensors", "fc2.weight")  # row 0, column 0
    run_ranks(
        _verify_rank, (free_port(), str(tmp_path)), world=WORLD, timeout_s=TIMEOUT_S, what="verify"
    )
    full = new.state_dict()
    for r in range(WORLD):
        saved = torch.load(tmp_path / f"verify{r}.pt", weights_only=True)
        assert "do not match the digest" in saved["refused"], saved["refused"]
        assert "'fc2.weight'" in saved["refused"] and "'fc1.weight'" not in saved["refused"]
        assert saved["unchanged"]
        assert saved["verified"] == len(full)
        assert torch.equal(saved["state"]["fc2.weight"], full["fc2.weight"].chunk(WORLD, 1)[r])
