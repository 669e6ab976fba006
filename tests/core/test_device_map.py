"""device_map: the "auto" planner as a pure function, resolving maps against a model, loading with a
map (every tensor on its mapped device, nothing left on meta) and running a model split over
devices. Tests that need a GPU skip cleanly without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import fastload
from fastload.core.basics.errors import RequestError, UnsupportedError
from fastload.core.devices.device_map import DeviceMap
from fastload.core.devices.dispatch import dispatch
from fastload.core.devices.resolution import (
    default_budgets,
    no_split_names,
    plan_auto,
    resolve_device_map,
    tensor_sizes,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _layers(n: int, size: int) -> dict[str, int]:
    """Sizes of ``n`` blocks, each a weight of ``size - 10`` bytes and a 10-byte norm."""
    sizes: dict[str, int] = {}
    for i in range(n):
        sizes[f"layers.{i}.mlp.weight"] = size - 10
        sizes[f"layers.{i}.norm.weight"] = 10
    return sizes


BLOCKS4 = [f"layers.{i}" for i in range(4)]


# --- the planner ------------------------------------------------------------------------------


def test_auto_plan_fills_the_devices_in_order_then_spills_to_the_cpu() -> None:
    sizes = {"embed.weight": 50, **_layers(4, 100), "head.weight": 50}
    plan = plan_auto(sizes, BLOCKS4, [("cuda:0", 250), ("cuda:1", 150), ("cpu", None)])
    assert plan == {
        "embed": "cuda:0",
        "layers.0": "cuda:0",
        "layers.1": "cuda:0",
        "layers.2": "cuda:1",
        "layers.3": "cpu",
        "head": "cpu",
    }


def test_auto_plan_moves_a_block_that_does_not_fit_whole_to_the_next_device() -> None:
    # 150 bytes left on cuda:0 after layers.0 would hold layers.1's weight but not its norm too
    plan = plan_auto(_layers(2, 100), ["layers.0", "layers.1"], [("cuda:0", 190), ("cpu", None)])
    assert plan == {"layers.0": "cuda:0", "layers.1": "cpu"}


def test_auto_plan_never_goes_back_to_an_earlier_device() -> None:
    sizes = {"a.weight": 80, "b.weight": 50, "c.weight": 10}
    plan = plan_auto(sizes, [], [("cuda:0", 100), ("cuda:1", 1000)])
    # c would fit in the 20 bytes cuda:0 has left, but the layers stay in order
    assert plan == {"a": "cuda:0", "b": "cuda:1", "c": "cuda:1"}


def test_auto_plan_keeps_a_linear_weight_and_its_bias_together() -> None:
    sizes = {"fc.weight": 60, "fc.bias": 30}
    plan = plan_auto(sizes, [], [("cuda:0", 80), ("cpu", None)])
    assert plan == {"fc": "cpu"}


def test_auto_plan_treats_a_nested_block_as_part_of_the_outermost_one() -> None:
    sizes = {"enc.layer.0.attn.weight": 40, "enc.layer.0.ffn.weight": 40, "head.weight": 10}
    plan = plan_auto(sizes, ["enc.layer.0", "enc.layer.0.attn"], [("cuda:0", 100)])
    assert plan == {"enc.layer.0": "cuda:0", "head": "cuda:0"}


def test_auto_plan_raises_naming_the_block_that_fits_nowhere() -> None:
    with pytest.raises(RequestError, match=r"'layers\.1' needs 200 B"):
        plan_auto(_layers(2, 200), ["layers.0", "layers.1"], [("cuda:0", 300), ("cpu", 100)])


def test_auto_plan_without_any_device_is_refused() -> None:
    with pytest.raises(RequestError, match="no device"):
        plan_auto({"w": 1}, [], [])


# --- budgets and sizes -------------------------------------------------------------------------


def test_max_memory_budgets_accept_size_strings_and_put_the_cpu_last() -> None:
    assert default_budgets({"cpu": "2KiB"}) == [("cpu", 2048)]
    assert default_budgets({"cpu": "3MB"}) == [("cpu", 3_000_000)]


def test_a_max_memory_size_that_is_not_a_size_is_refused() -> None:
    with pytest.raises(RequestError, match="not a size"):
        default_budgets({"cpu": "lots"})


def test_tensor_sizes_count_a_tied_weight_once() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert tensor_sizes(model) == {"0.weight": 10 * 4 * 4}


def test_no_split_names_come_from_the_model_class_declaration() -> None:
    transformers = pytest.importorskip("transformers")
    from tiny_models import make_config

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(make_config("llama"))
    assert no_split_names(model) == ["model.layers.0", "model.layers.1"]


# --- resolving a map against a model -----------------------------------------------------------


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def test_a_map_routes_each_tensor_to_its_longest_matching_prefix() -> None:
    dm = DeviceMap(
        {
            "": torch.device("cpu"),
            "blocks.1": torch.device("cuda:1"),
            "blocks.10": torch.device("cuda:0"),
        }
    )
    assert dm.device_of("blocks.1.weight") == torch.device("cuda:1")
    assert dm.device_of("blocks.10.weight") == torch.device("cuda:0")
    assert dm.device_of("blocks.11.weight") == torch.device("cpu")
    assert dm.device_of("head.bias") == torch.device("cpu")


def test_a_single_device_maps_everything_there() -> None:
    dm = resolve_device_map("cpu", Stack())
    assert dm.prefixes == {"": torch.device("cpu")}


def test_a_dict_map_that_leaves_a_tensor_without_device_is_refused() -> None:
    with pytest.raises(RequestError, match=r"head\.weight"):
        resolve_device_map({"embed": "cpu", "blocks": "cpu"}, Stack())


def test_a_dict_map_naming_no_module_of_the_model_is_refused() -> None:
    with pytest.raises(RequestError, match="blockz"):
        resolve_device_map({"blockz": "cpu", "": "cpu"}, Stack())


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="the machine has a cuda:7")
def test_a_map_naming_a_gpu_that_does_not_exist_is_refused() -> None:
    with pytest.raises(RequestError, match="cuda:7"):
        resolve_device_map({"": "cuda:7"}, Stack())


def test_offloading_to_disk_is_refused_as_unsupported() -> None:
    with pytest.raises(UnsupportedError, match="disk"):
        resolve_device_map({"head": "disk", "": "cpu"}, Stack())


def test_auto_map_that_does_not_fit_in_max_memory_is_refused() -> None:
    with pytest.raises(RequestError, match="no device has that much"):
        resolve_device_map("auto", Stack(), max_memory={"cpu": 100})


def test_auto_spilling_to_disk_keeps_room_on_the_cpu_for_the_largest_offloaded_block() -> None:
    model = nn.Sequential(*(nn.Linear(8, 8, bias=False) for _ in range(4)))  # 256 bytes each
    # 600 bytes would hold two blocks; the block being run from disk needs 256 of them
    spilled = resolve_device_map("auto", model, max_memory={"cpu": 600}, disk=True)
    assert spilled.as_strings() == {"0": "cpu", "1": "disk", "2": "disk", "3": "disk"}
    # a model that fits keeps everything in memory, with no room set aside
    fits = resolve_device_map("auto", model, max_memory={"cpu": 1024}, disk=True)
    assert set(fits.as_strings().values()) == {"cpu"}


def test_max_memory_without_auto_is_refused() -> None:
    with pytest.raises(RequestError, match="max_memory"):
        resolve_device_map("cpu", Stack(), max_memory={"cpu": 100})


# --- running a split model ---------------------------------------------------------------------


def test_dispatch_moves_each_modules_inputs_to_the_device_of_its_weights() -> None:
    model = Stack()
    model.blocks[1].to("meta")
    model.head.to("meta")
    dm = DeviceMap(
        {"": torch.device("cpu"), "blocks.1": torch.device("meta"), "head": torch.device("meta")}
    )
    seen: dict[str, torch.device] = {}
    dispatch(model, dm)
    for name in ("blocks.0", "blocks.1", "head"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda _m, args, name=name: seen.__setitem__(name, args[0].device)
        )
    out = model(torch.tensor([[1, 2, 3]]))
    assert seen == {
        "blocks.0": torch.device("cpu"),
        "blocks.1": torch.device("meta"),
        "head": torch.device("meta"),
    }
    assert out.shape == (1, 3, 4)


def test_dispatch_moves_the_inputs_of_a_module_mapped_with_the_rest_to_its_own_weights() -> None:
    # blocks.1 and head are mapped with the rest ("": meta) but run after blocks.0 (CPU): like a
    # final norm on the CPU after a GPU layer, they need inputs moved to their own weights.
    model = Stack()
    model.blocks[1].to("meta")
    model.head.to("meta")
    dm = DeviceMap({"": torch.device("meta"), "blocks.0": torch.device("cpu")})
    seen: dict[str, torch.device] = {}
    dispatch(model, dm)
    for name in ("blocks.0", "blocks.1", "head"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda _m, args, name=name: seen.__setitem__(name, args[0].device)
        )
    model.embed.to("cpu")
    model(torch.tensor([[1, 2, 3]]))
    assert seen == {
        "blocks.0": torch.device("cpu"),
        "blocks.1": torch.device("meta"),
        "head": torch.device("meta"),
    }


def test_dispatch_adds_nothing_for_a_single_device() -> None:
    assert dispatch(Stack(), DeviceMap({"": torch.device("cpu")})) == []


# --- from_pretrained ---------------------------------------------------------------------------


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    pytest.importorskip("transformers")
    from tiny_models import make_checkpoint, make_model

    directory = make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")
    return make_model("LlamaForCausalLM"), directory


def test_loading_with_a_dict_map_puts_every_tensor_on_its_device_and_none_on_meta(
    llama: tuple[nn.Module, Path],
) -> None:
    import transformers

    reference, directory = llama
    device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "": "cpu"}
    model, report = fastload.from_pretrained(
        transformers.LlamaForCausalLM, directory, device_map=device_map, output_loading_info=True
    )
    for name, tensor in _tensors(model).items():
        assert tensor.device == torch.device("cpu"), name
    expected = _tensors(reference)
    for name, tensor in _tensors(model).items():
        assert torch.equal(tensor, expected[name]), name
    assert report.device_map == {k: "cpu" for k in device_map}


def test_loading_with_an_auto_map_on_a_machine_without_gpu_puts_everything_on_the_cpu(
    llama: tuple[nn.Module, Path],
) -> None:
    import transformers

    _, directory = llama
    model = fastload.from_pretrained(
        transformers.LlamaForCausalLM, directory, device_map="auto", max_memory={"cpu": "1GB"}
    )
    assert {t.device for t in _tensors(model).values()} == {torch.device("cpu")}


def test_loading_with_both_device_and_device_map_is_refused(llama: tuple[nn.Module, Path]) -> None:
    import transformers

    with pytest.raises(RequestError, match="device_map"):
        fastload.from_pretrained(
            transformers.LlamaForCausalLM, llama[1], device="meta", device_map="cpu"
        )


def test_the_placement_gives_each_loaded_tensor_its_mapped_device() -> None:
    from fastload.core.plan.placement import Placement

    dm = DeviceMap({"": torch.device("cpu"), "blocks.1": torch.device("cuda:0")})
    placement = Placement(device=torch.device("cpu"), dtype=None, device_map=dm)
    template = torch.empty(8, 8, device="meta")
    assert placement.destination("blocks.1.weight", template, None, is_buffer=False).device == (
        torch.device("cuda:0")
    )
    assert placement.destination("blocks.0.weight", template, None, is_buffer=False).device == (
        torch.device("cpu")
    )


@needs_cuda
def test_a_model_split_between_gpu_and_cpu_loads_to_both_and_runs(
    llama: tuple[nn.Module, Path],
) -> None:
    import transformers
    from tiny_models import example_inputs

    reference, directory = llama
    model = fastload.from_pretrained(
        transformers.LlamaForCausalLM,
        directory,
        device_map={"model.layers.1": "cuda:0", "lm_head": "cuda:0", "": "cpu"},
    )
    devices = {n: t.device.type for n, t in _tensors(model).items()}
    assert devices["model.layers.1.mlp.up_proj.weight"] == "cuda"
    assert devices["model.layers.0.mlp.up_proj.weight"] == "cpu"
    inputs = example_inputs(reference)
    with torch.no_grad():
        expected = reference(**inputs).logits
        got = model(**inputs).logits
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("device_map", "options", "expected"),
    [
        ("cpu", {}, torch.device("cpu")),
        (torch.device("cpu"), {}, torch.device("cpu")),
        ({"": "cpu"}, {}, torch.device("cpu")),
        ({"model": "cpu", "lm_head": "cpu:0"}, {}, torch.device("cpu")),  # one device
        ({"model": "cpu", "lm_head": "disk"}, {"disk": True}, None),
        ("disk", {"disk": True}, None),
        ({"": "cpu"}, {"max_memory": {"cpu": "1GiB"}}, None),
        ("auto", {"max_memory": {"cpu": "1GiB"}}, None),
        ("auto", {"disk": True}, None),
    ],
)
def test_single_device_is_the_one_device_a_map_names_before_the_model_exists(
    device_map: object, options: dict, expected: torch.device | None
) -> None:
    from fastload.core.devices.resolution import single_device

    assert single_device(device_map, **options) == expected  # type: ignore[arg-type]


@pytest.mark.skipif(torch.accelerator.is_available(), reason="'auto' fills an accelerator first")
@pytest.mark.parametrize("mode", ["auto", "balanced", "sequential"])
def test_a_planned_map_without_an_accelerator_is_the_cpu(mode: str) -> None:
    from fastload.core.devices.resolution import single_device

    assert single_device(mode) == torch.device("cpu")
