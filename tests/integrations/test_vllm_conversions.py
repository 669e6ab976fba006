"""The vLLM load format's copies into parameters of another dtype than the checkpoint's (a float32
engine serving a bf16 checkpoint), without vLLM: the copy watch hands such a converting copy to
the engine (positioned reads, converting on the way) instead of torch, whose copy reads the
file's mapping: a shard truncated during a reload is then an error naming the file, not a
SIGBUS that kills the engine. The same paths under a real engine:
tests/integrations/test_vllm_reload.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastload.integrations.vllm.adopt import CopyWatch
from fastload.integrations.vllm.options import VllmLoadOptions
from fastload.integrations.vllm.weights import CheckpointWeights
from fastload.safetensors.saving import save_file

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX mappings and signals")


@pytest.mark.parametrize(
    ("stored", "wanted"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
    ids=["bf16-into-f32", "f32-into-bf16"],
)
@pytest.mark.parametrize("reload", [False, True], ids=["load", "reload"])
def test_a_converting_copy_is_the_engines_and_gives_torchs_values(
    tmp_path: Path, stored: torch.dtype, wanted: torch.dtype, reload: bool
) -> None:
    torch.manual_seed(0)
    # each at least the 256 KiB below which a load's watch leaves a copy to torch
    tensors = {"w": torch.randn(512, 256).to(stored), "q": torch.randn(512, 256).to(stored)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    origins: dict[int, object] = {}
    stream = CheckpointWeights([str(path)], VllmLoadOptions(), origins=origins)
    w = torch.nn.Parameter(torch.empty(512, 256, dtype=wanted), requires_grad=False)
    fused = torch.nn.Parameter(torch.zeros(1024, 256, dtype=wanted), requires_grad=False)
    # a load's watch (queued copies, torch's below 256 KiB) and a reload's (every copy made now)
    settings = {"engine_min": 0} if reload else {"defer": True}
    watch = CopyWatch(origins, [("w", w), ("fused", fused)], tp_size=1, adopt=False, **settings)
    with watch:
        for name, tensor in stream:
            if name == "w":
                w.data.copy_(tensor)
            else:  # into the rows of a fused parameter
                fused.data.narrow(0, 256, 512).copy_(tensor)
    stream.close()
    assert torch.equal(w, tensors["w"].to(wanted))
    assert torch.equal(fused[256:768], tensors["q"].to(wanted))
    assert torch.count_nonzero(fused[:256]) == 0 and torch.count_nonzero(fused[768:]) == 0
    assert watch.engine_bytes == tensors["w"].nbytes + tensors["q"].nbytes


#: a reload's copy watch over a bf16 checkpoint whose file is cut short once the stream has
#: handed out its tensor, before the weight loader's copy into a float32 parameter
_TRUNCATED = """
import json, os, sys
import torch
from fastload import FastloadError
from fastload.integrations.vllm.adopt import CopyWatch
from fastload.integrations.vllm.options import VllmLoadOptions
from fastload.integrations.vllm.weights import CheckpointWeights

path = sys.argv[1]
origins = {}
stream = CheckpointWeights([path], VllmLoadOptions(), origins=origins)
param = torch.nn.Parameter(torch.empty(1024, 1024, dtype=torch.float32), requires_grad=False)
watch = CopyWatch(origins, [], tp_size=1, adopt=False, engine_min=0)
try:
    with watch:
        for name, tensor in stream:
            os.truncate(path, 1024)
            param.data.copy_(tensor)
    out = {"copied": True}
except FastloadError as e:
    out = {"error": type(e).__name__, "message": str(e)}
finally:
    stream.close()
print(json.dumps(out))
"""


def test_a_shard_truncated_before_a_converting_copy_is_an_error_naming_it_not_a_sigbus(
    tmp_path: Path,
) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(1024, 1024).to(torch.bfloat16)}, path)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TRUNCATED), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out.get("error") == "CheckpointError", out
    assert str(path) in out["message"] and "[file-shrunk]" in out["message"], out
