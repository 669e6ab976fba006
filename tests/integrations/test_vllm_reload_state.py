"""The decisions a vLLM reload makes before anything moves
(:mod:`fastload.integrations.vllm.reload_state`), on their own: which tensors are left out as
unchanged (vLLM's layer as the unit: a fused parameter's inputs go together), what a checkpoint
must match, what a call naming a path or none reads. No vLLM needed; the engine-level behaviour is
tests/integrations/test_vllm_reload.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fastload.core.basics.errors import CheckpointError, ModelMismatchError, RequestError
from fastload.integrations.vllm.reload_state import (
    Held,
    check_fits,
    choose_source,
    moved,
    sample_layers,
    unchanged,
)

Q, K, V = (f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv")
GATE, UP = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
NORM = "model.norm.weight"
QKV, GATE_UP, FINAL = (
    "model.layers.0.self_attn.qkv_proj",
    "model.layers.0.mlp.gate_up_proj",
    "model.norm",
)


def _held(**overrides: object) -> Held:
    catalog = {n: ("BF16", (8, 8), "shard") for n in (Q, K, V, GATE, UP, NORM)}
    feeds = {Q: {QKV}, K: {QKV}, V: {QKV}, GATE: {GATE_UP}, UP: {GATE_UP}, NORM: {FINAL}}
    record = Held(
        model_arg="/srv/model",
        source="/srv/model",
        catalog=catalog,
        digests={n: f"blake2b-128:{n}" for n in catalog},
        feeds={k: frozenset(v) for k, v in feeds.items()},
        numel={},
    )
    for key, value in overrides.items():
        setattr(record, key, value)
    return record


def test_a_changed_input_of_a_fused_layer_brings_its_other_inputs_along() -> None:
    record = _held()
    new = dict(record.digests, **{Q: "blake2b-128:new"})
    assert unchanged(record, record.catalog or {}, new) == {GATE, UP, NORM}


def test_every_tensor_is_left_out_when_no_digest_changed() -> None:
    record = _held()
    assert unchanged(record, record.catalog or {}, dict(record.digests)) == set(record.digests)


def test_nothing_is_left_out_without_digests_on_either_side() -> None:
    record = _held()
    assert unchanged(record, record.catalog or {}, {}) == set()
    assert unchanged(_held(digests={}), record.catalog or {}, dict(record.digests)) == set()


def test_a_changed_tensor_whose_layers_are_unknown_leaves_nothing_out() -> None:
    # its copies were not seen at the first load (a model that buffers): it may feed any layer
    record = _held(feeds={K: frozenset({QKV}), V: frozenset({QKV})})
    new = dict(record.digests, **{Q: "blake2b-128:new"})
    assert unchanged(record, record.catalog or {}, new) == set()


def test_a_layer_written_since_is_read_whatever_the_digests() -> None:
    record = _held()
    assert unchanged(record, record.catalog or {}, dict(record.digests), {GATE_UP}) == {
        Q,
        K,
        V,
        NORM,
    }


def test_a_stored_dtype_change_is_not_unchanged() -> None:
    record = _held()
    new = dict(record.catalog or {}, **{NORM: ("F32", (8, 8), "shard")})
    assert NORM not in unchanged(record, new, dict(record.digests))


def test_the_sample_of_a_layer_tells_a_write_into_it() -> None:
    model = nn.Module()
    model.add_module("norm", nn.LayerNorm(1000))
    record = _held(feeds={NORM: frozenset({"norm"})})
    sample_layers(model, record, {"norm"})
    assert moved(model, record) == set()
    with torch.no_grad():
        model.norm.weight.zero_()
    assert moved(model, record) == {"norm"}


def test_a_checkpoint_that_does_not_fit_is_refused_naming_each_tensor() -> None:
    old = _held().catalog or {}
    new = {n: v for n, v in old.items() if n != UP}
    new[Q] = ("BF16", (16, 4), "shard-1")
    new["model.extra.weight"] = ("BF16", (2,), "shard-2")
    with pytest.raises(ModelMismatchError) as e:
        check_fits(new, old, "/srv/new", "/srv/model")
    message = str(e.value)
    assert f"shard-1: tensor {Q!r} has shape [16, 4]" in message
    assert repr(UP) in message and "'model.extra.weight'" in message
    assert "refused it before writing anything" in message
    new = dict(old, **{NORM: ("I32", (8, 8), "shard-3")})
    with pytest.raises(CheckpointError, match=rf"shard-3: tensor {NORM!r} is stored as I32"):
        check_fits(new, old, "/srv/new", "/srv/model")
    check_fits(dict(old, **{NORM: ("F32", (8, 8), "s")}), old, "/srv/new", "/srv/model")


def test_a_call_naming_no_path_reads_what_the_engine_holds(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    record = _held(model_arg=str(config), source="s3://bucket/step-1/")
    assert choose_source(str(config), record, "s3://bucket/step-0/") == "s3://bucket/step-1/"
    assert choose_source("s3://bucket/step-2/", record, "s3://bucket/step-0/") == (
        "s3://bucket/step-2/"
    )
    (config / "model.safetensors").write_bytes(b"")
    with pytest.raises(RequestError, match="'weights' option"):
        choose_source(str(config), record, "s3://bucket/step-0/")
    # without the option the model argument is the checkpoint itself
    assert choose_source(str(config), _held(model_arg=str(config), source=str(config)), None) == (
        str(config)
    )
