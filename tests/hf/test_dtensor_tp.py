"""fastload.hf.dtensor_tp: a meta skeleton sharded by ``shard_like_transformers`` and filled from
the stored tensors by the returned selections is transformers' own ``from_pretrained(tp_plan=
"auto")`` model: same DTensors, placements, meshes, hooks, attributes, local shards and logits.

The rank tests spawn 2 gloo ranks on CPU (loopback only, bounded by TIMEOUT_S). ``WORLD_SIZE`` is
set in each rank's environment: transformers derives ``tp_size`` from it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import free_port, leave_group, run_ranks
from tiny_models import example_inputs, make_checkpoint

from fastload.core.basics.errors import UnsupportedError
from fastload.hf.dtensor_tp import Selection, resolve_tp_options

WORLD = 2
TIMEOUT_S = 300

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _skip_without_dtensor() -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    try:
        import torch.distributed.tensor  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"DTensor is not available: {exc}")


# --- without ranks ------------------------------------------------------------------------------


def test_no_tp_option_resolves_to_none() -> None:
    assert resolve_tp_options() is None
    assert resolve_tp_options(device_mesh=object()) is None  # transformers 5.25 ignores it too


def test_standalone_options_with_a_distributed_config_are_refused_as_transformers_does() -> None:
    from transformers.distributed import DistributedConfig

    with pytest.raises(ValueError, match="not both"):
        resolve_tp_options(tp_plan="auto", distributed_config=DistributedConfig(tp_size=2))


@pytest.mark.parametrize("size", ["fsdp_size", "pp_size", "dp_replicate_size"])
def test_other_parallelisms_are_refused(size: str) -> None:
    with pytest.raises(UnsupportedError, match=size):
        resolve_tp_options(distributed_config={"tp_size": 2, size: 2})


def test_a_selection_takes_its_ranges_along_its_dim() -> None:
    full = torch.arange(24).reshape(6, 4)
    contiguous = Selection(0, ((3, 6),))
    assert contiguous.span == (0, 3, 6) and contiguous.length == 3
    assert torch.equal(contiguous.take(full), full[3:6])
    packed = Selection(1, ((0, 1), (2, 3)))
    assert packed.span is None and packed.length == 2
    assert torch.equal(packed.take(full), full[:, [0, 2]])
    assert Selection(0, ((6, 6),)).take(full).shape == (0, 4)


# --- 2 gloo ranks -------------------------------------------------------------------------------


def _style_of(module: torch.nn.Module) -> Any:
    """The parallel style whose ``install_forward`` replaced ``module.forward`` (or None)."""
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    forward = module.__dict__.get("forward")
    if forward is None:
        return None
    cells = [c.cell_contents for c in forward.__closure__ or ()]
    styles = [c for c in cells if isinstance(c, TensorParallelLayer)]
    assert len(styles) == 1, f"{forward} closes over {styles}"
    return styles[0]


def _assert_like_transformers(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    assert ours._tp_plan == ref._tp_plan
    assert ours._tp_size == ref._tp_size == WORLD
    assert (
        ours._is_distributed_loading_by_transformers and ref._is_distributed_loading_by_transformers
    )
    assert ours._device_mesh.shape == ref._device_mesh.shape
    assert ours._device_mesh.mesh_dim_names == ref._device_mesh.mesh_dim_names
    assert ours._device_mesh.mesh.tolist() == ref._device_mesh.mesh.tolist()
    assert ours.config.distributed_config.to_dict() == ref.config.distributed_config.to_dict()
    assert ours.training == ref.training

    a = dict(ours.named_parameters(remove_duplicate=False))
    e = dict(ref.named_parameters(remove_duplicate=False))
    assert list(a) == list(e)
    sharded = 0
    for name, x in a.items():
        y = e[name]
        assert type(x) is type(y) and type(x.data) is type(y.data), name
        assert x.requires_grad == y.requires_grad, name
        assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device, name
        if isinstance(y, DTensor):
            sharded += 1
            assert x.placements == y.placements, name
            assert x.device_mesh.shape == y.device_mesh.shape, name
            assert x.device_mesh.mesh_dim_names == y.device_mesh.mesh_dim_names, name
            assert x.stride() == y.stride(), name
            x, y = x.to_local(), y.to_local()
        assert x.shape == y.shape and torch.equal(x, y), f"{name}: local shards differ"
    assert sharded >= 16, "the Llama plan shards q/k/v/o/gate/up/down, the embedding and lm_head"
    tied = ref.lm_head.weight is ref.model.embed_tokens.weight
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied

    buffers_a, buffers_e = dict(ours.named_buffers()), dict(ref.named_buffers())
    assert list(buffers_a) == list(buffers_e)
    for name, b in buffers_e.items():
        assert buffers_a[name].device == b.device and torch.equal(buffers_a[name], b), name

    modules_a, modules_e = dict(ours.named_modules()), dict(ref.named_modules())
    assert list(modules_a) == list(modules_e)
    hooked = 0
    for name, m in modules_e.items():
        o = modules_a[name]
        assert getattr(o, "_is_hooked", False) == getattr(m, "_is_hooked", False), name
        assert _style_of(o) is _style_of(m), name  # the same registered style object
        hooked += _style_of(m) is not None
        assert len(o._forward_pre_hooks) == len(m._forward_pre_hooks), name
        assert len(o._forward_hooks) == len(m._forward_hooks), name
    assert hooked == 7 * ref.config.num_hidden_layers + 2  # q k v o gate up down, embed, head


def _check_selections(model: torch.nn.Module, shards: dict, full: dict, rank: int) -> None:
    """Each selection is what transformers' DtensorShardOperation reads from the full tensor."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed.sharding_utils import DtensorShardOperation

    params = dict(model.named_parameters())
    for name, shard in shards.items():
        param = params.get(name)
        if isinstance(param, DTensor):
            expected = DtensorShardOperation(param).shard_tensor(full[name])
            whole = all(p.is_replicate() for p in param.placements)
            assert (shard.selection is None) == whole, name  # e.g. a rowwise bias is replicated
            part = full[name] if whole else shard.selection.take(full[name])
            assert torch.equal(part, expected), name
        else:
            assert shard.selection is None, name
    # 99 vocabulary rows over 2 ranks: 50 then 49 (uneven); o_proj is split on its inputs
    embed = shards["model.embed_tokens.weight"].selection
    assert embed.span == ((0, 0, 50) if rank == 0 else (0, 50, 99))
    o_proj = shards["model.layers.0.self_attn.o_proj.weight"].selection
    assert o_proj.span == ((1, 0, 16) if rank == 0 else (1, 16, 32))


