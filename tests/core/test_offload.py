"""Disk offload: parameters a device map sends to "disk" stay in the safetensors file and are
read by accelerate's hooks when their module runs; the model's outputs do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tiny_models import (  # noqa: E402
    assert_same_outputs,
    example_inputs,
    make_checkpoint,
    outputs_of,
)

import fastload  # noqa: E402
from fastload import UnsupportedError  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


def load(*args, **kwargs):
    kwargs.setdefault("progress", False)
    return fastload.from_pretrained(*args, **kwargs)


def test_a_layer_mapped_to_disk_is_not_read_and_the_outputs_are_unchanged(llama, tmp_path):
    reference, full = load(str(llama), output_loading_info=True)
    model, report = load(
        str(llama),
        device_map={"model.layers.1": "disk", "": "cpu"},
        offload_folder=tmp_path / "offload",
        output_loading_info=True,
    )
    assert model.model.layers[1].mlp.up_proj.weight.device.type == "meta"
    assert model.model.layers[0].mlp.up_proj.weight.device.type == "cpu"
    assert report.bytes_offloaded > 0
    assert report.bytes_read + report.bytes_offloaded == full.bytes_read
    assert model.hf_device_map == {"model.layers.1": "disk", "": "cpu"}
    assert_same_outputs(model, reference, example_inputs(reference))


def test_the_auto_planner_spills_to_disk_what_does_not_fit_with_an_offload_folder(llama, tmp_path):
    reference = load(str(llama))
    model, report = load(
        str(llama),
        device_map="auto",
        max_memory={"cpu": 20_000},
        offload_folder=tmp_path / "offload",
        output_loading_info=True,
    )
    assert "disk" in report.device_map.values()
    assert_same_outputs(model, reference, example_inputs(reference))


def test_an_accelerate_mode_spills_to_disk_with_an_offload_folder(llama, tmp_path):
    reference = load(str(llama))
    model = load(
        str(llama),
        device_map="sequential",
        max_memory={"cpu": 20_000},
        offload_folder=tmp_path / "offload",
    )
    assert "disk" in model.hf_device_map.values()
    assert_same_outputs(model, reference, example_inputs(reference))


def test_disk_in_a_device_map_without_an_offload_folder_is_unsupported(llama):
    with pytest.raises(UnsupportedError, match="offload_folder"):
        load(str(llama), device_map={"model.layers.1": "disk", "": "cpu"})


def test_a_pickle_checkpoint_cannot_be_offloaded_to_disk(tmp_path, llama):
    from safetensors.torch import load_file

    directory = tmp_path / "pickled"
    directory.mkdir()
    (directory / "config.json").write_text((llama / "config.json").read_text())
    torch.save(load_file(llama / "model.safetensors"), directory / "pytorch_model.bin")
    with pytest.raises(UnsupportedError, match="safetensors"):
        load(
            str(directory),
            allow_pickle=True,
            device_map={"model.layers.1": "disk", "": "cpu"},
            offload_folder=tmp_path / "offload",
        )


def test_tensors_missing_from_the_checkpoint_under_a_disk_prefix_are_served_from_memory(
    tmp_path,
):
    base = make_checkpoint(tmp_path / "base", "LlamaModel")
    model_class = __import__("transformers").LlamaForCausalLM
    model = load(
        model_class,
        base,
        device_map={"lm_head": "disk", "": "cpu"},
        offload_folder=tmp_path / "offload",
    )
    logits = outputs_of(model, example_inputs(model))[0]
    assert torch.isfinite(logits).all()


def _mapped_file_at(address: int) -> str | None:
    """The file whose mapping holds ``address``, from the kernel's map of this process."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, stop = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < stop:
            return fields[5] if len(fields) == 6 else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
@pytest.mark.parametrize("mmap", ["auto", "copy"])
def test_an_offloaded_block_runs_on_views_of_the_file_unless_mmap_is_copy(llama, tmp_path, mmap):
    reference = load(str(llama))
    model = load(
        str(llama),
        device_map={"model.layers.1": "disk", "": "cpu"},
        offload_folder=tmp_path / "offload",
        mmap=mmap,
    )
    seen: list[str | None] = []
    up = model.model.layers[1].mlp.up_proj
    run = up._old_forward  # what accelerate's hook calls once it has brought the weight in

    def watched(*args, **kwargs):
        seen.append(_mapped_file_at(up.weight.data_ptr()))
        return run(*args, **kwargs)

    up._old_forward = watched
    assert_same_outputs(model, reference, example_inputs(reference))
    assert seen, "the offloaded block did not run"
    files = {Path(s).resolve() if s else None for s in seen}
    checkpoint = {p.resolve() for p in Path(llama).glob("*.safetensors")}
    if mmap == "auto":  # its bytes are the file's pages, not an allocation per forward
        assert files <= checkpoint
    else:
        assert not files & checkpoint
    assert up.weight.device.type == "meta"  # and it is put back after the forward
