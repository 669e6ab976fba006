"""fastload.from_pretrained on plain nn.Modules (no transformers): classes, factories, built
modules, tied heads, the meta skeleton, initialization of missing tensors, failure atomicity;
and the options every load has: the report, progress bar, logging, dtype, read mode."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from safetensors.torch import save_model as st_save_model
from torch import nn

import fastload
from fastload import CheckpointError, FastloadError, RequestError
from fastload.core.model.skeleton import build_skeleton


class TiedLM(nn.Module):
    """A small language model whose output head shares the embedding matrix."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(12) * 3, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(ids))
        return self.head(self.norm(h.transpose(1, 2)).transpose(1, 2))


class Scaled(nn.Module):
    """A module with a parameter that nothing knows how to initialize."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))


def trained(seed: int = 0) -> TiedLM:
    torch.manual_seed(seed)
    model = TiedLM()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        model.norm.running_mean.normal_()
        model.norm.running_var.uniform_(0.5, 2.0)
        model.norm.num_batches_tracked.fill_(7)
    return model.eval()


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A TiedLM checkpoint written by safetensors' save_model (tied weights stored once)."""
    st_save_model(trained(), str(tmp_path / "model.safetensors"))
    return tmp_path


def stored(source: nn.Module | None = None, drop=lambda name: False) -> dict[str, torch.Tensor]:
    """The tensors of a TiedLM checkpoint (the tied head stored once), minus those ``drop``s."""
    source = trained() if source is None else source
    return {
        k: v.detach().clone()
        for k, v in source.state_dict().items()
        if k != "head.weight" and not drop(k)
    }


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_equal_state(model: nn.Module, expected: nn.Module) -> None:
    a, b = model.state_dict(), expected.state_dict()
    assert sorted(a) == sorted(b)
    for k in b:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def load(model, path, **kwargs):
    return fastload.from_pretrained(model, path, progress=False, output_loading_info=True, **kwargs)


# --- classes, factories, built modules, ties ------------------------------------------------


def test_plain_module_class_with_a_tied_head_loads_and_stays_tied(saved):
    model, report = load(TiedLM, saved, strict=True)
    assert_equal_state(model, trained())
    assert model.head.weight is model.embed.weight
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert report.tied == [["embed.weight", "head.weight"]]
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(ids), trained()(ids))


def test_plain_tie_survives_an_optimizer_step(saved):
    model, _ = load(TiedLM, saved)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.embed.weight.detach().clone()
    model(torch.tensor([[1, 2, 3]])).square().mean().backward()
    optimizer.step()
    assert model.head.weight is model.embed.weight
    assert not torch.equal(model.embed.weight.detach(), before)


def test_a_zero_argument_factory_is_called_to_build_the_model(saved):
    calls = []

    def factory() -> TiedLM:
        calls.append(1)
        return TiedLM()

    model, _ = load(factory, saved)
    assert calls == [1]
    assert_equal_state(model, trained())


def test_model_kwargs_are_passed_to_the_class(tmp_path):
    torch.manual_seed(0)
    st_save_model(TiedLM(vocab=30, width=8), str(tmp_path / "model.safetensors"))
    model, _ = load(TiedLM, tmp_path, vocab=30, width=8, strict=True)
    assert model.embed.weight.shape == (30, 8)


def test_an_already_built_module_is_loaded_in_place(saved):
    module = TiedLM()
    model, report = load(module, saved)
    assert model is module
    assert_equal_state(module, trained())
    assert module.head.weight is module.embed.weight


def test_the_tie_follows_whichever_member_the_checkpoint_holds(tmp_path):
    source = trained()
    tensors = {k: v for k, v in source.state_dict().items() if k != "embed.weight"}
    st_save_file(tensors, tmp_path / "model.safetensors")
    model, report = load(TiedLM, tmp_path, strict=True)
    assert model.embed.weight is model.head.weight
    assert torch.equal(model.embed.weight, source.head.weight)
    assert report.missing == []


def test_a_tie_stored_twice_with_equal_values_stays_tied(tmp_path):
    tensors = {k: v.clone() for k, v in trained().state_dict().items()}
    st_save_file(tensors, tmp_path / "model.safetensors")
    model, _ = load(TiedLM, tmp_path, strict=True)
    assert model.embed.weight is model.head.weight


def test_a_tie_stored_twice_with_different_values_is_untied_with_a_warning(tmp_path, caplog):
    tensors = {k: v.clone() for k, v in trained().state_dict().items()}
    tensors["head.weight"] = tensors["head.weight"] + 1
    st_save_file(tensors, tmp_path / "model.safetensors")
    model, report = load(TiedLM, tmp_path)
    assert model.embed.weight is not model.head.weight
    assert torch.equal(model.head.weight, tensors["head.weight"])
    assert torch.equal(model.embed.weight, tensors["embed.weight"])
    assert report.tied == []
    assert any("untied" in r.getMessage() for r in caplog.records if r.name == "fastload")


