"""Tensor-parallel loading: plans and selections as pure functions, then a real 2-rank gloo run on
CPU (spawned here, loopback only, bounded by TIMEOUT_S) in which each rank reads only its shards."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import free_port, leave_group, run_ranks, tcp_bytes_received
from torch import nn

import fastload
from fastload.core.basics.errors import RequestError, UnsupportedError
from fastload.distributed.tensor_parallel import (
    LLAMA_TP_PLAN,
    TPLayout,
    resolve_tp_plan,
    shard_selections,
)

WORLD = 2
TIMEOUT_S = 120
IN, HIDDEN = 256, 1024  # each MLP weight is 1 MiB in float32: large enough to see bytes read
MLP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


# --- plans and selections ----------------------------------------------------------------------

LLAMA_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def test_the_llama_plan_splits_projections_and_replicates_embeddings_and_norms() -> None:
    layout = TPLayout(LLAMA_TP_PLAN, 0, 2)
    styles = {n.split(".")[-2]: layout.style(n) for n in LLAMA_NAMES}
    assert styles == {
        "embed_tokens": "replicate",
        "q_proj": "colwise",
        "k_proj": "colwise",
        "v_proj": "colwise",
        "o_proj": "rowwise",
        "gate_proj": "colwise",
        "up_proj": "colwise",
        "down_proj": "rowwise",
        "input_layernorm": "replicate",
        "post_attention_layernorm": "replicate",
        "norm": "replicate",
        "lm_head": "replicate",
    }


def test_colwise_splits_weight_and_bias_along_the_output_features() -> None:
    shapes = {"fc1.weight": (8, 4), "fc1.bias": (8,)}
    assert shard_selections(MLP_PLAN, shapes, 1, 2) == {
        "fc1.weight": [0, 4, 8],
        "fc1.bias": [0, 4, 8],
    }


def test_rowwise_splits_the_weight_along_the_input_features_and_replicates_the_bias() -> None:
    shapes = {"fc2.weight": (4, 8), "fc2.bias": (4,)}
    assert shard_selections(MLP_PLAN, shapes, 0, 2) == {"fc2.weight": [1, 0, 4], "fc2.bias": None}


def test_every_rank_gets_an_equal_disjoint_share_that_covers_the_tensor() -> None:
    ranges = [
        shard_selections(MLP_PLAN, {"fc1.weight": (12, 3)}, r, 4)["fc1.weight"] for r in range(4)
    ]
    assert ranges == [[0, 0, 3], [0, 3, 6], [0, 6, 9], [0, 9, 12]]


def test_a_size_the_world_does_not_divide_is_an_error_naming_the_tensor() -> None:
    with pytest.raises(RequestError, match=r"'fc1\.weight' has size 10 along dim 0.*3 ranks"):
        shard_selections(MLP_PLAN, {"fc1.weight": (10, 4)}, 0, 3)


def test_names_no_pattern_matches_are_replicated() -> None:
    assert shard_selections(MLP_PLAN, {"head.weight": (8, 8)}, 0, 2) == {"head.weight": None}


def test_a_star_matches_within_one_name_component_only() -> None:
    layout = TPLayout({"layers.*.fc": "colwise"}, 0, 2)
    assert layout.style("model.layers.3.fc.weight") == "colwise"
    assert layout.style("model.layers.3.sub.fc.weight") == "replicate"


def test_the_first_matching_pattern_decides() -> None:
    layout = TPLayout({"layers.0.fc": "replicate", "layers.*.fc": "colwise"}, 0, 2)
    assert layout.style("layers.0.fc.weight") == "replicate"
    assert layout.style("layers.1.fc.weight") == "colwise"


def test_a_style_fastload_does_not_implement_is_unsupported() -> None:
    with pytest.raises(UnsupportedError, match="colwise_gather_output"):
        TPLayout({"lm_head": "colwise_gather_output"}, 0, 2)


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(RequestError, match="rank 2"):
        TPLayout(MLP_PLAN, 2, 2)


def test_the_auto_plan_is_the_one_the_transformers_config_declares() -> None:
    transformers = pytest.importorskip("transformers")
    from tiny_models import make_config

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(make_config("llama"))
    assert resolve_tp_plan("auto", model) == dict(model.config.base_model_tp_plan)


def test_loading_with_a_plan_outside_torch_distributed_is_refused(tmp_path: Path) -> None:
    fastload.save_file(MLP().state_dict(), tmp_path / "model.safetensors")
    with pytest.raises(RequestError, match="init_process_group"):
        fastload.from_pretrained(MLP, tmp_path, tp_plan=MLP_PLAN)


# --- a real 2-rank run -------------------------------------------------------------------------


def _rchar() -> int | None:
    """Bytes this process has read through read()/pread() so far (Linux), or None."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration):
        return None


