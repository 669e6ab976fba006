"""The load's options as one record: validated once, defaults from one table, and an explicit
default told apart from an omitted option."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

import fastload
from fastload import api
from fastload.core.basics.errors import RequestError, UnsupportedError
from fastload.core.plan.load_options import DEFAULTS, OPTION_NAMES, LoadOptions


def test_every_typed_overload_of_from_pretrained_declares_exactly_the_load_options() -> None:
    own = {"output_loading_info", "config", "state_dict"}
    overloads = typing.get_overloads(api.from_pretrained)
    assert len(overloads) == 4
    for overload in overloads:
        params = inspect.signature(overload).parameters.values()
        options = {p.name for p in params if p.kind is p.KEYWORD_ONLY} - own
        assert options == set(OPTION_NAMES)


def test_the_public_signature_shows_every_option_with_its_default() -> None:
    params = inspect.signature(fastload.from_pretrained).parameters
    assert {name: params[name].default for name in OPTION_NAMES} == DEFAULTS
    assert params["device"].default == "cpu" and params["mmap"].default == "auto"


def test_options_are_parsed_once_into_typed_values() -> None:
    options = LoadOptions.create(device="cpu", dtype="bfloat16", strict=True, threads=2)
    assert options.device == torch.device("cpu")
    assert options.dtype is torch.bfloat16
    assert (options.missing, options.unexpected) == ("error", "error")
    assert options.threads == 2
    assert LoadOptions.create(dtype="stored").dtype is None
    assert LoadOptions.create().dtype == "auto"


def test_max_memory_alone_asks_for_a_planned_device_map() -> None:
    assert LoadOptions.create(max_memory={"cpu": "1GB"}).device_map == "auto"


def test_the_record_is_frozen() -> None:
    options = LoadOptions.create()
    with pytest.raises(AttributeError):
        options.device = torch.device("meta")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("given", "error", "match"),
    [
        ({"nonsense": 1}, TypeError, "unknown load options"),
        ({"progress": "yes"}, TypeError, "progress"),
        ({"read_mode": "fast"}, RequestError, "read_mode"),
        ({"mmap": "never"}, RequestError, "mmap"),
        ({"dtype": torch.int8}, RequestError, "floating-point"),
        ({"threads": 0}, RequestError, "threads"),
        ({"device": "meta"}, RequestError, "meta"),
        ({"device_map": "auto", "tp_plan": "llama"}, UnsupportedError, "tp_plan"),
        ({"process_group": object(), "device_map": "auto"}, UnsupportedError, "process_group"),
        ({"staging_bytes": 0}, RequestError, "staging_bytes"),
    ],
)
def test_a_bad_option_is_refused_when_the_record_is_made(
    given: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        LoadOptions.create(**given)


def test_defaults_from_another_spelling_fill_only_what_the_caller_left_out() -> None:
    explicit = LoadOptions.create(dtype="auto").with_defaults(dtype=torch.float16)
    assert explicit.dtype == "auto"  # given, even though it is the default value
    omitted = LoadOptions.create().with_defaults(dtype=torch.float16, read_mode="mmap")
    assert omitted.dtype is torch.float16 and omitted.read_mode == "mmap"
    with pytest.raises(RequestError, match="read_mode"):
        LoadOptions.create().with_defaults(read_mode="fast")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tiny_models import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


def _dtypes(model: nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


def test_an_explicit_dtype_auto_wins_over_transformers_torch_dtype(llama: Path) -> None:
    # transformers: dtype, when given, wins over its deprecated alias torch_dtype
    model = fastload.from_pretrained(llama, dtype="auto", torch_dtype=torch.float16)
    assert _dtypes(model) == {torch.float32}
    model = fastload.from_pretrained(llama, torch_dtype=torch.float16)
    assert _dtypes(model) == {torch.float16}