def test_persistent_buffers_load_and_non_persistent_ones_keep_their_init_values(saved):
    model, _ = load(TiedLM, saved)
    expected = trained()
    assert torch.equal(model.norm.running_mean, expected.norm.running_mean)
    assert int(model.norm.num_batches_tracked) == 7
    assert torch.equal(model.positions, torch.arange(12) * 3)


# --- the skeleton -----------------------------------------------------------------------------


def test_skeleton_has_parameters_on_meta_and_real_buffers():
    skeleton = build_skeleton(TiedLM, dtype=None)
    assert all(p.is_meta for p in skeleton.parameters())
    assert torch.equal(skeleton.positions, torch.arange(12) * 3)
    assert skeleton.norm.running_var.device.type == "cpu"
    assert skeleton.head.weight is skeleton.embed.weight


def test_skeleton_building_leaves_parameter_registration_unpatched():
    build_skeleton(TiedLM, dtype=None)
    assert not nn.Linear(2, 2).weight.is_meta


def test_large_linear_and_embedding_weights_are_never_allocated_on_the_cpu(monkeypatch):
    # Large layers are created on meta outright (an allocation each, slowed by a concurrent
    # read-ahead); small ones are built for real so their constructor values can be kept.
    created: list[tuple[tuple[int, ...], str]] = []
    original = nn.Module.register_parameter

    def spy(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            created.append((tuple(param.shape), param.device.type))
        original(module, name, param)

    monkeypatch.setattr(nn.Module, "register_parameter", spy)

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = nn.Linear(512, 256)  # 131,072 elements
            self.small = nn.Linear(16, 16)
            self.table = nn.Embedding(num_embeddings=1000, embedding_dim=128)
            self.explicit = nn.Linear(512, 256, True, "cpu")  # device given positionally: kept

    skeleton = build_skeleton(Mixed, dtype=None)
    devices = dict(created)
    assert [d for shape, d in created if shape == (256, 512)] == ["meta", "cpu"]
    assert devices[(1000, 128)] == "meta"
    assert devices[(16, 16)] == "cpu"
    assert all(p.is_meta for p in skeleton.parameters())
    assert not nn.Linear(512, 256).weight.is_meta  # the constructors are restored afterwards


def test_skeleton_is_built_under_the_requested_default_dtype():
    skeleton = build_skeleton(TiedLM, dtype=torch.float16)
    assert skeleton.embed.weight.dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32


# --- missing tensors ----------------------------------------------------------------------------


def test_a_missing_submodule_is_initialized_with_reset_parameters(tmp_path):
    tensors = stored(drop=lambda k: k.startswith("body.0."))
    st_save_file(tensors, tmp_path / "model.safetensors")
    model, report = load(TiedLM, tmp_path)
    assert report.missing == ["body.0.weight", "body.0.bias"]
    assert report.initialized == ["body.0.weight", "body.0.bias"]
    bound = 1 / 16**0.5  # nn.Linear.reset_parameters draws from U(-1/sqrt(in), 1/sqrt(in))
    assert model.body[0].weight.abs().max() <= bound
    assert torch.isfinite(model.body[0].weight).all()


def test_reset_parameters_keeps_the_loaded_tensors_of_a_partly_missing_module(tmp_path):
    source = trained()
    tensors = stored(source, drop=lambda k: k == "body.0.bias")
    st_save_file(tensors, tmp_path / "model.safetensors")
    model, report = load(TiedLM, tmp_path)
    assert report.initialized == ["body.0.bias"]
    assert torch.equal(model.body[0].weight, source.body[0].weight)
    assert model.body[0].bias.abs().max() <= 1 / 16**0.5


def test_a_missing_parameter_nothing_can_initialize_is_an_error(tmp_path):
    torch.manual_seed(0)
    tensors = {k: v for k, v in Scaled().state_dict().items() if k != "scale"}
    st_save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="scale.*no reset_parameters"):
        load(Scaled, tmp_path)


