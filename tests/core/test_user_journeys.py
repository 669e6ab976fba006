"""What users do with a model right after a default load, each in a fresh interpreter that imports
only what such a user imports (torch and fastload; transformers comes in through fastload).

A default load gives views of the checkpoint file (zero-copy); each view has a storage of its own
bytes, so saving, pickling or sharing one parameter carries that parameter, not the checkpoint.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from fresh import run_script  # noqa: E402
from tiny_models import make_checkpoint  # noqa: E402

#: bigger than the tiny default, so that one parameter and the whole file differ by ~1000x
_WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("journeys") / "llama"
    return make_checkpoint(directory, "LlamaForCausalLM", tie_word_embeddings=True, **_WIDE)


def run_user(script: str, *args: object, cwd: Path | None = None) -> dict:
    """Runs ``script`` as a user's file in a fresh interpreter (offline) with ``args`` as
    ``sys.argv[1:]``; the script prints one JSON line last, returned here."""
    out = run_script(script, *args, cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.strip().splitlines()[-1])


def test_torch_save_of_one_parameter_writes_that_parameter_not_the_checkpoint(llama, tmp_path):
    out = run_user(
        """
        import json, os, sys
        import torch, fastload
        model = fastload.from_pretrained(sys.argv[1], progress=False)
        norm = model.model.norm.weight
        torch.save(norm, sys.argv[2])
        back = torch.load(sys.argv[2], weights_only=True)
        print(json.dumps({
            "param": norm.numel() * norm.element_size(),
            "written": os.path.getsize(sys.argv[2]),
            "reloaded_storage": back.untyped_storage().nbytes(),
            "equal": bool(torch.equal(back, norm)),
        }))
        """,
        llama,
        tmp_path / "norm.pt",
    )
    checkpoint = (llama / "model.safetensors").stat().st_size
    assert out["equal"]
    assert out["reloaded_storage"] == out["param"]
    # the parameter plus torch.save's zip records (~1.5 KiB), nowhere near the checkpoint's size
    assert out["written"] < out["param"] + 4096 < checkpoint


def test_pickling_one_parameter_carries_that_parameter_only(llama):
    out = run_user(
        """
        import json, pickle, sys
        import fastload
        model = fastload.from_pretrained(sys.argv[1], progress=False)
        weight = model.model.layers[0].self_attn.q_proj.weight
        print(json.dumps({"param": weight.numel() * weight.element_size(),
                          "pickled": len(pickle.dumps(weight))}))
        """,
        llama,
    )
    assert out["param"] < out["pickled"] < out["param"] + 4096


def test_share_memory_of_one_parameter_moves_that_parameter_alone(llama):
    out = run_user(
        """
        import json, sys
        import torch, fastload
        model = fastload.from_pretrained(sys.argv[1], progress=False)
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
        norm = model.model.norm.weight
        norm.share_memory_()
        moved = sorted(n for n, p in model.named_parameters() if p.data_ptr() != before[n])
        equal = all(torch.equal(p, values[n]) for n, p in model.named_parameters())
        print(json.dumps({"moved": moved, "shared": norm.is_shared(), "equal": equal}))
        """,
        llama,
    )
    assert out == {"moved": ["model.norm.weight"], "shared": True, "equal": True}


def test_a_parameter_sent_to_a_worker_process_arrives_with_its_values(llama):
    out = run_user(
        """
        import json, sys
        import torch, torch.multiprocessing as mp, fastload

        def worker(queue, answers):
            answers.put(float(queue.get().double().sum()))

        if __name__ == "__main__":
            model = fastload.from_pretrained(sys.argv[1], progress=False)
            weight = model.model.layers[1].mlp.down_proj.weight
            ctx = mp.get_context("spawn")  # as DataLoader workers on macOS/Windows and CUDA
            queue, answers = ctx.Queue(), ctx.Queue()
            child = ctx.Process(target=worker, args=(queue, answers), daemon=True)
            child.start()
            queue.put(weight)
            got = answers.get(timeout=120)
            child.join()
            print(json.dumps({"got": got, "want": float(weight.double().sum()),
                              "exit": child.exitcode}))
        """,
        llama,
    )
    assert out["exit"] == 0
    assert out["got"] == out["want"]


@pytest.mark.parametrize("library", ["fastload", "safetensors.torch"])
def test_save_model_and_load_model_work_on_a_default_load(llama, tmp_path, library):
    pytest.importorskip(library)
    out = run_user(
        f"""
        import json, sys
        import torch, fastload
        from {library} import load_model, save_model
        model = fastload.from_pretrained(sys.argv[1], progress=False)
        save_model(model, sys.argv[2])
        again = fastload.from_pretrained(sys.argv[1], progress=False)
        with torch.no_grad():
            for p in again.parameters():
                p.zero_()
        missing, unexpected = load_model(again, sys.argv[2])
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     again.state_dict().values()))
        tied = again.lm_head.weight is again.model.embed_tokens.weight
        print(json.dumps({{"same": same, "tied": tied, "missing": sorted(missing),
                          "unexpected": sorted(unexpected)}}))
        """,
        llama,
        tmp_path / "saved.safetensors",
    )
    assert out == {"same": True, "tied": True, "missing": [], "unexpected": []}


_OFFLOADED = """
    import json, os, sys
    import torch, fastload
    directory, offload = sys.argv[1], sys.argv[2]
    ids = torch.tensor([[1, 5, 9, 3]])
    reference = fastload.from_pretrained(directory, progress=False, mmap="copy")
    with torch.no_grad():
        want = reference(ids).logits
    model = fastload.from_pretrained(
        directory,
        progress=False,
        device_map={{"model.layers.1": "disk", "": "cpu"}},
        offload_folder=offload,
    )
    assert model.model.layers[1].mlp.up_proj.weight.device.type == "meta"
    {between}
    with torch.no_grad():
        got = model(ids).logits
    print(json.dumps({{"equal": bool(torch.equal(got, want))}}))
