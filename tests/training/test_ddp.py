"""A real 2-process DistributedDataParallel run (gloo, CPU, loopback) of a fastload-loaded model
with gradient checkpointing on: both ranks must end with identical weights (transformers #7272)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file as st_load_file
from spawn_ranks import free_port, leave_group, run_ranks
from tiny_models import make_config

import fastload
from fastload.training.gradient_checkpointing import is_gradient_checkpointing

transformers = pytest.importorskip("transformers")

WORLD = 2
STEPS = 3
TIMEOUT_S = 120


def _tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = make_config(
        "bert", vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    return transformers.BertForMaskedLM(config)


def _batch(rank: int, step: int) -> torch.Tensor:
    # Different data on each rank: identical weights afterwards come from DDP's all-reduce.
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, 100, (4, 16), generator=gen)


def _train(rank: int, port: int, checkpoint: str, out_dir: str) -> None:
    """One rank: load with fastload (checkpointing on), check DDP readiness, train, save."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)  # two ranks on a small machine
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S // 2)
    )
    try:
        model = fastload.from_pretrained(
            transformers.BertForMaskedLM, checkpoint, gradient_checkpointing=True
        )
        assert model.training and is_gradient_checkpointing(model)
        ids = _batch(rank, -1)
        # Every parameter gets a gradient, so DDP needs no find_unused_parameters=True.
        assert fastload.unused_parameters(model, input_ids=ids, labels=ids) == []
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        for step in range(STEPS):
            ids = _batch(rank, step)
            loss = ddp(input_ids=ids, labels=ids).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        fastload.save_pretrained(ddp, Path(out_dir) / f"rank{rank}")
    finally:
        leave_group()


def _run_ranks(*args: object) -> None:
    run_ranks(_train, args, world=WORLD, timeout_s=TIMEOUT_S, what="DDP")


def test_two_ddp_ranks_training_a_fastload_model_with_checkpointing_end_identical(
    tmp_path: Path,
) -> None:
    initial = _tiny_bert()
    fastload.save_pretrained(initial, tmp_path / "initial")
    _run_ranks(free_port(), str(tmp_path / "initial"), str(tmp_path))
    weights = [st_load_file(tmp_path / f"rank{r}" / "model.safetensors") for r in range(WORLD)]
    start = st_load_file(tmp_path / "initial" / "model.safetensors")
    assert sorted(weights[0]) == sorted(weights[1]) == sorted(start)
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name
    changed = [n for n, t in weights[0].items() if not torch.equal(t, start[n])]
    assert "bert.embeddings.word_embeddings.weight" in changed  # the tied embedding trained
    assert len(changed) == len(start)  # every parameter moved: none was left out of the graph