def _check_packed_and_uneven(mesh: Any, rank: int) -> None:
    """Selections of placements the Llama plan does not use, against transformers' own reads."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from transformers.distributed.sharding_utils import DtensorShardOperation

    from fastload.hf.dtensor_tp import dtensor_selection

    cases = [
        ((8, 4), _StridedShard(0, split_factor=2)),  # packed gate/up: a quarter of each half
        ((4, 6), _StridedShard(1, split_factor=2)),  # packed rowwise
        ((3, 4), Shard(0)),  # 2 rows then 1
        ((1, 4), Shard(0)),  # 1 row then none
    ]
    for shape, placement in cases:
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        meta = torch.empty(shape, device="meta")
        param = distribute_tensor(meta, mesh, [placement], src_data_rank=None)
        selection = dtensor_selection("case", param)
        expected = DtensorShardOperation(param).shard_tensor(full)
        part = full if selection is None else selection.take(full)  # None: the whole tensor
        assert torch.equal(part, expected), (shape, placement)
        assert part.shape == param._local_tensor.shape
    # a 1-row tensor over 2 ranks: rank 0 holds it whole, rank 1 an empty shard
    one_row = distribute_tensor(
        torch.empty(1, 4, device="meta"), mesh, [Shard(0)], src_data_rank=None
    )
    assert dtensor_selection("one_row", one_row) == (None if rank == 0 else Selection(0, ((0, 0),)))
    packed = dtensor_selection(
        "gate_up",
        distribute_tensor(
            torch.empty(8, 4, device="meta"),
            mesh,
            [_StridedShard(0, split_factor=2)],
            src_data_rank=None,
        ),
    )
    assert packed == Selection(0, ((0, 2), (4, 6)) if rank == 0 else ((2, 4), (6, 8)))


def _rank(rank: int, port: int, directories: list[str]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(WORLD),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    sys.path.insert(0, str(Path(__file__).parents[1] / "support"))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from safetensors.torch import load_file
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.distributed import DistributedConfig

        from fastload.hf.dtensor_tp import finish_like_transformers, shard_like_transformers

        variants: list[dict[str, Any]] = [
            {"tp_plan": "auto"},
            {"tp_size": WORLD},
            {"distributed_config": DistributedConfig(tp_size=WORLD)},
            {"distributed_config": {"tp_plan": "auto"}, "device_mesh": None},
        ]
        for directory, options in zip(directories, variants, strict=False):
            ref = LlamaForCausalLM.from_pretrained(directory, **options)

            setup = resolve_tp_options(**options)
            assert setup is not None and setup.device == torch.device("cpu")
            config = LlamaConfig.from_pretrained(directory)
            with torch.device("meta"):
                ours = LlamaForCausalLM(config)
            shards = shard_like_transformers(ours, setup)
            full = load_file(str(Path(directory) / "model.safetensors"))
            assert set(shards) == set(full), set(shards) ^ set(full)
            for name, shard in shards.items():
                shard.fill_from(full[name])
            finish_like_transformers(ours, setup)

            _assert_like_transformers(ours, ref)
            _check_selections(ours, shards, full, rank)
            inputs = example_inputs(ref)
            with torch.no_grad():
                expected = ref(**inputs).logits
                actual = ours(**inputs).logits
            assert torch.equal(actual, expected), "logits differ"
            # the same call shape through fastload (a collective load) and under its patch
            import fastload

            loaded = fastload.from_pretrained(
                LlamaForCausalLM, directory, progress=False, **options
            )
            with fastload.patch_transformers():
                patched = LlamaForCausalLM.from_pretrained(directory, **options)
            for model in (loaded, patched):
                _assert_like_transformers(model, ref)
                with torch.no_grad():
                    assert torch.equal(model(**inputs).logits, expected), "fastload's logits differ"
            unsharded = LlamaForCausalLM.from_pretrained(directory)
            with torch.no_grad():
                torch.testing.assert_close(actual, unsharded(**inputs).logits)
        _check_packed_and_uneven(setup.tp_mesh, rank)
    finally:
        leave_group()


def test_a_sharded_skeleton_filled_by_selections_is_transformers_tp_model(tmp_path: Path) -> None:
    _skip_without_dtensor()
    directories = [
        str(make_checkpoint(tmp_path / "untied", "LlamaForCausalLM")),
        str(make_checkpoint(tmp_path / "tied", "LlamaForCausalLM", tie_word_embeddings=True)),
        str(make_checkpoint(tmp_path / "bias", "LlamaForCausalLM", attention_bias=True, seed=1)),
        str(make_checkpoint(tmp_path / "mlp_bias", "LlamaForCausalLM", mlp_bias=True, seed=2)),
    ]
    run_ranks(
        _rank, (free_port(), directories), world=WORLD, timeout_s=TIMEOUT_S, what="dtensor_tp"
    )