class PartlyReset(nn.Module):
    """reset_parameters() covers ``weight`` only."""

    def __init__(self, size: int = 3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.offset = nn.Parameter(torch.full((size,), 0.5))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def test_a_missing_parameter_nothing_initializes_keeps_its_constructor_value_with_a_warning(
    tmp_path, caplog
):
    st_save_file({"weight": torch.ones(3)}, tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="fastload"):
        model, _ = load(PartlyReset, tmp_path)
    assert torch.equal(model.offset, torch.full((3,), 0.5))
    assert any(
        "offset" in r.getMessage() and "constructor" in r.getMessage() for r in caplog.records
    )


def test_a_large_missing_parameter_nothing_initializes_is_an_error(tmp_path):
    size = fastload.core.model.skeleton.CONSTRUCTOR_VALUE_MAX_ELEMENTS + 1
    st_save_file({"weight": torch.ones(size)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="offset.*does not initialize"):
        load(lambda: PartlyReset(size), tmp_path)


def test_a_factory_returning_something_else_is_a_request_error(saved):
    with pytest.raises(RequestError, match="not an nn.Module"):
        load(lambda: "a model", saved)


def test_a_built_module_keeps_the_values_of_parameters_the_checkpoint_lacks(tmp_path):
    tensors = stored(drop=lambda k: k.startswith("body.0."))
    st_save_file(tensors, tmp_path / "model.safetensors")
    module = trained(seed=5)
    kept = module.body[0].weight
    load(module, tmp_path)
    assert module.body[0].weight is kept


# --- failures leave a built module unchanged -------------------------------------------------


def test_a_shape_mismatch_leaves_a_built_module_unchanged(tmp_path):
    tensors = stored()
    tensors["body.0.weight"] = torch.zeros(16, 8)
    st_save_file(tensors, tmp_path / "model.safetensors")
    module = trained(seed=3)
    params = dict(module.named_parameters())
    before = state(module)
    with pytest.raises(CheckpointError, match="body.0.weight"):
        load(module, tmp_path)
    assert dict(module.named_parameters()) == params
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())


def test_a_failure_after_the_copies_puts_the_original_tensors_back(tmp_path):
    # Built on meta by the caller; "scale" is missing and cannot be initialized, which fails
    # after every copy is done and the new tensors are swapped in.
    torch.manual_seed(0)
    tensors = {k: v for k, v in Scaled().state_dict().items() if k != "scale"}
    st_save_file(tensors, tmp_path / "model.safetensors")
    with torch.device("meta"):
        module = Scaled()
    params = dict(module.named_parameters())
    with pytest.raises(CheckpointError, match="scale"):
        load(module, tmp_path)
    assert dict(module.named_parameters()) == params
    assert all(p.is_meta for p in module.parameters())


def test_integer_tensors_do_not_load_into_floating_parameters(tmp_path):
    tensors = stored()
    tensors["body.1.weight"] = torch.arange(16)
    st_save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="body.1.weight.*I64"):
        load(TiedLM, tmp_path)


# --- options ---------------------------------------------------------------------------------


def test_dtype_converts_floating_tensors_and_keeps_integer_buffers(saved):
    model, report = load(TiedLM, saved, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.norm.num_batches_tracked.dtype == torch.int64
    assert model.positions.dtype == torch.int64
    assert torch.equal(model.embed.weight, trained().embed.weight.to(torch.bfloat16))
    assert report.dtype == "bfloat16"


def test_a_non_floating_dtype_is_a_request_error(saved):
    with pytest.raises(RequestError, match="dtype"):
        load(TiedLM, saved, dtype=torch.int32)


@pytest.mark.parametrize("read_mode", ["pread", "mmap"])
def test_both_read_modes_load_the_same_values_and_are_reported(saved, read_mode):
    # mmap="copy": read modes are how copies are read (the default would map this local file).
    model, report = load(TiedLM, saved, read_mode=read_mode, threads=1, mmap="copy")
    assert_equal_state(model, trained())
    assert report.read_mode == read_mode


def test_report_counts_bytes_files_and_phases(saved):
    _, report = load(TiedLM, saved, mmap="copy")
    stored = sum(v.numel() * v.element_size() for k, v in trained().state_dict().items())
    tied_copy = trained().head.weight.numel() * 4  # stored once
    assert report.bytes_read == stored - tied_copy
    assert report.bytes_written == report.bytes_read
    assert report.files == [str(saved / "model.safetensors")]
    assert list(report.seconds) == ["resolve", "skeleton", "plan", "allocate", "read", "finish"]
    assert report.total_seconds == sum(report.seconds.values())
    assert report.model_class == "TiedLM"
    text = str(report)
    assert "TiedLM" in text and "embed.weight = head.weight" in text


def test_report_to_dict_has_transformers_loading_info_keys(tmp_path):
    tensors = stored(drop=lambda k: k.startswith("body.0."))
    tensors["extra"] = torch.zeros(2)
    st_save_file(tensors, tmp_path / "model.safetensors")
    _, report = load(TiedLM, tmp_path)
    info = report.to_dict()
    assert info["missing_keys"] == {"body.0.weight", "body.0.bias"}
    assert info["unexpected_keys"] == {"extra"}


def test_without_output_loading_info_only_the_model_is_returned(saved):
    model = fastload.from_pretrained(TiedLM, saved, progress=False)
    assert isinstance(model, TiedLM)


def test_progress_bar_is_hidden_for_a_small_load_on_a_non_terminal(saved, capsys):
    fastload.from_pretrained(TiedLM, saved, progress=True)
    assert "fastload" not in capsys.readouterr().err


def test_progress_bar_shows_bytes_for_a_large_load(saved, capsys, monkeypatch):
    monkeypatch.setattr("fastload.core.basics.progress.PROGRESS_MIN_BYTES", 0)
    fastload.from_pretrained(TiedLM, saved, progress=True, mmap="copy")  # the bar counts copies
    err = capsys.readouterr().err
    assert "fastload" in err and "B" in err


def test_progress_false_hides_the_bar_even_for_a_large_load(saved, capsys, monkeypatch):
    monkeypatch.setattr("fastload.core.basics.progress.PROGRESS_MIN_BYTES", 0)
    fastload.from_pretrained(TiedLM, saved, progress=False)
    assert "fastload" not in capsys.readouterr().err


def test_unexpected_tensors_are_warned_through_the_fastload_logger(saved, caplog):
    tensors = {**stored(), "stray": torch.zeros(3)}
    st_save_file(tensors, saved / "model.safetensors")
    load(TiedLM, saved)
    records = [r for r in caplog.records if "stray" in r.getMessage()]
    assert records and records[0].name == "fastload" and records[0].levelno == logging.WARNING


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_loads_onto_cuda_with_buffers_and_ties(saved):
    model, report = load(TiedLM, saved, device="cuda", dtype=torch.bfloat16)
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == "cuda" for t in tensors)
    assert model.head.weight is model.embed.weight
    expected = trained().to(torch.bfloat16)
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name
    assert torch.equal(model.positions.cpu(), torch.arange(12) * 3)
    assert report.device == "cuda"


