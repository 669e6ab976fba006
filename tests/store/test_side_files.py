"""A load from object storage that is killed mid-load leaves its side-files directory (the
config files fetched beside the weights) behind; the next load from object storage on the machine
removes it, and leaves alone what is not its to remove. Loads run as users run them: fresh
interpreters, ``TMPDIR`` pointing at a directory of the test's own, against the S3-compatible
server of tests/support/s3_server.py behind a proxy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from s3_server import FaultProxy, S3Server

pytest.importorskip("boto3")
pytest.importorskip("transformers")

LOAD = textwrap.dedent(
    """
    import sys
    import fastload
    model = fastload.from_pretrained(sys.argv[1], progress=False)
    print("loaded", sum(p.numel() for p in model.parameters()))
    """
)


def _side_dirs(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.iterdir() if p.name.startswith("fastload-side-files-"))


def test_a_load_killed_mid_load_leaves_nothing_once_the_next_load_ran(
    env: S3Server, tmp_path: Path
) -> None:
    from tiny_models import make_model, save_checkpoint

    local = save_checkpoint(make_model("LlamaForCausalLM"), tmp_path / "llama")
    url = env.upload(local, "models", "side-files-killed")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "user.py"
    script.write_text(LOAD)
    proxy = FaultProxy(env.port)
    run_env = {**os.environ, **env.env(proxy.endpoint), "TMPDIR": str(tmp)}
    try:
        # the first load is killed when it asks for the weights, its config files fetched
        killed = subprocess.Popen(
            [sys.executable, str(script), url], env=run_env, stdout=subprocess.PIPE
        )

        def kill_at_the_weights(path: str, first: int) -> None:
            if path.endswith(".safetensors") and first > 8:  # past the header's two requests
                killed.send_signal(signal.SIGKILL)
                time.sleep(0.5)  # this GET is not answered before the process is gone

        proxy.on_get = kill_at_the_weights
        killed.wait(timeout=120)
        assert killed.returncode == -signal.SIGKILL
        left = _side_dirs(tmp)
        assert len(left) == 1 and (left[0] / "config.json").is_file(), left
        # a directory of a live process (this one) and one of another pid namespace stay
        space = os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]")
        live = tmp / f"fastload-side-files-{space}-{os.getpid()}-keep"
        other = tmp / f"fastload-side-files-1-{killed.pid}-other-namespace"
        for kept in (live, other):
            kept.mkdir()

        proxy.on_get = None
        done = subprocess.run(
            [sys.executable, str(script), url],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("loaded"), done.stdout
    finally:
        proxy.close()
    assert _side_dirs(tmp) == sorted([live, other])
