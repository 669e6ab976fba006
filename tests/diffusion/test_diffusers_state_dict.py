"""A diffusers model from a config and a state dict: ``fastload.from_pretrained(cls, None,
config=..., state_dict=...)``, as the transformers front serves it for its classes.

The model is the one diffusers loads from the same tensors saved with ``save_pretrained`` (class,
config, every tensor bitwise with its dtype, one forward), under diffusers' dtype rules
(``_keep_in_fp32_modules``); its tensors are its own (allocated once, in a fresh interpreter
measured from the OS: the peak grows by about the model, not twice it), not the caller's.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import fastload  # noqa: E402
from fastload.core.basics.errors import RequestError  # noqa: E402

TESTS = Path(__file__).resolve().parent
for where in (TESTS, TESTS.parent / "support"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

from fresh import run_script  # noqa: E402
from test_diffusers_models import MODELS, _build, _forward, _wan  # noqa: E402


def _reference(kind: str, where: Path) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """A model with random weights, the model diffusers loads from its saved folder, and its
    tensors as a state dict (copies)."""
    model = _build(kind).eval()
    model.save_pretrained(where)
    state_dict = {k: v.clone() for k, v in model.state_dict().items()}
    return model, type(model).from_pretrained(where), state_dict


def _same_model(ours: Any, theirs: Any, config: dict[str, Any]) -> None:
    """Class, every tensor, its dtype and device as diffusers' load; the config diffusers' own
    ``from_config`` makes of ``config`` (no ``_name_or_path``: no folder was named)."""
    assert type(ours) is type(theirs)
    with torch.device("meta"):
        assert dict(ours.config) == dict(type(ours).from_config(config).config)
    assert "_name_or_path" not in ours.config
    mine, other = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(other)
    for name, tensor in other.items():
        got = mine[name]
        assert (got.dtype, got.device, got.shape) == (tensor.dtype, tensor.device, tensor.shape)
        assert torch.equal(got, tensor), name
    assert ours.training is theirs.training is False


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_state_dict_loads_as_diffusers_loads_its_saved_folder(kind: str, tmp_path: Path) -> None:
    model, theirs, state_dict = _reference(kind, tmp_path / kind)
    config = type(model).load_config(tmp_path / kind)  # as a user reads a config
    ours = fastload.from_pretrained(type(model), None, config=config, state_dict=state_dict)
    _same_model(ours, theirs, config)
    # the same output as the model the tensors came from (diffusers' load gives views of the
    # file, whose alignment can change a float32 matmul's last bits; the weights are equal above)
    assert torch.equal(_forward(kind, ours), _forward(kind, model))
    torch.testing.assert_close(_forward(kind, ours), _forward(kind, theirs))
    # the model's tensors are its own: the caller's dict is not aliased
    given = {t.untyped_storage().data_ptr() for t in state_dict.values()}
    assert not given & {t.untyped_storage().data_ptr() for t in ours.state_dict().values()}


def test_a_dtype_converts_as_diffusers_keeping_its_fp32_modules(tmp_path: Path) -> None:
    model = _build("wan")
    model.save_pretrained(tmp_path / "wan")
    theirs = type(model).from_pretrained(tmp_path / "wan", torch_dtype=torch.float16)
    config = dict(model.config)  # the live model's config, as given
    ours = fastload.from_pretrained(
        type(model), None, config=config, state_dict=model.state_dict(), dtype=torch.float16
    )
    _same_model(ours, theirs, config)
    assert {t.dtype for t in ours.state_dict().values()} == {torch.float16, torch.float32}
    assert _wan()[0]._keep_in_fp32_modules  # the rule this test exercises is there


def test_missing_and_unused_tensors_are_reported_and_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _build("vae")
    state_dict = dict(model.state_dict())
    state_dict.pop("decoder.conv_out.bias")
    state_dict["decoder.extra.weight"] = torch.ones(2)
    with caplog.at_level(logging.WARNING, logger="diffusers"):
        ours, report = fastload.from_pretrained(
            type(model), None, config=model.config, state_dict=state_dict, output_loading_info=True
        )
    assert report.missing == ["decoder.conv_out.bias"]
    assert report.unexpected == ["decoder.extra.weight"]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("diffusers")]
    assert any("checkpoint at state_dict were not used" in m for m in said)
    assert not ours.decoder.conv_out.bias.is_meta


def test_a_state_dict_needs_a_config_and_no_path(tmp_path: Path) -> None:
    cls = diffusers.AutoencoderKL
    with pytest.raises(RequestError, match="state_dict= needs config="):
        fastload.from_pretrained(cls, None, state_dict={"w": torch.zeros(1)})
    with pytest.raises(RequestError, match="either a path or state_dict="):
        fastload.from_pretrained(cls, tmp_path, config={}, state_dict={"w": torch.zeros(1)})


@pytest.mark.parametrize(
    "option", [{"subfolder": "vae"}, {"variant": "fp16"}, {"revision": "main"}]
)
def test_options_that_locate_files_are_refused_with_a_state_dict(option: dict[str, str]) -> None:
    (name,) = option
    with pytest.raises(RequestError, match=rf"AutoencoderKL: {name} locate checkpoint files"):
        fastload.from_pretrained(
            diffusers.AutoencoderKL, None, config={}, state_dict={"w": torch.zeros(1)}, **option
        )


def test_the_tensors_are_allocated_once() -> None:
    """In a fresh interpreter, the peak resident memory of the load (reset just before it) grows
    by about the model's bytes: its tensors are allocated once and filled, not built and then
    replaced (diffusers' own from_config + load_state_dict also initializes them first)."""
    out = run_script(
        """
        import re, torch, diffusers, fastload

        def rss(field):
            text = open("/proc/self/status").read()
            return int(re.search(field + r":\\s+(\\d+) kB", text).group(1)) * 1024

        config = {"patch_size": 1, "in_channels": 4, "num_layers": 2, "num_single_layers": 6,
                  "attention_head_dim": 64, "num_attention_heads": 8, "joint_attention_dim": 64,
                  "pooled_projection_dim": 32, "axes_dims_rope": [8, 28, 28]}
        cls = diffusers.FluxTransformer2DModel
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in cls.from_config(config).state_dict().items()}
        state_dict = {k: torch.randn(s) for k, s in shapes.items()}
        nbytes = sum(t.nbytes for t in state_dict.values())
        open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
        before = rss("VmRSS")
        model = fastload.from_pretrained(cls, None, config=config, state_dict=state_dict)
        grown = rss("VmHWM") - before
        assert all(torch.equal(model.state_dict()[k], t) for k, t in state_dict.items())
        print(nbytes, grown)
        """
    )
    nbytes, grown = map(int, out.split())
    assert nbytes > 150 * 2**20
    # once: the model plus interpreter noise; twice would be 2x nbytes
    assert grown < 1.4 * nbytes, (grown, nbytes)
