"""Loads onto a CUDA device, written the ways transformers' users write them, against
transformers' own loads of the same checkpoint; and the host memory such a load takes, read from
the operating system in a fresh process.

Every test here needs a GPU (``pytest -m cuda`` on a GPU machine: ``scripts/gpu-check.sh``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fresh import run_script
from tiny_models import (
    assert_same_tensors,
    example_inputs,
    make_checkpoint,
    model_class,
    outputs_of,
)

import fastload

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("unpatched"),
]

LLAMA = "LlamaForCausalLM"


@pytest.fixture(scope="module")
def sharded_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with tied embeddings, in three or more shards (fp32)."""
    return make_checkpoint(
        tmp_path_factory.mktemp("llama"), LLAMA, max_shard_size="40KB", tie_word_embeddings=True
    )


def assert_same_model_on_cuda(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """Same tensors (bitwise), all on CUDA, same ties, same outputs."""
    assert_same_tensors(ours, theirs)
    assert all(t.is_cuda for t in [*ours.parameters(), *ours.buffers()])
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (
        theirs.lm_head.weight is theirs.model.embed_tokens.weight
    )
    inputs = {k: v.cuda() for k, v in example_inputs(theirs).items()}
    for x, y in zip(outputs_of(ours, inputs), outputs_of(theirs, inputs), strict=True):
        torch.testing.assert_close(x, y)


def test_device_map_cuda_loads_what_transformers_loads(sharded_tied: Path) -> None:
    cls = model_class(LLAMA)
    ours = fastload.from_pretrained(cls, sharded_tied, device_map="cuda", progress=False)
    theirs = cls.from_pretrained(sharded_tied, device_map="cuda")
    assert_same_model_on_cuda(ours, theirs)
    assert getattr(ours, "hf_device_map", None) == getattr(theirs, "hf_device_map", None)


def test_an_ambient_cuda_device_under_the_patch_loads_what_transformers_loads(
    sharded_tied: Path, transformers_loads: list[str]
) -> None:
    cls = model_class(LLAMA)
    with torch.device("cuda"):
        theirs = cls.from_pretrained(sharded_tied)
    transformers_loads.clear()
    fastload.patch_transformers()
    with torch.device("cuda"):
        ours = cls.from_pretrained(sharded_tied)
    assert transformers_loads == [], "transformers' own loader ran: fastload did not serve it"
    assert_same_model_on_cuda(ours, theirs)


def test_a_cuda_default_device_under_the_patch_loads_what_transformers_loads(
    sharded_tied: Path, transformers_loads: list[str]
) -> None:
    cls = model_class(LLAMA)
    torch.set_default_device("cuda")
    try:
        theirs = cls.from_pretrained(sharded_tied)
        transformers_loads.clear()
        fastload.patch_transformers()
        ours = cls.from_pretrained(sharded_tied)
    finally:
        torch.set_default_device("cpu")
    assert transformers_loads == [], "transformers' own loader ran: fastload did not serve it"
    assert_same_model_on_cuda(ours, theirs)


def test_an_fp32_checkpoint_loads_onto_cuda_in_bf16_as_transformers_loads_it(
    sharded_tied: Path,
) -> None:
    cls = model_class(LLAMA)
    ours = fastload.from_pretrained(
        cls, sharded_tied, device="cuda", dtype=torch.bfloat16, progress=False
    )
    theirs = cls.from_pretrained(sharded_tied, device_map="cuda", dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert_same_model_on_cuda(ours, theirs)


# 12 tensors of 64 MiB (bf16): 768 MiB, six times the default staging pool.
_BIG = """
import torch
from torch import nn

class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ParameterList(
            nn.Parameter(torch.empty(8192, 4096, dtype=torch.bfloat16)) for _ in range(12)
        )
"""


def test_host_memory_of_a_cuda_load_stays_within_the_staging_pool_plus_256_mib(
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"blocks.{i}": torch.randn(8192, 4096, generator=generator).to(torch.bfloat16)
        for i in range(12)
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    sums = {k: float(v.double().sum()) for k, v in tensors.items()}
    del tensors
    out = run_script(
        _BIG
        + """
import json, sys
import fastload
from fastload.core.memory.staging import DEFAULT_STAGING_BYTES

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

torch.empty(1, device="cuda")  # the CUDA context exists before the baseline is read
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from the current RSS
before = status("VmRSS")
model = fastload.from_pretrained(Big, sys.argv[1], device="cuda", progress=False)
torch.cuda.synchronize()
peak = status("VmHWM") - before
sums = {f"blocks.{i}": float(p.double().sum()) for i, p in enumerate(model.blocks)}
print(json.dumps({"peak": peak, "staging": DEFAULT_STAGING_BYTES, "sums": sums,
                  "cuda": all(p.is_cuda for p in model.parameters())}))
""",
        path,
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["cuda"]
    assert result["sums"] == sums
    assert result["peak"] <= result["staging"] + (256 << 20), result["peak"]