def test_a_meta_tensor_nothing_computes_is_an_error(tmp_path):
    class Derived(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))
            self.register_buffer("cache", self.weight.detach() * 2, persistent=False)

    st_save_file({"weight": torch.ones(3)}, tmp_path / "model.safetensors")
    with pytest.raises(FastloadError, match="cache"):
        load(Derived, tmp_path)


def test_config_and_model_kwargs_are_refused_for_a_built_module(saved):
    with pytest.raises(RequestError, match="already-built"):
        load(TiedLM(), saved, vocab=50)


def test_model_none_without_a_config_json_is_a_checkpoint_error(saved):
    with pytest.raises(CheckpointError, match="architectures"):
        load(None, saved)


def test_model_none_with_an_unknown_architecture_is_unsupported(saved):
    pytest.importorskip("transformers")
    (saved / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"]}))
    with pytest.raises(fastload.UnsupportedError, match="NoSuchModel"):
        load(None, saved)


def test_a_directory_naming_the_architecture_can_stand_for_the_model_class(tmp_path):
    from tiny_models import assert_same_tensors, make_checkpoint

    directory = make_checkpoint(tmp_path / "bert", "BertModel")
    by_path = fastload.from_pretrained(str(directory), directory, progress=False)
    by_config = fastload.from_pretrained(None, directory, progress=False)
    assert type(by_path).__name__ == "BertModel"
    assert_same_tensors(by_path, by_config)


# --- the cyclic garbage collector is paused while a load runs -------------------------------------


def test_a_load_pauses_the_garbage_collector_and_restores_it(saved):
    seen = []

    def build():
        seen.append(gc.isenabled())
        return TiedLM()

    assert gc.isenabled()
    fastload.from_pretrained(build, saved, progress=False)
    assert seen == [False]  # paused while the model was built and loaded
    assert gc.isenabled()


def test_a_failed_load_restores_the_collector_and_a_disabled_one_stays_disabled(tmp_path, saved):
    with pytest.raises(fastload.FastloadError):
        fastload.from_pretrained(TiedLM, tmp_path / "missing.safetensors", progress=False)
    assert gc.isenabled()
    gc.disable()
    try:
        fastload.from_pretrained(TiedLM, saved, progress=False)
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()


def test_concurrent_loads_resume_the_collector_when_the_last_one_ends():
    import threading

    from fastload.core.phases import without_gc_pauses

    both_in, first_out = threading.Barrier(2), threading.Event()
    seen: dict[str, bool] = {}

    @without_gc_pauses
    def first() -> None:
        both_in.wait(timeout=30)

    @without_gc_pauses
    def second() -> None:
        both_in.wait(timeout=30)
        first_out.wait(timeout=30)
        seen["after the first ended"] = gc.isenabled()

    t = threading.Thread(target=second)
    t.start()
    first()
    first_out.set()
    t.join()
    assert seen == {"after the first ended": False}  # still paused for the load under way
    assert gc.isenabled()