def _mlp_input() -> torch.Tensor:
    return torch.randn(3, IN, generator=torch.Generator().manual_seed(1))


def _rank(rank: int, port: int, mlp_dir: str, llama_dir: str, out_dir: str) -> None:
    """One rank: load both checkpoints sharded, run them, save what the tests check."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)  # two ranks on a small machine
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S // 2)
    )
    try:
        # The first load imports what loading needs; the second is measured.
        # mmap="copy": rchar counts read calls, and by default the replicated tensors would be
        # views of the file, read by page faults instead.
        fastload.from_pretrained(MLP, mlp_dir, tp_plan=MLP_PLAN, progress=False, mmap="copy")
        before, tcp_before = _rchar(), tcp_bytes_received()
        model, report = fastload.from_pretrained(
            MLP, mlp_dir, tp_plan=MLP_PLAN, output_loading_info=True, progress=False, mmap="copy"
        )
        after, tcp_after = _rchar(), tcp_bytes_received()
        x = _mlp_input()
        with torch.no_grad():
            out = model(x)
            # The Megatron MLP by hand: column-parallel, then row-parallel and an all-reduce.
            w1, b1 = model.fc1.weight, model.fc1.bias
            w2, b2 = model.fc2.weight, model.fc2.bias
            partial = nn.functional.linear(nn.functional.gelu(nn.functional.linear(x, w1, b1)), w2)
            dist.all_reduce(partial)
            manual = partial + b2

        # Backward through the parallel MLP: gradients of the input and of the shards.
        xg = _mlp_input().requires_grad_()
        model(xg).square().sum().backward()
        grads = {"x": xg.grad, **{n: p.grad for n, p in model.named_parameters()}}

        import transformers
        from tiny_models import example_inputs

        llama, llama_report = fastload.from_pretrained(
            transformers.LlamaForCausalLM,
            llama_dir,
            tp_plan="llama",
            output_loading_info=True,
            progress=False,
        )
        with torch.no_grad():
            logits = llama(**example_inputs(llama)).logits
        torch.save(
            {
                "mlp": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "bytes_read": report.bytes_read,
                "bytes_received": report.bytes_received,
                "report_rank": (report.rank, report.world_size),
                "rchar": None if before is None or after is None else after - before,
                "tcp": None if tcp_before is None or tcp_after is None else tcp_after - tcp_before,
                "out": out,
                "manual": manual,
                "grads": grads,
                "llama": {k: v.detach().clone() for k, v in llama.state_dict().items()},
                "llama_bytes_read": llama_report.bytes_read,
                "llama_logits": logits,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        leave_group()


def _run_ranks(*args: object) -> None:
    run_ranks(_rank, args, world=WORLD, timeout_s=TIMEOUT_S, what="tensor-parallel")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both checkpoints, their unsharded models, and what each rank saved."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("transformers")
    from tiny_models import make_checkpoint, make_model

    root = tmp_path_factory.mktemp("tp")
    torch.manual_seed(0)
    mlp = MLP().eval()
    (root / "mlp").mkdir()
    fastload.save_file(mlp.state_dict(), root / "mlp" / "model.safetensors")
    make_checkpoint(root / "llama", "LlamaForCausalLM")
    _run_ranks(free_port(), str(root / "mlp"), str(root / "llama"), str(root))
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return {
        "mlp": mlp,
        "llama": make_model("LlamaForCausalLM"),
        "ranks": ranks,
        "mlp_file_bytes": (root / "mlp" / "model.safetensors").stat().st_size,
    }


def test_each_ranks_shards_concatenated_equal_the_full_tensors(run: dict[str, Any]) -> None:
    full = run["mlp"].state_dict()
    shards = [r["mlp"] for r in run["ranks"]]
    assert torch.equal(torch.cat([s["fc1.weight"] for s in shards], 0), full["fc1.weight"])
    assert torch.equal(torch.cat([s["fc1.bias"] for s in shards], 0), full["fc1.bias"])
    assert torch.equal(torch.cat([s["fc2.weight"] for s in shards], 1), full["fc2.weight"])
    for s in shards:
        assert torch.equal(s["fc2.bias"], full["fc2.bias"])  # rowwise bias: replicated


def test_llama_shards_concatenated_equal_the_full_tensors(run: dict[str, Any]) -> None:
    full = run["llama"].state_dict()
    shards = [r["llama"] for r in run["ranks"]]
    for name, tensor in full.items():
        style = TPLayout(LLAMA_TP_PLAN, 0, WORLD).style(name)
        if style == "replicate" or tensor.dim() == 1:
            parts = [s[name] for s in shards]
            assert all(torch.equal(p, tensor) for p in parts), name
            continue
        dim = 0 if style == "colwise" else 1
        assert shards[0][name].shape[dim] == tensor.shape[dim] // WORLD, name
        assert torch.equal(torch.cat([s[name] for s in shards], dim), tensor), name


def test_each_rank_reads_about_half_of_the_bytes_and_receives_only_what_it_keeps(
    run: dict[str, Any],
) -> None:
    # a tensor-parallel load is collective (fastload.distributed.collective): the ranks split the
    # reading, and each rank receives of the other's half only the bytes of its own shards
    # (fc1's rows, half of each row of fc2, fc2's bias whole): about a quarter of the checkpoint
    full = run["mlp"].state_dict()
    total = sum(v.numel() * v.element_size() for v in full.values())
    kept = sum(v.numel() * v.element_size() for v in run["ranks"][0]["mlp"].values())
    for rank, r in enumerate(run["ranks"]):
        assert r["report_rank"] == (rank, WORLD)
        assert r["bytes_read"] < 0.53 * total
        assert r["bytes_received"] < 0.3 * total, (r["bytes_received"], total)
        # what this rank keeps came from its own chunks or from the other's
        assert r["bytes_received"] >= kept - r["bytes_read"] - 3 * 4096
        # counted by the kernel at the rank's TCP sockets (gloo's), outside torch and fastload:
        # about what fastload says it received (a whole copy of the other's chunks before)
        if r["tcp"] is not None:
            assert r["bytes_received"] <= r["tcp"] < r["bytes_received"] + (256 << 10), r["tcp"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/io is Linux-only")
def test_the_bytes_a_rank_reads_from_the_file_match_its_report(run: dict[str, Any]) -> None:
    # Measured by the kernel (read/pread bytes of the process): the header plus this rank's part
    # of the file (bytes_read counts whole pages), never the whole file.
    for r in run["ranks"]:
        assert r["rchar"] is not None
        assert abs(r["rchar"] - r["bytes_read"]) <= 64 << 10
        assert r["rchar"] < 0.55 * run["mlp_file_bytes"]


def test_a_column_then_row_parallel_mlp_built_from_the_shards_matches_the_full_model(
    run: dict[str, Any],
) -> None:
    with torch.no_grad():
        expected = run["mlp"](_mlp_input())
    for r in run["ranks"]:
        torch.testing.assert_close(r["manual"], expected, rtol=1e-5, atol=1e-5)


def test_the_loaded_parallel_mlp_all_reduces_by_itself(run: dict[str, Any]) -> None:
    with torch.no_grad():
        expected = run["mlp"](_mlp_input())
    for r in run["ranks"]:
        torch.testing.assert_close(r["out"], expected, rtol=1e-5, atol=1e-5)


def test_gradients_through_the_parallel_mlp_are_the_shards_of_the_full_gradients(
    run: dict[str, Any],
) -> None:
    x = _mlp_input().requires_grad_()
    full = run["mlp"]
    full.zero_grad()
    full(x).square().sum().backward()
    for rank, r in enumerate(run["ranks"]):
        g = r["grads"]
        torch.testing.assert_close(g["x"], x.grad, rtol=1e-4, atol=1e-5)
        rows = slice(rank * HIDDEN // WORLD, (rank + 1) * HIDDEN // WORLD)
        torch.testing.assert_close(
            g["fc1.weight"], full.fc1.weight.grad[rows], rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(g["fc1.bias"], full.fc1.bias.grad[rows], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            g["fc2.weight"], full.fc2.weight.grad[:, rows], rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(g["fc2.bias"], full.fc2.bias.grad, rtol=1e-4, atol=1e-5)


def test_a_tensor_parallel_llama_gives_the_logits_of_the_full_model(run: dict[str, Any]) -> None:
    from tiny_models import example_inputs

    reference = run["llama"]
    with torch.no_grad():
        expected = reference(**example_inputs(reference)).logits
    for r in run["ranks"]:
        torch.testing.assert_close(r["llama_logits"], expected, rtol=1e-4, atol=1e-5)