"""


def test_a_disk_offloaded_model_keeps_reading_the_checkpoint_it_loaded_after_a_new_save(
    llama, tmp_path
):
    # A new version published into the same directory (fastload's crash-safe save swaps the
    # files in) must not reach the offloaded layers of a model already loaded from the old one.
    directory = tmp_path / "published"
    directory.mkdir()
    for f in llama.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    between = """
    newer = fastload.from_pretrained(directory, progress=False, mmap="copy")
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(1.0)
    fastload.save_pretrained(newer, directory)
    """
    script = _OFFLOADED.format(between=textwrap.indent(textwrap.dedent(between), "    ").strip())
    out = run_user(script, directory, tmp_path / "offload")
    assert out == {"equal": True}


def test_a_disk_offloaded_model_loaded_by_a_relative_path_survives_a_chdir(llama, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = _OFFLOADED.format(between=f"os.chdir({str(elsewhere)!r})")
    out = run_user(script, llama.name, tmp_path / "offload", cwd=llama.parent)
    assert out == {"equal": True}


def test_sentence_transformers_under_the_patch_gives_the_embeddings_it_gives_alone():
    pytest.importorskip("sentence_transformers")
    from fastload.tools.demo import model_directory

    out = run_user(
        """
        import json, sys
        import torch, fastload
        from fastload.hf import patch
        from sentence_transformers import SentenceTransformer
        sentences = ["fastload reads checkpoints", "a second sentence"]
        alone = SentenceTransformer(sys.argv[1], device="cpu").encode(
            sentences, convert_to_tensor=True
        )
        with fastload.patch_transformers():
            model = SentenceTransformer(sys.argv[1], device="cpu")
        served = patch.last_report is not None and patch.last_report.tensors_loaded
        patched = model.encode(sentences, convert_to_tensor=True)
        print(json.dumps({"equal": bool(torch.equal(alone, patched)), "served": served}))
        """,
        model_directory(),
    )
    assert out == {"equal": True, "served": 103}
